"""Audit an SGLang prefill/decode (PD) deployment's configuration for the cross-request KV leak hazards.

What it knows:
- How to read one SGLang server from a live URL (`GET /server_info`, falling back to the deprecated
  `/get_server_info`; `/model_info` or `/get_model_info`; `/v1/models` for `max_model_len`; `/metrics` when
  served), a saved JSON file (the flat `/server_info` body, or a bundle `{"server_info", "model_info",
  "v1_models", "metrics", "env"}`), a saved `/metrics` scrape, or a launch command line (read by
  kvfence.audit.sglang_cli with the option table of the SGLang version).
- The `/server_info` body of 0.5.19 .. 0.5.23 (entrypoints/http_server.py, utils/common.py build_server_info):
  the resolved ServerArgs fields at top level, `launch_command` (0.5.21+), the scheduler's
  `max_total_num_tokens` and `max_req_input_len` (= min(context - 1, pool - 1) - 5, managers/tp_worker.py),
  `internal_states` (one per DP rank: resolved fields, `memory_usage.token_capacity`, `disaggregation_mode`,
  and `env_vars` when the server ran with SGLANG_EXPOSE_OWN_ENV_VARS=1) and `version`.
- Which release does what (kvfence.audit.sglang_releases), so each rule states the version it judged by.
What it does not know: values nothing reported. A page size that neither `/server_info` nor the command line
states is "unknown" (SGLang resolves it per attention backend at start-up), a live server's environment is
unknown unless it exposes it, and no rule turns an unknown into a critical finding.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from kvfence.audit import sglang_releases as rel
from kvfence.audit.findings import Finding, Rule, Severity
from kvfence.audit.metrics import MetricsSnapshot, metric_findings, parse_metrics
from kvfence.audit.sglang_cli import parse_argv, parse_env_lines, parse_launch_command, version_index
from kvfence.errors import KvfenceError

MIN_SAFE_VERSION = (0, 5, 22)
ENV_DEFERRED_RELEASE = rel.ENV_DEFERRED_RELEASE
ENV_MOONCAKE_BATCH = rel.ENV_MOONCAKE_BATCH
__all__ = ["parse_env_lines", "ServerSnapshot", "audit", "facts", "load_snapshot", "RULES"]

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


class Fact(NamedTuple):
    value: Any
    source: str


# ---------------------------------------------------------------------------------------------
# One server's configuration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSnapshot:
    """What we could learn about one SGLang server; `args` uses SGLang's ServerArgs field names."""

    role: str  # "prefill" | "decode"
    source: str  # URL, file path, or "command line"
    args: dict[str, Any]
    model_info: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    env_known: bool = False  # True when we saw the launch environment (command line, env file, env_vars)
    env_source: str = ""
    from_command_line: bool = False
    version_override: str | None = None
    max_model_len: int | None = None  # from /v1/models
    problems: tuple[str, ...] = ()  # what SGLang's parser would refuse in the launch command
    metrics: MetricsSnapshot | None = None
    recognised: bool = True  # False when the JSON had none of the fields /server_info reports

    @property
    def version(self) -> str | None:
        v = self.version_override or self.args.get("version")
        return str(v) if v else None

    @property
    def version_tuple(self) -> tuple[int, int, int] | None:
        return rel.parse_version(self.version)


def parse_version(v: str | None) -> tuple[int, int, int] | None:
    return rel.parse_version(v)


def _as_int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _as_bool(v: Any) -> bool | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "y", "on", "t"):
        return True
    if s in ("0", "false", "no", "n", "off", "f", ""):
        return False
    return None


def _states(s: ServerSnapshot) -> list[dict[str, Any]]:
    return [st for st in (s.args.get("internal_states") or []) if isinstance(st, dict)]


def pool_tokens(s: ServerSnapshot) -> Fact:
    """KV pool size in tokens and where it came from (smallest over DP ranks)."""
    n = _as_int(s.args.get("max_total_num_tokens"))
    if n:
        return Fact(n, "/server_info max_total_num_tokens")
    caps = [_as_int((st.get("memory_usage") or {}).get("token_capacity")) for st in _states(s)]
    caps = [c for c in caps if c]
    if caps:
        return Fact(min(caps), "/server_info internal_states[].memory_usage.token_capacity")
    n = s.metrics.gauge_min("sglang:max_total_num_tokens") if s.metrics is not None else None
    if n:
        return Fact(n, f"sglang:max_total_num_tokens ({s.metrics.source})")
    n = _as_int(s.args.get("max_total_tokens"))
    if n:
        return Fact(n, "--max-total-tokens (an upper bound; the real pool may be smaller)")
    return Fact(None, "unknown")


def context_length(s: ServerSnapshot) -> Fact:
    """The context length the server enforces and where it came from."""
    n = _as_int(s.args.get("context_length"))
    if n:
        return Fact(n, "--context-length" if s.from_command_line else "/server_info context_length")
    for st in _states(s):
        n = _as_int(st.get("context_length"))
        if n:
            return Fact(n, "/server_info internal_states[].context_length")
    launch = s.args.get("launch_command")
    if isinstance(launch, str) and launch:
        try:
            argv = shlex.split(launch)
        except ValueError:
            argv = launch.split()
        n = _as_int(parse_argv(argv, version_index(s.version_tuple))[0].get("context_length"))
        if n:
            return Fact(n, "--context-length in /server_info launch_command")
    n = s.metrics.gauge_min("sglang:context_len") if s.metrics is not None else None
    if n:
        return Fact(n, f"sglang:context_len ({s.metrics.source})")
    if s.max_model_len:
        return Fact(s.max_model_len, "/v1/models max_model_len")
    mril = _as_int(s.args.get("max_req_input_len"))
    pool = pool_tokens(s).value
    if mril and pool and mril + 6 < pool:
        return Fact(mril + 6, "max_req_input_len + 6 (SGLang sets it to min(context - 1, pool - 1) - 5)")
    return Fact(None, "unknown")


def pool_binds_prompts(s: ServerSnapshot) -> bool:
    """max_req_input_len = pool - 6 says the context is at least the pool (the pool limits prompts)."""
    mril = _as_int(s.args.get("max_req_input_len"))
    pool = pool_tokens(s).value
    return bool(mril and pool and mril + 6 == pool)


_PAGE_UNKNOWN = (
    "unknown: not in the input; SGLang resolves it at start-up from the attention backend and model "
    "(e.g. FlashMLA forces 64, FA4 128 for non-MLA models)"
)


def page_size(s: ServerSnapshot) -> Fact:
    n = _as_int(s.args.get("page_size"))
    if n:
        return Fact(n, "--page-size" if s.from_command_line else "/server_info page_size (resolved)")
    return Fact(None, _PAGE_UNKNOWN)


def kv_cache_dtype(s: ServerSnapshot) -> str | None:
    v = s.args.get("kv_cache_dtype")
    return str(v) if v else (None if s.from_command_line else "auto")


def model_dtype(s: ServerSnapshot) -> str | None:
    v = s.args.get("dtype")
    return str(v) if v else (None if s.from_command_line else "auto")


def model_id(s: ServerSnapshot) -> str | None:
    path = s.args.get("model_path") or s.model_info.get("model_path")
    return str(path).rstrip("/") if path else None


def architectures(s: ServerSnapshot) -> list[str]:
    return [str(a) for a in (s.model_info.get("architectures") or [])]


def transfer_backend(s: ServerSnapshot) -> Fact:
    v = s.args.get("disaggregation_transfer_backend")
    if v:
        return Fact(rel.resolve_backend(str(v)), "set")
    return Fact("mooncake", "SGLang's default (arg_groups/fields/disagg.py)")


def allocation_policy(s: ServerSnapshot) -> str | None:
    v = s.args.get("disaggregation_decode_allocation_policy")
    if v:
        return str(v)
    ver = s.version_tuple
    return "early" if ver is not None and ver >= rel.ALLOCATION_POLICY_FROM else None


def checksum_enabled(s: ServerSnapshot) -> bool:
    return bool(_as_bool(s.args.get("disaggregation_enable_kv_checksum")))


def canary_mode(s: ServerSnapshot) -> str:
    v = s.args.get("kv_canary")
    return "none" if v in (None, False, "", "off") else str(v)


# ---------------------------------------------------------------------------------------------
# KV pool kind: which SGLang pool class a model gets (decides canary and checksum coverage)
# ---------------------------------------------------------------------------------------------

_ARCH_KIND = {
    "DeepseekV2ForCausalLM": "mla",
    "DeepseekV3ForCausalLM": "mla",  # DeepSeek V3 / R1, Kimi K2
    "DeepseekV3ForCausalLMNextN": "mla",
    "DeepseekVL2ForCausalLM": "mla",
    "KimiVLForConditionalGeneration": "mla",
    "MiniCPM3ForCausalLM": "mla",
    "DeepseekV32ForCausalLM": "dsa",
    "GlmMoeDsaForCausalLM": "dsa",
    "DeepseekV4ForCausalLM": "dsv4",
    "Qwen3NextForCausalLM": "hybrid_linear",
    "Qwen3_5ForConditionalGeneration": "hybrid_linear",
    "Qwen3_5MoeForConditionalGeneration": "hybrid_linear",
    "KimiLinearForCausalLM": "hybrid_linear",
    "FalconH1ForCausalLM": "hybrid_linear",
    "NemotronHForCausalLM": "hybrid_linear",
    "GraniteMoeHybridForCausalLM": "hybrid_linear",
    "JambaForCausalLM": "hybrid_linear",
    "Lfm2ForCausalLM": "hybrid_linear",
    "GptOssForCausalLM": "swa",
    "Gemma2ForCausalLM": "swa",
    "Gemma3ForCausalLM": "swa",
    "Gemma3ForConditionalGeneration": "swa",
}
_MODEL_TYPE_KIND = {
    "deepseek_v2": "mla",
    "deepseek_v3": "mla",
    "kimi_k2": "mla",
    "deepseek_v32": "dsa",
    "glm_moe_dsa": "dsa",
    "deepseek_v4": "dsv4",
    "qwen3_next": "hybrid_linear",
    "qwen3_5": "hybrid_linear",
    "qwen3_5_moe": "hybrid_linear",
    "kimi_linear": "hybrid_linear",
    "falcon_h1": "hybrid_linear",
    "nemotron_h": "hybrid_linear",
    "gpt_oss": "swa",
}
# Checked in order on the lower-cased model path when nothing better is known.
_NAME_KIND = [
    ("deepseek-v4", "dsv4"),
    ("deepseek-v3.2", "dsa"),
    ("deepseek-v32", "dsa"),
    ("glm-5", "dsa"),
    ("deepseek-v3", "mla"),
    ("deepseek-r1", "mla"),
    ("deepseek-v2", "mla"),
    ("kimi-k2", "mla"),
    ("qwen3-next", "hybrid_linear"),
    ("qwen3.5", "hybrid_linear"),
    ("kimi-linear", "hybrid_linear"),
    ("gpt-oss", "swa"),
]
POOL_KIND_LABEL = {
    "mha": "MHA/GQA (MHATokenToKVPool)",
    "swa": "sliding-window hybrid (SWAKVPool)",
    "mla": "MLA (MLATokenToKVPool)",
    "dsa": "DSA / sparse attention with indexer (DSATokenToKVPool)",
    "dsv4": "DeepSeek V4 compressed pool (DeepSeekV4TokenToKVPool)",
    "hybrid_linear": "hybrid linear attention (HybridLinearKVPool)",
}
CANARY_UNSUPPORTED = ("mla", "dsa", "hybrid_linear")


def pool_kind(s: ServerSnapshot) -> tuple[str | None, str]:
    """(kind, evidence) from architectures, then model_type, then the model path's name."""
    for arch in architectures(s):
        if arch in _ARCH_KIND:
            return _ARCH_KIND[arch], f"architectures={arch}"
    mt = s.model_info.get("model_type")
    if mt in _MODEL_TYPE_KIND:
        return _MODEL_TYPE_KIND[str(mt)], f"model_type={mt}"
    if architectures(s) or mt:
        return "mha", f"architectures={architectures(s)} model_type={mt}"
    name = (model_id(s) or "").lower()
    for needle, kind in _NAME_KIND:
        if needle in name:
            return kind, f"model path contains {needle!r}"
    return None, "unknown (no /model_info and the model name says nothing)"


# ---------------------------------------------------------------------------------------------
# Loading: URL, JSON file, metrics scrape, launch command line
# ---------------------------------------------------------------------------------------------

_SERVER_INFO_KEYS = ("version", "max_total_num_tokens", "max_req_input_len", "internal_states", "model_path")


def _looks_like_url(src: str) -> bool:
    return src.startswith("http://") or src.startswith("https://")


def _looks_like_metrics(text: str) -> bool:
    head = text.lstrip()[:4096]
    return head.startswith("# HELP") or head.startswith("# TYPE") or "\nsglang:" in "\n" + head


def fetch_live(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """GET the SGLang info endpoints (and /metrics when served) of one server; returns a bundle dict."""
    import httpx

    base = url.rstrip("/")
    bundle: dict[str, Any] = {}
    with httpx.Client(timeout=timeout) as client:

        def get(path: str) -> httpx.Response | None:
            try:
                r = client.get(base + path)
            except httpx.HTTPError as e:
                raise KvfenceError(f"cannot reach {base}{path}: {e}") from e
            return r if r.status_code == 200 else None

        def get_json(paths: Sequence[str]) -> dict[str, Any] | None:
            for p in paths:
                r = get(p)
                if r is not None:
                    try:
                        return r.json()
                    except ValueError:
                        return None
            return None

        server_info = get_json(["/server_info", "/get_server_info"])
        if server_info is None:
            raise KvfenceError(f"{base} answered neither /server_info nor /get_server_info with JSON")
        bundle["server_info"] = server_info
        bundle["model_info"] = get_json(["/model_info", "/get_model_info"]) or {}
        bundle["v1_models"] = get_json(["/v1/models"]) or {}
        r = get("/metrics")
        if r is not None and _looks_like_metrics(r.text):
            bundle["metrics"] = r.text
    return bundle


def _max_model_len(v1_models: dict[str, Any]) -> int | None:
    for card in (v1_models or {}).get("data") or []:
        n = _as_int((card or {}).get("max_model_len"))
        if n:
            return n
    return None


def snapshot_from_bundle(
    role: str, source: str, bundle: dict[str, Any], env: dict[str, str] | None = None
) -> ServerSnapshot:
    server_info = bundle.get("server_info", bundle)
    if not isinstance(server_info, dict):
        raise KvfenceError(f"{source}: server_info is not a JSON object")
    args = dict(server_info)
    if isinstance(args.get("server_args"), dict):  # {"server_args": {...}, ...} as some tools save it
        nested = args.pop("server_args")
        args = {**nested, **args}
    env_out: dict[str, str] = {}
    env_source = ""
    exposed = [st.get("env_vars") for st in args.get("internal_states") or [] if isinstance(st, dict)]
    exposed = [e for e in exposed if isinstance(e, dict)]
    if exposed:
        env_out.update({str(k): str(v) for k, v in exposed[0].items()})
        env_source = "/server_info internal_states[].env_vars"
    if bundle.get("env"):
        env_out.update({str(k): str(v) for k, v in bundle["env"].items()})
        env_source = env_source or f"{source} env"
    env_out.update(env or {})
    metrics = None
    if isinstance(bundle.get("metrics"), str):
        metrics = parse_metrics(bundle["metrics"], f"{source} metrics")
    return ServerSnapshot(
        role=role,
        source=source,
        args=args,
        model_info=dict(bundle.get("model_info") or {}),
        env=env_out,
        env_known=bool(exposed or bundle.get("env")),
        env_source=env_source,
        max_model_len=_max_model_len(bundle.get("v1_models") or {}),
        metrics=metrics,
        recognised=any(k in args for k in _SERVER_INFO_KEYS),
    )


def load_snapshot(
    role: str,
    src: str,
    env: dict[str, str] | None = None,
    env_known: bool = False,
    version: str | None = None,
    timeout: float = 10.0,
    fetch: Callable[[str, float], dict[str, Any]] = fetch_live,
    metrics_path: str | None = None,
) -> tuple[ServerSnapshot, dict[str, Any] | None]:
    """Load one side from a URL, a JSON file, a metrics scrape, a command-line file, or a literal command line.

    Returns the snapshot and, for live URLs, the raw bundle (so it can be saved and re-audited).
    """
    env = dict(env or {})
    snap, bundle = _load(role, src, env, version, timeout, fetch)
    if env:
        snap = replace(snap, env={**snap.env, **env}, env_known=True, env_source=snap.env_source or "--env")
    snap = replace(snap, env_known=snap.env_known or env_known, version_override=version)
    if metrics_path:
        try:
            text = Path(metrics_path).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise KvfenceError(f"cannot read {metrics_path}: {e}") from e
        snap = replace(snap, metrics=parse_metrics(text, metrics_path))
    return snap, bundle


def _load(
    role: str, src: str, env: dict[str, str], version: str | None, timeout: float, fetch: Callable
) -> tuple[ServerSnapshot, dict[str, Any] | None]:
    if _looks_like_url(src):
        bundle = fetch(src, timeout)
        return snapshot_from_bundle(role, src, bundle), bundle
    path = Path(src)
    if path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
        source = str(path)
    else:
        text, source = src, "command line"
    if text.lstrip().startswith("{"):
        try:
            bundle = json.loads(text)
        except json.JSONDecodeError as e:
            raise KvfenceError(f"{source}: invalid JSON: {e}") from e
        return snapshot_from_bundle(role, source, bundle), None
    if _looks_like_metrics(text):
        metrics = parse_metrics(text, source)
        return ServerSnapshot(role=role, source=source, args={}, metrics=metrics, recognised=metrics.is_sglang), None
    cmd = parse_launch_command(text, rel.parse_version(version))
    if cmd is None:
        if source == "command line":
            raise KvfenceError(f"{role}: {src!r} is neither a URL, a file, nor an SGLang launch command")
        raise KvfenceError(
            f"{source}: not an SGLang /server_info JSON, /metrics scrape, or launch command "
            "('python -m sglang.launch_server ...' or 'sglang serve ...')"
        )
    snap = ServerSnapshot(
        role=role,
        source=source,
        args=cmd.args,
        env=cmd.env,
        env_known=True,
        env_source=f"{source} (command line)",
        from_command_line=True,
        problems=tuple(cmd.problems),
    )
    return snap, None


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvValue:
    value: Any
    source: str  # "env", "default for 0.5.21", "unknown"


def deferred_release(s: ServerSnapshot) -> EnvValue:
    """Whether the decode side holds aborted pages until prefill's drain ack (or the timeout)."""
    raw = s.env.get(ENV_DEFERRED_RELEASE)
    v = s.version_tuple
    backend = transfer_backend(s).value
    backends = rel.deferred_release_backends(v)
    if backends is not None and backend not in backends:
        return EnvValue(False, f"the {backend} transfer backend has no deferred release in SGLang {s.version}")
    if raw is not None:
        return EnvValue(_as_bool(raw), f"{ENV_DEFERRED_RELEASE}={raw} ({s.env_source or 'environment'})")
    if v is None:
        return EnvValue(None, "unknown (version unknown and the environment not given)")
    default = rel.deferred_release_default(v)
    how = "not set" if s.env_known else "environment not given"
    return EnvValue(default, f"SGLang {s.version} default {'on' if default else 'off'} ({how})")


def mooncake_batch_limit(s: ServerSnapshot) -> EnvValue:
    raw = s.env.get(ENV_MOONCAKE_BATCH)
    v = s.version_tuple
    if v is not None and v < rel.MOONCAKE_BATCH_ENV_FROM:
        return EnvValue(0, f"SGLang {s.version} has no {ENV_MOONCAKE_BATCH} (added in 0.5.20)")
    if raw is not None:
        return EnvValue(_as_int(raw) or 0, f"{ENV_MOONCAKE_BATCH}={raw}")
    how = "not set" if s.env_known else "assumed; environment not given"
    return EnvValue(0, f"SGLang's default 0 ({how})")


def _f(rule: str, sev: Severity, s: ServerSnapshot | None, role: str, message: str, fix: str) -> Finding:
    return Finding(rule, sev, role, message, fix, s.source if s is not None else "")


def _rule_input(s: ServerSnapshot) -> list[Finding]:
    out: list[Finding] = []
    if not s.recognised:
        out.append(
            _f(
                "input-unrecognised",
                Severity.WARNING,
                s,
                s.role,
                f"{s.source} has none of the fields SGLang's /server_info reports ({', '.join(_SERVER_INFO_KEYS)}) "
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
        )
    )
    return out


def _rule_role(s: ServerSnapshot) -> list[Finding]:
    modes = {str(m) for m in [s.args.get("disaggregation_mode")] if m}
    modes |= {str(st["disaggregation_mode"]) for st in _states(s) if st.get("disaggregation_mode")}
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
        sev, what = Severity.CRITICAL, (
            f"in SGLang {s.version} an over-pool prompt is {rel.stub_fate(v)}: the abort path that leaked KV across "
            "requests"
        )
    elif reaches is None:
        sev, what = Severity.WARNING, (
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
        )
    ]


def _rule_metrics(s: ServerSnapshot) -> list[Finding]:
    return metric_findings(s.metrics, s.role) if s.metrics is not None else []


def _pair_mismatch(
    rule: str, what: str, p: Any, d: Any, fix: str, severity: Severity = Severity.CRITICAL
) -> list[Finding]:
    if p is None or d is None or p == d:
        return []
    return [Finding(rule, severity, "both", f"{what} differs: prefill {p}, decode {d}", fix)]


def _rules_pair(p: ServerSnapshot, d: ServerSnapshot) -> list[Finding]:
    out: list[Finding] = []
    out += _pair_mismatch(
        "pd-version-mismatch", "SGLang version", p.version, d.version, "run the same SGLang release on both sides",
        Severity.WARNING,
    )  # fmt: skip
    out += _pair_mismatch(
        "pd-context-length-mismatch",
        "context length",
        context_length(p).value,
        context_length(d).value,
        "set the same --context-length on prefill and decode (no SGLang startup check compares them)",
    )
    out += _pair_mismatch(
        "pd-page-size-mismatch",
        "page size",
        page_size(p).value,
        page_size(d).value,
        "set the same --page-size on both sides",
    )
    out += _pair_mismatch(
        "pd-kv-dtype-mismatch", "KV cache dtype", kv_cache_dtype(p), kv_cache_dtype(d),
        "set the same --kv-cache-dtype on both sides",
    )  # fmt: skip
    out += _pair_mismatch(
        "pd-dtype-mismatch", "model dtype", model_dtype(p), model_dtype(d), "set the same --dtype on both sides"
    )
    pm, dm = model_id(p), model_id(d)
    if pm and dm and pm != dm and Path(pm).name != Path(dm).name:
        out.append(
            Finding(
                "pd-model-mismatch", Severity.CRITICAL, "both", f"model differs: prefill {pm}, decode {dm}",
                "serve the same model (same weights and revision) on prefill and decode",
            )
        )  # fmt: skip
    pa, da = architectures(p), architectures(d)
    if pa and da and pa != da:
        out.append(
            Finding(
                "pd-model-mismatch", Severity.CRITICAL, "both", f"architectures differ: prefill {pa}, decode {da}",
                "serve the same model on prefill and decode",
            )
        )  # fmt: skip
    out += _pair_mismatch(
        "pd-transfer-backend-mismatch", "transfer backend", transfer_backend(p).value, transfer_backend(d).value,
        "set the same --disaggregation-transfer-backend on both sides",
    )  # fmt: skip
    out += _pair_mismatch(
        "pd-allocation-policy-mismatch", "decode allocation policy", allocation_policy(p), allocation_policy(d),
        "set the same --disaggregation-decode-allocation-policy on both sides (SGLang >= 0.5.22)",
    )  # fmt: skip
    pp, dp = pool_tokens(p).value, pool_tokens(d).value
    if pp and dp and pp != dp:
        out.append(
            Finding(
                "pd-pool-size-differs", Severity.INFO, "both",
                f"KV pools differ: prefill {pp} tokens, decode {dp} tokens; each side admits prompts on its own",
                "keep both pools at or above the context length so no prompt fits one side but not the other",
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
            Finding(
                "kv-checksum-unavailable",
                Severity.WARNING,
                "both",
                f"SGLang {rel.label(v)} has no --disaggregation-enable-kv-checksum (added in 0.5.21): decode admits "
                "transferred KV unverified",
                _checksum_advice(v),
            )
        ]
    if pc != dc:
        on = "prefill" if pc else "decode"
        return [
            Finding(
                "kv-checksum-one-side",
                Severity.CRITICAL,
                "both",
                f"--disaggregation-enable-kv-checksum is on only on {on}: the digest is 0 or never checked, and every "
                "transfer is admitted unverified, silently",
                "enable --disaggregation-enable-kv-checksum on both prefill and decode",
            )
        ]
    if not pc:
        unknown = " (version unknown: the flag exists from 0.5.21)" if v is None else ""
        return [
            Finding(
                "kv-checksum-off",
                Severity.WARNING,
                "both",
                f"--disaggregation-enable-kv-checksum is off: decode admits transferred KV unverified{unknown}",
                _checksum_advice(v),
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
        Finding(
            "kv-checksum-skipped-layout",
            Severity.WARNING,
            "both",
            f"the KV checksum is on but the layouts differ ({', '.join(diffs)}): {what}",
            "make the prefill and decode KV layouts identical (page size, KV dtype, TP and PP size)",
        )
    ]


def _truncate_pair(p: ServerSnapshot, d: ServerSnapshot) -> list[Finding]:
    pt, dt = bool(_as_bool(p.args.get("allow_auto_truncate"))), bool(_as_bool(d.args.get("allow_auto_truncate")))
    if pt != dt:
        return [
            Finding(
                "allow-auto-truncate",
                Severity.CRITICAL,
                "both",
                f"--allow-auto-truncate is on only on {'prefill' if pt else 'decode'}: one side truncates the prompt "
                "and the other allocates for the full length",
                "turn --allow-auto-truncate off on both sides (reject too-long prompts with 400)",
            )
        ]
    if pt:
        return _rule_truncate_single(p, role="both")
    return []


def _rule_truncate_single(s: ServerSnapshot, role: str | None = None) -> list[Finding]:
    if not _as_bool(s.args.get("allow_auto_truncate")):
        return []
    return [
        Finding(
            "allow-auto-truncate",
            Severity.WARNING,
            role or s.role,
            "--allow-auto-truncate is on: too-long prompts are silently cut instead of rejected",
            "turn --allow-auto-truncate off so clients get a 400 and can shorten the prompt",
            "" if role else s.source,
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


def facts(s: ServerSnapshot) -> dict[str, Any]:
    """The resolved values each rule looked at, each with where it came from."""
    pool, ctx, page, backend = pool_tokens(s), context_length(s), page_size(s), transfer_backend(s)
    kind, evidence = pool_kind(s)
    dr = deferred_release(s)
    mb = mooncake_batch_limit(s)
    return {
        "role": s.role,
        "source": s.source,
        "version": s.version,
        "disaggregation_mode": s.args.get("disaggregation_mode"),
        "model": model_id(s),
        "architectures": architectures(s),
        "pool_kind": kind,
        "pool_kind_evidence": evidence,
        "context_length": ctx.value,
        "context_length_source": ctx.source,
        "pool_tokens": pool.value,
        "pool_tokens_source": pool.source,
        "max_req_input_len": s.args.get("max_req_input_len"),
        "page_size": page.value,
        "page_size_source": page.source,
        "kv_cache_dtype": kv_cache_dtype(s),
        "dtype": model_dtype(s),
        "transfer_backend": backend.value,
        "transfer_backend_source": backend.source,
        "decode_allocation_policy": allocation_policy(s),
        "kv_checksum": checksum_enabled(s),
        "kv_canary": canary_mode(s),
        "allow_auto_truncate": bool(_as_bool(s.args.get("allow_auto_truncate"))),
        "deferred_decode_release": {"value": dr.value, "source": dr.source},
        "mooncake_max_transfer_batch_indices": {"value": mb.value, "source": mb.source},
        "env_known": s.env_known,
        "env_source": s.env_source,
        "launch_problems": list(s.problems),
        "metrics": s.metrics.facts() if s.metrics is not None else None,
    }
