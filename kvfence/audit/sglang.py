"""The rules of `kvfence audit sglang`: what in one SGLang PD server, or in a prefill/decode pair, can leak KV.

What it knows: each rule (`RULES`, with the finding it raises), judged on `ServerSnapshot`s read by
kvfence.audit.sglang_server, and which release does what (kvfence.audit.sglang_releases), so each rule states
the version it judged by. No rule turns an unknown value into a critical finding.
What it does not know: how a server was read (live, saved, or a launch command): the snapshot says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfence.audit import sglang_releases as rel
from kvfence.audit.findings import Finding, Location, Rule, Severity
from kvfence.audit.metrics import metric_findings
from kvfence.audit.sglang_server import (
    CANARY_UNSUPPORTED,
    ENV_DEFERRED_RELEASE,
    ENV_MOONCAKE_BATCH,
    POOL_KIND_LABEL,
    SERVER_INFO_KEYS,
    ServerSnapshot,
    allocation_policy,
    architectures,
    as_bool,
    canary_mode,
    checksum_enabled,
    context_length,
    deferred_release,
    kv_cache_dtype,
    model_dtype,
    model_id,
    mooncake_batch_limit,
    page_size,
    pool_binds_prompts,
    pool_kind,
    pool_tokens,
    rank_states,
    transfer_backend,
)

MIN_SAFE_VERSION = (0, 5, 22)

RULES = [
    Rule("input-unrecognised", "the input is not an SGLang /server_info, launch command or metrics scrape"),
    Rule("launch-command-invalid", "SGLang's own argument parser would refuse this launch command"),
    Rule("version-unknown", "the SGLang version could not be read"),
    Rule("version-outside-range", "the rules are grounded in SGLang 0.5.19 .. 0.5.23 only"),
    Rule("version-below-0.5.22", "a release with a known KV handoff hazard"),
    Rule("role-mode-mismatch", "the server runs another disaggregation mode than the role it was given for"),
    Rule("context-exceeds-pool", "the context length is above the KV pool"),
    Rule("pool-bounds-prompts", "max_req_input_len shows the pool, not the context, limits prompts"),
    Rule("context-vs-pool-unchecked", "context length or pool size unknown"),
    Rule("kv-canary-off", "--kv-canary is off"),
    Rule("kv-canary-unsupported-pool", "--kv-canary set for a pool the canary cannot attach to"),
    Rule("kv-checksum-uncovered-layout", "the KV checksum has no indices for this pool's state buffers"),
    Rule("deferred-decode-release-off", "decode frees aborted pages a prefill write may still target"),
    Rule("deferred-decode-release-unknown", "deferred decode release cannot be determined"),
    Rule("deferred-decode-release-unsupported", "no setting enables deferred release on this backend/release"),
    Rule("mooncake-unbounded-batch", "Mooncake sends each request in one unbounded batch"),
    Rule("pd-version-mismatch", "prefill and decode run different releases"),
    Rule("pd-context-length-mismatch", "prefill and decode context lengths differ"),
    Rule("pd-page-size-mismatch", "prefill and decode page sizes differ"),
    Rule("pd-kv-dtype-mismatch", "prefill and decode KV dtypes differ"),
    Rule("pd-dtype-mismatch", "prefill and decode model dtypes differ"),
    Rule("pd-model-mismatch", "prefill and decode serve different models"),
    Rule("pd-transfer-backend-mismatch", "prefill and decode transfer backends differ"),
    Rule("pd-allocation-policy-mismatch", "prefill and decode allocation policies differ"),
    Rule("pd-pool-size-differs", "prefill and decode pools differ"),
    Rule("kv-checksum-unavailable", "this release has no KV checksum"),
    Rule("kv-checksum-one-side", "the KV checksum is on for one side only"),
    Rule("kv-checksum-off", "the KV checksum is off"),
    Rule("kv-checksum-skipped-layout", "the KV checksum is on but the layouts differ"),
    Rule("allow-auto-truncate", "--allow-auto-truncate is on"),
    Rule("metrics-transfer-failures", "the server counted KV transfer or bootstrap failures"),
    Rule("metrics-deferred-release-timeouts", "decode released held pages without a drain acknowledgement"),
]


def _f(rule: str, sev: Severity, s: ServerSnapshot | None, role: str, message: str, fix: str, *names: str) -> Finding:
    """A finding about one server, placed at the script / JSON line that sets the first of `names` it has."""
    if s is None:
        return Finding(rule, sev, role, message, fix)
    return Finding(rule, sev, role, message, fix, s.source, s.line_of(*names))


def _both(
    rule: str, sev: Severity, p: ServerSnapshot, d: ServerSnapshot, message: str, fix: str, *names: str
) -> Finding:
    """A finding about the pair, placed on the prefill side's line and the decode side's."""
    return Finding(
        rule, sev, "both", message, fix, p.source, p.line_of(*names), (Location(d.source, d.line_of(*names)),)
    )


def _rule_input(s: ServerSnapshot) -> list[Finding]:
    out: list[Finding] = []
    if not s.recognised:
        out.append(
            _f(
                "input-unrecognised",
                Severity.WARNING,
                s,
                s.role,
                f"{s.source} has none of the fields SGLang's /server_info reports ({', '.join(SERVER_INFO_KEYS)}) "
                "and no sglang: metrics; nothing below is about this server",
                "give the body of GET /server_info (or a bundle written by --save-bundle)",
            )
        )
    if s.problems:
        out.append(
            _f(
                "launch-command-invalid",
                Severity.WARNING,
                s,
                s.role,
                "SGLang's argument parser would not accept this launch command as written: " + "; ".join(s.problems),
                "fix the flags (see `sglang serve --help` for this release); values not read are treated as unknown",
                "version",
            )
        )
    return out


def _rule_version(s: ServerSnapshot) -> list[Finding]:
    v = s.version_tuple
    if v is None:
        return [
            _f(
                "version-unknown",
                Severity.WARNING,
                s,
                s.role,
                f"could not tell the SGLang version from {s.source}; rules that depend on it say 'unknown'",
                "audit the live /server_info (it reports 'version') or pass --sglang-version",
            )
        ]
    out: list[Finding] = []
    if not rel.known(v):
        out.append(
            _f(
                "version-outside-range",
                Severity.INFO,
                s,
                s.role,
                f"SGLang {s.version} is outside 0.5.19 .. 0.5.23, the releases these rules were checked against",
                "treat version-dependent findings as the nearest checked release's behaviour",
            )
        )
    if v >= MIN_SAFE_VERSION or v < rel.FIRST:
        return out
    fate = rel.stub_fate(v)
    if rel.stub_reaches_decode(v):
        sev = Severity.CRITICAL
        why = (
            f"a prompt rejected on prefill is {fate}, and decode, which allocated the whole prompt, decodes over "
            "pages it never received (#33507, #30233); no KV checksum; deferred decode release off by default"
        )
    elif v < rel.KV_CHECKSUM_FROM:
        sev = Severity.WARNING
        why = f"a rejected prompt is {fate}, but there is no KV checksum and deferred decode release is off by default"
    else:
        sev = Severity.WARNING
        why = "no --disaggregation-decode-allocation-policy (added in 0.5.22)"
    out.append(
        _f(
            "version-below-0.5.22",
            sev,
            s,
            s.role,
            f"SGLang {s.version} is below 0.5.22: {why}",
            "upgrade prefill and decode to SGLang >= 0.5.22 (0.5.23 also warns at start-up when the pool is below "
            "the context)",
            "version",
        )
    )
    return out


def _rule_role(s: ServerSnapshot) -> list[Finding]:
    modes = {str(m) for m in [s.args.get("disaggregation_mode")] if m}
    modes |= {str(st["disaggregation_mode"]) for st in rank_states(s) if st.get("disaggregation_mode")}
    if s.metrics is not None:
        modes |= {m for m in s.metrics.label_values("engine_type") if m in ("prefill", "decode", "unified")}
    modes = {"null" if m == "unified" else m for m in modes}
    wrong = sorted(m for m in modes if m != s.role)
    if not wrong:
        return []
    return [
        _f(
            "role-mode-mismatch",
            Severity.CRITICAL,
            s,
            s.role,
            f"given as the {s.role} server but it runs with --disaggregation-mode {', '.join(wrong)}",
            "check the URLs / files passed to --prefill and --decode; each side must run its own mode",
            "disaggregation_mode",
        )
    ]


def _rule_context_vs_pool(s: ServerSnapshot) -> list[Finding]:
    ctx = context_length(s)
    pool = pool_tokens(s)
    v = s.version_tuple
    if ctx.value is None and pool.value is not None and pool_binds_prompts(s):
        return [
            _f(
                "pool-bounds-prompts",
                Severity.WARNING,
                s,
                s.role,
                f"max_req_input_len {s.args.get('max_req_input_len')} = pool {pool.value} - 6: the KV pool, not the "
                "context length, limits prompts, so the context length is at least the pool",
                "read the context length (/v1/models max_model_len, or --context-length) and keep it <= the pool",
            )
        ]
    if ctx.value is None or pool.value is None:
        missing = " and ".join(x for x, f in (("context length", ctx), ("pool size", pool)) if f.value is None)
        return [
            _f(
                "context-vs-pool-unchecked",
                Severity.INFO,
                s,
                s.role,
                f"could not check context length against the KV pool: {missing} unknown",
                "audit the live server (/server_info has max_total_num_tokens and max_req_input_len; /v1/models has "
                "max_model_len; /metrics has sglang:context_len)",
            )
        ]
    if ctx.value <= pool.value:
        return []
    reaches = rel.stub_reaches_decode(v)
    if reaches:
        sev = Severity.CRITICAL
        what = (
            f"in SGLang {s.version} an over-pool prompt is {rel.stub_fate(v)}: the abort path that leaked KV "
            "across requests"
        )
    elif reaches is None:
        sev = Severity.WARNING
        what = (
            "SGLang version unknown: on 0.5.19 an over-pool prompt is handed to decode as a 1-token stub (the leak "
            "path); 0.5.20 and later refuse it"
        )
    else:
        sev, what = Severity.WARNING, f"SGLang {s.version} refuses such prompts ({rel.stub_fate(v)})"
    return [
        _f(
            "context-exceeds-pool",
            sev,
            s,
            s.role,
            f"context length {ctx.value} ({ctx.source}) is above the KV pool of {pool.value} tokens ({pool.source}); "
            f"one full-length request cannot fit; {what}",
            f"lower --context-length to <= {pool.value}, or give the pool more memory (--mem-fraction-static, "
            "--max-total-tokens) on this side",
            "context_length",
            "max_total_tokens",
            "max_total_num_tokens",
        )
    ]


def _checksum_advice(v: tuple[int, int, int] | None) -> str:
    if v is not None and v < rel.KV_CHECKSUM_FROM:
        return f"SGLang {rel.label(v)} has no KV checksum (added in 0.5.21); upgrade to >= 0.5.22 to get one"
    return "enable --disaggregation-enable-kv-checksum on both sides (SGLang >= 0.5.21)"


def _rule_checksum_single(s: ServerSnapshot) -> list[Finding]:
    kind, _ = pool_kind(s)
    if checksum_enabled(s) and kind == "dsv4":
        return [
            _f(
                "kv-checksum-uncovered-layout",
                Severity.CRITICAL,
                s,
                s.role,
                "--disaggregation-enable-kv-checksum is on for a DeepSeek V4 pool, whose state buffers the "
                "checksum has no indices for (asserts or leaves them unverified)",
                "do not rely on the checksum for this model; keep deferred release on and audit logs for failures",
                "disaggregation_enable_kv_checksum",
            )
        ]
    return []


def _rule_canary(s: ServerSnapshot) -> list[Finding]:
    mode = canary_mode(s)
    kind, evidence = pool_kind(s)
    v = s.version_tuple
    if mode == "none":
        if kind in CANARY_UNSUPPORTED:
            return [
                _f(
                    "kv-canary-off",
                    Severity.INFO,
                    s,
                    s.role,
                    f"--kv-canary is off; it does not support this pool ({POOL_KIND_LABEL[kind]}, {evidence}) anyway",
                    _checksum_advice(v) + "; keep deferred decode release on",
                    "kv_canary",
                )
            ]
        return [
            _f(
                "kv-canary-off",
                Severity.WARNING,
                s,
                s.role,
                "--kv-canary is off: stale or foreign KV in this engine's pool goes undetected (the canary checks one "
                "engine's pool, not the handoff)",
                "start with --kv-canary log (or raise)",
                "kv_canary",
            )
        ]
    if kind in CANARY_UNSUPPORTED:
        return [
            _f(
                "kv-canary-unsupported-pool",
                Severity.CRITICAL,
                s,
                s.role,
                f"--kv-canary {mode} is set but the model uses {POOL_KIND_LABEL[kind]} ({evidence}); the canary "
                "attaches only to MHA, MHA-FP4, SWA and DeepSeek V4 pools and raises NotImplementedError at startup "
                "otherwise (kv_canary/pool_patcher/api.py)",
                "drop --kv-canary for this model (use --kv-canary none); " + _checksum_advice(v),
                "kv_canary",
            )
        ]
    return []


_NO_PREFILL_RELEASE = (
    "prefill has no deferred release of its own source pages in SGLang 0.5.19 .. 0.5.23, so no setting makes "
    "'both sides' hold pages"
)


def _rule_deferred_release(s: ServerSnapshot) -> list[Finding]:
    ev = deferred_release(s)
    v = s.version_tuple
    backend = transfer_backend(s).value
    backends = rel.deferred_release_backends(v)
    if backends is not None and backend not in backends:
        return [
            _f(
                "deferred-decode-release-unsupported",
                Severity.WARNING,
                s,
                s.role,
                f"{ev.source}: {ENV_DEFERRED_RELEASE} has no effect, so decode frees aborted pages at once; "
                + _NO_PREFILL_RELEASE,
                f"use a backend that supports it in this release ({', '.join(sorted(backends))}); no setting enables "
                "it on this one",
                "disaggregation_transfer_backend",
            )
        ]
    if ev.value is True:
        return []
    if ev.value is None:
        return [
            _f(
                "deferred-decode-release-unknown",
                Severity.WARNING,
                s,
                s.role,
                f"cannot tell whether deferred decode KV release is on: {ev.source}",
                f"pass --sglang-version or --decode-env {ENV_DEFERRED_RELEASE}=...; it must be on (decode side only)",
                ENV_DEFERRED_RELEASE,
            )
        ]
    return [
        _f(
            "deferred-decode-release-off",
            Severity.CRITICAL,
            s,
            s.role,
            f"deferred decode KV release is off ({ev.source}): on abort, decode frees pages that a prefill transfer "
            f"may still write into, and the next request can read them; {_NO_PREFILL_RELEASE}",
            f"set {ENV_DEFERRED_RELEASE}=1 on the decode server (on by default from 0.5.21)",
            ENV_DEFERRED_RELEASE,
        )
    ]


def _rule_mooncake(s: ServerSnapshot) -> list[Finding]:
    if transfer_backend(s).value not in ("mooncake", "ascend"):
        return []
    v = s.version_tuple
    ev = mooncake_batch_limit(s)
    if ev.value and ev.value > 0:
        return []
    fix = (
        f"set {ENV_MOONCAKE_BATCH} to a positive bound on prefill and decode (kvfence's suggestion: 1024; "
        "SGLang's default 0 means unbounded)"
    )
    if v is not None and v < rel.MOONCAKE_BATCH_ENV_FROM:
        fix = f"upgrade to SGLang >= 0.5.20, which adds {ENV_MOONCAKE_BATCH}; no setting bounds batches in {s.version}"
    return [
        _f(
            "mooncake-unbounded-batch",
            Severity.WARNING,
            s,
            s.role,
            f"Mooncake sends all layers of a request in one unbounded batch ({ev.source}); very large batches fail "
            "the session and surface as KVTransferError on decode",
            fix,
            ENV_MOONCAKE_BATCH,
        )
    ]


def _rule_metrics(s: ServerSnapshot) -> list[Finding]:
    return metric_findings(s.metrics, s.role) if s.metrics is not None else []


def _pair_mismatch(
    rule: str, what: str, pv: Any, dv: Any, fix: str, p: ServerSnapshot, d: ServerSnapshot, *names: str,
    severity: Severity = Severity.CRITICAL,
) -> list[Finding]:  # fmt: skip
    if pv is None or dv is None or pv == dv:
        return []
    return [_both(rule, severity, p, d, f"{what} differs: prefill {pv}, decode {dv}", fix, *names)]


def _rules_pair(p: ServerSnapshot, d: ServerSnapshot) -> list[Finding]:
    out: list[Finding] = []
    out += _pair_mismatch(
        "pd-version-mismatch", "SGLang version", p.version, d.version, "run the same SGLang release on both sides",
        p, d, "version", severity=Severity.WARNING,
    )  # fmt: skip
    out += _pair_mismatch(
        "pd-context-length-mismatch", "context length", context_length(p).value, context_length(d).value,
        "set the same --context-length on prefill and decode (no SGLang startup check compares them)",
        p, d, "context_length",
    )  # fmt: skip
    out += _pair_mismatch(
        "pd-page-size-mismatch", "page size", page_size(p).value, page_size(d).value,
        "set the same --page-size on both sides", p, d, "page_size",
    )  # fmt: skip
    out += _pair_mismatch(
        "pd-kv-dtype-mismatch", "KV cache dtype", kv_cache_dtype(p), kv_cache_dtype(d),
        "set the same --kv-cache-dtype on both sides", p, d, "kv_cache_dtype",
    )  # fmt: skip
    out += _pair_mismatch(
        "pd-dtype-mismatch", "model dtype", model_dtype(p), model_dtype(d), "set the same --dtype on both sides",
        p, d, "dtype",
    )  # fmt: skip
    pm, dm = model_id(p), model_id(d)
    if pm and dm and pm != dm and Path(pm).name != Path(dm).name:
        out.append(
            _both(
                "pd-model-mismatch", Severity.CRITICAL, p, d, f"model differs: prefill {pm}, decode {dm}",
                "serve the same model (same weights and revision) on prefill and decode", "model_path",
            )
        )  # fmt: skip
    pa, da = architectures(p), architectures(d)
    if pa and da and pa != da:
        out.append(
            _both(
                "pd-model-mismatch", Severity.CRITICAL, p, d, f"architectures differ: prefill {pa}, decode {da}",
                "serve the same model on prefill and decode", "model_path",
            )
        )  # fmt: skip
    out += _pair_mismatch(
        "pd-transfer-backend-mismatch", "transfer backend", transfer_backend(p).value, transfer_backend(d).value,
        "set the same --disaggregation-transfer-backend on both sides", p, d, "disaggregation_transfer_backend",
    )  # fmt: skip
    out += _pair_mismatch(
        "pd-allocation-policy-mismatch", "decode allocation policy", allocation_policy(p), allocation_policy(d),
        "set the same --disaggregation-decode-allocation-policy on both sides (SGLang >= 0.5.22)",
        p, d, "disaggregation_decode_allocation_policy",
    )  # fmt: skip
    pp, dp = pool_tokens(p).value, pool_tokens(d).value
    if pp and dp and pp != dp:
        out.append(
            _both(
                "pd-pool-size-differs", Severity.INFO, p, d,
                f"KV pools differ: prefill {pp} tokens, decode {dp} tokens; each side admits prompts on its own",
                "keep both pools at or above the context length so no prompt fits one side but not the other",
                "max_total_tokens", "max_total_num_tokens",
            )
        )  # fmt: skip
    out += _checksum_pair(p, d)
    out += _truncate_pair(p, d)
    return out


def _checksum_pair(p: ServerSnapshot, d: ServerSnapshot) -> list[Finding]:
    v = p.version_tuple or d.version_tuple
    pc, dc = checksum_enabled(p), checksum_enabled(d)
    if rel.has_kv_checksum(v) is False:
        return [
            _both(
                "kv-checksum-unavailable",
                Severity.WARNING,
                p,
                d,
                f"SGLang {rel.label(v)} has no --disaggregation-enable-kv-checksum (added in 0.5.21): decode admits "
                "transferred KV unverified",
                _checksum_advice(v),
                "version",
            )
        ]
    if pc != dc:
        on = "prefill" if pc else "decode"
        return [
            _both(
                "kv-checksum-one-side",
                Severity.CRITICAL,
                p,
                d,
                f"--disaggregation-enable-kv-checksum is on only on {on}: the digest is 0 or never checked, and every "
                "transfer is admitted unverified, silently",
                "enable --disaggregation-enable-kv-checksum on both prefill and decode",
                "disaggregation_enable_kv_checksum",
            )
        ]
    if not pc:
        unknown = " (version unknown: the flag exists from 0.5.21)" if v is None else ""
        return [
            _both(
                "kv-checksum-off",
                Severity.WARNING,
                p,
                d,
                f"--disaggregation-enable-kv-checksum is off: decode admits transferred KV unverified{unknown}",
                _checksum_advice(v),
                "disaggregation_enable_kv_checksum",
            )
        ]
    diffs = [
        name
        for name, a, b in (
            ("page size", page_size(p).value, page_size(d).value),
            ("KV dtype", kv_cache_dtype(p), kv_cache_dtype(d)),
            ("TP size", p.args.get("tp_size"), d.args.get("tp_size")),
            ("PP size", p.args.get("pp_size"), d.args.get("pp_size")),
        )
        if a is not None and b is not None and a != b
    ]
    if not diffs:
        return []
    if v is not None and v >= rel.POOL_WARNING_FROM:
        what = "decode logs 'KV checksum skipped' once and admits every request from that prefill unverified"
    elif v is not None:
        what = f"SGLang {rel.label(v)} compares digests taken over different layouts, so transfers fail the check"
    else:
        what = "0.5.23 admits every such request unverified; 0.5.21/0.5.22 compare digests of different layouts"
    return [
        _both(
            "kv-checksum-skipped-layout",
            Severity.WARNING,
            p,
            d,
            f"the KV checksum is on but the layouts differ ({', '.join(diffs)}): {what}",
            "make the prefill and decode KV layouts identical (page size, KV dtype, TP and PP size)",
            "page_size",
            "kv_cache_dtype",
            "tp_size",
            "pp_size",
        )
    ]


def _truncate_pair(p: ServerSnapshot, d: ServerSnapshot) -> list[Finding]:
    pt, dt = bool(as_bool(p.args.get("allow_auto_truncate"))), bool(as_bool(d.args.get("allow_auto_truncate")))
    if pt != dt:
        return [
            _both(
                "allow-auto-truncate",
                Severity.CRITICAL,
                p,
                d,
                f"--allow-auto-truncate is on only on {'prefill' if pt else 'decode'}: one side truncates the prompt "
                "and the other allocates for the full length",
                "turn --allow-auto-truncate off on both sides (reject too-long prompts with 400)",
                "allow_auto_truncate",
            )
        ]
    if pt:
        return _rule_truncate_single(p, role="both")
    return []


def _rule_truncate_single(s: ServerSnapshot, role: str | None = None) -> list[Finding]:
    if not as_bool(s.args.get("allow_auto_truncate")):
        return []
    return [
        Finding(
            "allow-auto-truncate",
            Severity.WARNING,
            role or s.role,
            "--allow-auto-truncate is on: too-long prompts are silently cut instead of rejected",
            "turn --allow-auto-truncate off so clients get a 400 and can shorten the prompt",
            s.source,
            s.line_of("allow_auto_truncate"),
        )
    ]


def audit(prefill: ServerSnapshot | None, decode: ServerSnapshot | None) -> list[Finding]:
    """All rules over one or both sides; pair rules run only when both are given."""
    out: list[Finding] = []
    for s in (prefill, decode):
        if s is None:
            continue
        out += _rule_input(s)
        if not s.recognised:
            continue
        out += _rule_version(s)
        out += _rule_role(s)
        out += _rule_context_vs_pool(s)
        out += _rule_canary(s)
        out += _rule_checksum_single(s)
        out += _rule_mooncake(s)
        out += _rule_metrics(s)
    if decode is not None and decode.recognised:
        out += _rule_deferred_release(decode)
    if prefill is not None and decode is not None and prefill.recognised and decode.recognised:
        out += _rules_pair(prefill, decode)
    else:
        for s in (prefill, decode):
            if s is not None and s.recognised:
                out += _rule_truncate_single(s)
    return out
