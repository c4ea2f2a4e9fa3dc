"""The rules of `kvfence audit vllm`: what in one vLLM P/D instance, or in a prefill/decode pair, lets decode serve KV
it did not verify.

What it knows: each rule (`RULES`), judged on `VllmSnapshot`s (kvfence.audit.vllm_server) with vLLM 0.32.0's
behaviour: `KVTransferConfig`'s fields, roles and `kv_load_failure_policy` values ("recompute" | "fail", default
"fail"); that no vLLM connector compares what prefill wrote with what decode reads (the #52234 class, docs/vllm.md's
matrix: NIXL answers HTTP 200 with another prompt's tokens for a reused or stale reference), so only kvfence's
`KvfenceConnector` makes decode verify; that `KvfenceConnector` refuses policy "recompute", needs
`kv_connector_module_path` and prefix caching off on a consumer. No rule turns an unknown value into a critical finding.
What it does not know: how a snapshot was read, and other releases (`version-outside-range` says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfence.audit.findings import Finding, Location, Rule, Severity
from kvfence.audit.vllm_server import DEFAULT_LOAD_FAILURE_POLICY, VllmSnapshot

KNOWN_VERSION = "0.32.0"
KVFENCE = "KvfenceConnector"
KVFENCE_MODULE = "kvfence.integrations.vllm.connector"
EXPECTED_ROLES = {"prefill": ("kv_producer", "kv_both"), "decode": ("kv_consumer", "kv_both")}

RULES = [
    Rule("input-unrecognised", "the input is no vLLM launch command, KV transfer config, /server_info or bundle"),
    Rule("launch-command-invalid", "vLLM would refuse this launch command or KV transfer config"),
    Rule("version-outside-range", "the rules are grounded in vLLM 0.32.0 only"),
    Rule("kv-transfer-config-unknown", "the instance's KV transfer config could not be read"),
    Rule("kv-connector-missing", "the instance has no KV connector: it is no P/D instance"),
    Rule("kv-role-mismatch", "the kv_role does not fit the role the instance was given for"),
    Rule("kv-load-failure-policy-recompute", "kv_load_failure_policy is 'recompute': failed loads are hidden"),
    Rule("kv-load-failure-policy-default", "kv_load_failure_policy is not given; vLLM 0.32's default is 'fail'"),
    Rule("kv-content-unverified", "decode admits transferred KV without verifying it (no kvfence connector)"),
    Rule("kvfence-connector-one-side", "KvfenceConnector is configured on one side only"),
    Rule("kvfence-connector-module-missing", "KvfenceConnector without kv_connector_module_path: vLLM cannot load it"),
    Rule("kvfence-consumer-prefix-caching", "KvfenceConnector as consumer with prefix caching on or not turned off"),
    Rule("context-exceeds-pool", "max_model_len is above the KV pool"),
    Rule("pd-connector-mismatch", "prefill and decode use different connectors"),
    Rule("pd-version-mismatch", "prefill and decode run different vLLM releases"),
    Rule("pd-model-mismatch", "prefill and decode serve different models"),
    Rule("pd-max-model-len-mismatch", "prefill and decode max_model_len differ"),
    Rule("pd-block-size-mismatch", "prefill and decode block sizes differ"),
    Rule("pd-kv-dtype-mismatch", "prefill and decode KV cache dtypes differ"),
]


def _f(rule: str, sev: Severity, s: VllmSnapshot, message: str, fix: str, *names: str) -> Finding:
    return Finding(rule, sev, s.role, message, fix, s.source, s.line_of(*names, "kv_transfer_config"))


def _both(rule: str, sev: Severity, p: VllmSnapshot, d: VllmSnapshot, message: str, fix: str, *names: str) -> Finding:
    return Finding(
        rule, sev, "both", message, fix, p.source, p.line_of(*names), (Location(d.source, d.line_of(*names)),)
    )


def _single(s: VllmSnapshot) -> list[Finding]:
    out: list[Finding] = []
    if s.problems:
        out.append(_f("launch-command-invalid", Severity.WARNING, s,
                      "vLLM 0.32 would not accept this as written: " + "; ".join(s.problems),
                      "fix the flags / KV transfer config (see `vllm serve --help=kv-transfer-config`)"))  # fmt: skip
    if s.version and not s.version.startswith(KNOWN_VERSION):
        out.append(_f("version-outside-range", Severity.INFO, s,
                      f"vLLM {s.version}: these rules were checked against vLLM {KNOWN_VERSION} only",
                      "treat version-dependent findings (the policy's default) as 0.32's behaviour"))  # fmt: skip
    kv = s.kv_transfer
    if kv is None:
        out.append(_f("kv-transfer-config-unknown", Severity.WARNING, s,
                      f"{s.source} does not show the KV transfer config (vLLM serves it only on /server_info with "
                      "VLLM_SERVER_DEV_MODE=1); connector, role and load-failure policy are unchecked",
                      "audit the launch command (or a saved --kv-transfer-config JSON) instead"))  # fmt: skip
        return out
    if not s.connector:
        out.append(_f("kv-connector-missing", Severity.WARNING, s,
                      f"no kv_connector: the {s.role} instance neither sends nor receives KV; it serves every prompt "
                      "alone", "start it with --kv-transfer-config naming a connector and kv_role"))  # fmt: skip
        return out
    role = kv.get("kv_role")
    if role is not None and role not in EXPECTED_ROLES.get(s.role, ()):
        out.append(_f("kv-role-mismatch", Severity.CRITICAL, s,
                      f"kv_role is {role!r} on the instance given as {s.role}",
                      f"use kv_role {EXPECTED_ROLES[s.role][0]!r} (or 'kv_both') on the {s.role} instance", "kv_role"))  # fmt: skip  # noqa: E501
    policy = kv.get("kv_load_failure_policy")
    kvfence = KVFENCE in s.connectors()
    if policy == "recompute":
        sev, why = (
            Severity.WARNING,
            (
                "a failed KV load is recomputed silently: no error reaches the client or the failure counter, so a "
                "broken handoff is invisible"
            ),
        )
        if kvfence:
            sev, why = Severity.CRITICAL, "KvfenceConnector refuses 'recompute' and the instance will not start"
        out.append(_f("kv-load-failure-policy-recompute", sev, s, f"kv_load_failure_policy is 'recompute': {why}",
                      "set \"kv_load_failure_policy\": \"fail\"", "kv_load_failure_policy"))  # fmt: skip
    elif policy is None and s.role == "decode":
        out.append(_f("kv-load-failure-policy-default", Severity.INFO, s,
                      f"kv_load_failure_policy not given: vLLM {KNOWN_VERSION} defaults to "
                      f"'{DEFAULT_LOAD_FAILURE_POLICY}' (other releases may not)",
                      "write \"kv_load_failure_policy\": \"fail\" explicitly"))  # fmt: skip
    if kvfence and not kv.get("kv_connector_module_path") and s.connector == KVFENCE:
        out.append(_f("kvfence-connector-module-missing", Severity.CRITICAL, s,
                      "kv_connector is KvfenceConnector but kv_connector_module_path is not set: vLLM's registry does "
                      "not know it and the instance will not start",
                      f"add \"kv_connector_module_path\": \"{KVFENCE_MODULE}\"", "kv_transfer_config"))  # fmt: skip
    if kvfence and s.role == "decode" and s.args.get("enable_prefix_caching") is not False:
        out.append(_f("kvfence-consumer-prefix-caching", Severity.WARNING, s,
                      "KvfenceConnector as consumer needs prefix caching off (a local prefix hit leaves pages the "
                      "manifest cannot be checked against); it is "
                      + ("on" if s.args.get("enable_prefix_caching") else "not turned off (vLLM's default is on)"),
                      "add --no-enable-prefix-caching on decode", "enable_prefix_caching"))  # fmt: skip
    if s.role == "decode" and not kvfence:
        out.append(_f("kv-content-unverified", Severity.WARNING, s,
                      f"decode loads KV through {', '.join(s.connectors()) or s.connector} and nothing compares it "
                      "with what prefill wrote: a reused or stale reference, reordered or duplicated blocks are served "
                      "as HTTP 200 with another prompt's tokens (vLLM #52234; docs/vllm.md's matrix)",
                      "use kvfence's KvfenceConnector on both sides (docs/vllm.md), or run `kvfence probe --kv-params` "
                      "against this decode instance"))  # fmt: skip
    mml, pool = s.args.get("max_model_len"), s.pool_tokens
    if isinstance(mml, int) and pool and pool < mml:
        out.append(_f("context-exceeds-pool", Severity.WARNING, s,
                      f"max_model_len {mml} is above the KV pool of {pool} tokens: one full-length request cannot fit",
                      "lower --max-model-len or give the KV cache more memory", "max_model_len"))  # fmt: skip
    return out


def _diff(rule: str, what: str, pv: Any, dv: Any, fix: str, p: VllmSnapshot, d: VllmSnapshot, *names: str,
          severity: Severity = Severity.CRITICAL) -> list[Finding]:  # fmt: skip
    if pv is None or dv is None or pv == dv:
        return []
    return [_both(rule, severity, p, d, f"{what} differs: prefill {pv}, decode {dv}", fix, *names)]


def _pair(p: VllmSnapshot, d: VllmSnapshot) -> list[Finding]:
    out: list[Finding] = []
    pc, dc = p.connectors(), d.connectors()
    if pc and dc and (KVFENCE in pc) != (KVFENCE in dc):
        on = "prefill" if KVFENCE in pc else "decode"
        out.append(_both("kvfence-connector-one-side", Severity.CRITICAL, p, d,
                         f"KvfenceConnector is on {on} only: the two sides speak different kv_transfer_params and no "
                         "handoff is verified", "configure KvfenceConnector on both instances", "kv_transfer_config"))  # fmt: skip  # noqa: E501
    elif pc and dc and pc != dc:
        out += _diff("pd-connector-mismatch", "KV connector", "/".join(pc), "/".join(dc),
                     "use the same connector on both sides", p, d, "kv_transfer_config")  # fmt: skip
    out += _diff("pd-version-mismatch", "vLLM version", p.version, d.version, "run the same vLLM release on both",
                 p, d, severity=Severity.WARNING)  # fmt: skip
    pm, dm = p.args.get("model"), d.args.get("model")
    if pm and dm and pm != dm and Path(str(pm)).name != Path(str(dm)).name:
        out.append(_both("pd-model-mismatch", Severity.CRITICAL, p, d, f"model differs: prefill {pm}, decode {dm}",
                         "serve the same model (weights and revision) on both sides", "model"))  # fmt: skip
    out += _diff("pd-max-model-len-mismatch", "max_model_len", p.args.get("max_model_len"),
                 d.args.get("max_model_len"), "set the same --max-model-len on both sides", p, d, "max_model_len")  # fmt: skip  # noqa: E501
    out += _diff("pd-block-size-mismatch", "block size", p.args.get("block_size"), d.args.get("block_size"),
                 "set the same --block-size on both sides (NIXL maps remote blocks by index)", p, d, "block_size",
                 severity=Severity.WARNING)  # fmt: skip
    out += _diff("pd-kv-dtype-mismatch", "KV cache dtype", p.args.get("kv_cache_dtype"), d.args.get("kv_cache_dtype"),
                 "set the same --kv-cache-dtype on both sides", p, d, "kv_cache_dtype")  # fmt: skip
    return out


def audit(prefill: VllmSnapshot | None, decode: VllmSnapshot | None) -> list[Finding]:
    """All rules over one or both sides; pair rules run only when both are given and recognised."""
    out: list[Finding] = []
    for s in (prefill, decode):
        if s is None:
            continue
        if not s.recognised:
            out.append(_f("input-unrecognised", Severity.WARNING, s,
                          f"{s.source} is no vLLM launch command, KV transfer config, /server_info body or bundle; "
                          "nothing below is about this instance", "give the launch command or a saved bundle"))  # fmt: skip  # noqa: E501
            continue
        out += _single(s)
    if prefill is not None and decode is not None and prefill.recognised and decode.recognised:
        out += _pair(prefill, decode)
    return out


def facts(s: VllmSnapshot) -> dict[str, Any]:
    kv = s.kv_transfer
    return {
        "source": s.source,
        "version": s.version,
        "model": s.args.get("model"),
        "connector": None if kv is None else ("/".join(s.connectors()) or "none"),
        "kv_role": None if kv is None else kv.get("kv_role"),
        "kv_load_failure_policy": None if kv is None else kv.get("kv_load_failure_policy"),
        "max_model_len": s.args.get("max_model_len"),
        "block_size": s.args.get("block_size"),
        "pool_tokens": s.pool_tokens,
    }
