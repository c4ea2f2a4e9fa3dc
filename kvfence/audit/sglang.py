"""Audit an SGLang prefill/decode (PD) deployment for the cross-request KV leak hazards.

What it knows:
- How to read one SGLang server's configuration from three sources: a live URL
  (`GET /server_info`, falling back to the deprecated `/get_server_info`; `/model_info` or
  `/get_model_info`; `/v1/models` for `max_model_len`), a saved JSON file (the flat
  `/server_info` body, or a bundle `{"server_info", "model_info", "v1_models", "env"}`), or a
  launch command line (`KEY=VAL python -m sglang.launch_server --flag value ...`, also inside a
  shell script with `export KEY=VAL` lines and backslash continuations).
- The `/server_info` shape: resolved `ServerArgs` fields flattened at top level, plus the
  scheduler info (`max_total_num_tokens`, `max_req_input_len`), `internal_states` (one dict per
  DP rank, with `memory_usage.token_capacity`) and `version`.
- The rules below, with version-dependent defaults (SGLang 0.5.19 .. 0.5.23).

What it does not know: the process environment of a live server (SGLang does not publish it),
so environment-variable rules use `--env` / env files / the command-line prefix when given and
the version's default otherwise, and say which one they used.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfence.audit.findings import Finding, Severity
from kvfence.errors import KvfenceError

MIN_SAFE_VERSION = (0, 5, 22)
ENV_DEFERRED_RELEASE = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
ENV_MOONCAKE_BATCH = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"

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
    env_known: bool = False  # True when we saw the launch environment (command line or env file)
    from_command_line: bool = False
    version_override: str | None = None
    max_model_len: int | None = None  # from /v1/models

    @property
    def version(self) -> str | None:
        v = self.version_override or self.args.get("version")
        return str(v) if v else None

    @property
    def version_tuple(self) -> tuple[int, int, int] | None:
        return parse_version(self.version)


def parse_version(v: str | None) -> tuple[int, int, int] | None:
    """'0.5.21.post1' -> (0, 5, 21); 'v0.5.22rc0' -> (0, 5, 22); None for unparseable."""
    if not v:
        return None
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(v).strip())
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


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


def context_length(s: ServerSnapshot) -> int | None:
    """The resolved context length: the flag when set, else /v1/models max_model_len."""
    for v in (s.args.get("context_length"), s.max_model_len, s.args.get("context_len")):
        n = _as_int(v)
        if n:
            return n
    return None


def pool_tokens(s: ServerSnapshot) -> tuple[int | None, str]:
    """KV pool size in tokens and where it came from."""
    n = _as_int(s.args.get("max_total_num_tokens"))
    if n:
        return n, "max_total_num_tokens"
    for st in s.args.get("internal_states") or []:
        cap = _as_int(((st or {}).get("memory_usage") or {}).get("token_capacity"))
        if cap:
            return cap, "internal_states[].memory_usage.token_capacity"
    n = _as_int(s.args.get("max_total_tokens"))
    if n:
        return n, "--max-total-tokens (upper bound; the real pool may be smaller)"
    return None, "unknown"


def page_size(s: ServerSnapshot) -> int | None:
    n = _as_int(s.args.get("page_size"))
    if n:
        return n
    return 1 if s.from_command_line else None  # SGLang's default page size is 1


def kv_cache_dtype(s: ServerSnapshot) -> str:
    return str(s.args.get("kv_cache_dtype") or "auto")


def model_dtype(s: ServerSnapshot) -> str:
    return str(s.args.get("dtype") or "auto")


def model_id(s: ServerSnapshot) -> str | None:
    path = s.args.get("model_path") or s.model_info.get("model_path")
    return str(path).rstrip("/") if path else None


def architectures(s: ServerSnapshot) -> list[str]:
    return [str(a) for a in (s.model_info.get("architectures") or [])]


def transfer_backend(s: ServerSnapshot) -> str:
    return str(s.args.get("disaggregation_transfer_backend") or "mooncake")


def allocation_policy(s: ServerSnapshot) -> str:
    return str(s.args.get("disaggregation_decode_allocation_policy") or "early")


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
# Loading: URL, JSON file, launch command line
# ---------------------------------------------------------------------------------------------

# store_true flags of sglang.launch_server that matter here or commonly appear
_BOOL_FLAGS = {
    "allow_auto_truncate",
    "disaggregation_enable_kv_checksum",
    "disaggregation_decode_enable_radix_cache",
    "trust_remote_code",
    "disable_cuda_graph",
    "disable_radix_cache",
    "enable_metrics",
    "enable_dp_attention",
    "skip_server_warmup",
    "log_requests",
    "enable_cache_report",
    "disable_overlap_schedule",
    "enable_mixed_chunk",
    "enable_torch_compile",
    "skip_tokenizer_init",
    "enable_hierarchical_cache",
}
_FLAG_ALIASES = {"model": "model_path", "tp": "tp_size", "dp": "dp_size", "pp": "pp_size", "ep": "ep_size"}
_LAUNCH_MARKERS = ("sglang.launch_server", "sglang serve", "launch_server", "sglang.srt.server")


def _coerce(v: str) -> Any:
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        return v


def parse_env_lines(text: str) -> dict[str, str]:
    """`KEY=VAL` / `export KEY=VAL` lines (comments and blank lines ignored)."""
    env: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].strip()
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for tok in tokens:
            if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tok):
                k, v = tok.split("=", 1)
                env[k] = v
    return env


def parse_launch_command(text: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(server args, environment) from a launch command line or a shell script that runs one."""
    joined = re.sub(r"\\\r?\n", " ", text)
    env: dict[str, str] = {}
    launch_line = None
    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if any(m in line for m in _LAUNCH_MARKERS):
            launch_line = line
            break
        env.update(parse_env_lines(line))
    if launch_line is None:
        raise KvfenceError("no SGLang launch command found (expected 'python -m sglang.launch_server ...')")
    tokens = shlex.split(launch_line, comments=True)
    args: dict[str, Any] = {}
    i = 0
    while i < len(tokens) and not tokens[i].startswith("--"):
        tok = tokens[i]
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tok):
            k, v = tok.split("=", 1)
            env[k] = v
        i += 1
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            i += 1
            continue
        name, eq, inline = tok[2:].partition("=")
        key = _FLAG_ALIASES.get(name.replace("-", "_"), name.replace("-", "_"))
        if eq:
            args[key] = _coerce(inline)
            i += 1
        elif key in _BOOL_FLAGS or i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
            args[key] = True
            i += 1
        else:
            args[key] = _coerce(tokens[i + 1])
            i += 2
    return args, env


def _looks_like_url(src: str) -> bool:
    return src.startswith("http://") or src.startswith("https://")


def fetch_live(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """GET the SGLang info endpoints of one server; returns a bundle dict."""
    import httpx

    base = url.rstrip("/")
    bundle: dict[str, Any] = {}
    with httpx.Client(timeout=timeout) as client:

        def get_first(paths: Sequence[str]) -> dict[str, Any] | None:
            for p in paths:
                try:
                    r = client.get(base + p)
                except httpx.HTTPError as e:
                    raise KvfenceError(f"cannot reach {base}{p}: {e}") from e
                if r.status_code == 200:
                    try:
                        return r.json()
                    except ValueError:
                        return None
            return None

        server_info = get_first(["/server_info", "/get_server_info"])
        if server_info is None:
            raise KvfenceError(f"{base} answered neither /server_info nor /get_server_info with JSON")
        bundle["server_info"] = server_info
        bundle["model_info"] = get_first(["/model_info", "/get_model_info"]) or {}
        bundle["v1_models"] = get_first(["/v1/models"]) or {}
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
    # Some deployments save {"server_args": {...}, ...}; flatten it like SGLang does.
    args = dict(server_info)
    if isinstance(args.get("server_args"), dict):
        nested = args.pop("server_args")
        args = {**nested, **args}
    bundle_env = {str(k): str(v) for k, v in (bundle.get("env") or {}).items()}
    merged_env = {**bundle_env, **(env or {})}
    return ServerSnapshot(
        role=role,
        source=source,
        args=args,
        model_info=dict(bundle.get("model_info") or {}),
        env=merged_env,
        env_known=bool(bundle.get("env")),
        max_model_len=_max_model_len(bundle.get("v1_models") or {}),
    )


def load_snapshot(
    role: str,
    src: str,
    env: dict[str, str] | None = None,
    env_known: bool = False,
    version: str | None = None,
    timeout: float = 10.0,
    fetch: Callable[[str, float], dict[str, Any]] = fetch_live,
) -> tuple[ServerSnapshot, dict[str, Any] | None]:
    """Load one side from a URL, a JSON file, a command-line file, or a literal command line.

    Returns the snapshot and, for live URLs, the raw bundle (so it can be saved and re-audited).
    """
    env = dict(env or {})
    if _looks_like_url(src):
        bundle = fetch(src, timeout)
        snap = snapshot_from_bundle(role, src, bundle, env)
        return _with(snap, env_known=env_known or snap.env_known, version_override=version), bundle
    path = Path(src)
    if path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
        source = str(path)
    elif any(m in src for m in _LAUNCH_MARKERS):
        text, source = src, "command line"
    else:
        raise KvfenceError(f"{role}: {src!r} is neither a URL, a file, nor an SGLang launch command")
    if text.lstrip().startswith("{"):
        try:
            bundle = json.loads(text)
        except json.JSONDecodeError as e:
            raise KvfenceError(f"{source}: invalid JSON: {e}") from e
        snap = snapshot_from_bundle(role, source, bundle, env)
        return _with(snap, env_known=env_known or snap.env_known, version_override=version), None
    args, cmd_env = parse_launch_command(text)
    snap = ServerSnapshot(
        role=role,
        source=source,
        args=args,
        env={**cmd_env, **env},
        env_known=True,
        from_command_line=True,
        version_override=version,
    )
    return snap, None


def _with(s: ServerSnapshot, **changes: Any) -> ServerSnapshot:
    from dataclasses import replace

    return replace(s, **changes)


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvValue:
    value: Any
    source: str  # "env", "default for 0.5.21", "unknown"


def deferred_release(s: ServerSnapshot) -> EnvValue:
    raw = s.env.get(ENV_DEFERRED_RELEASE)
    v = s.version_tuple
    if raw is not None:
        if v is not None and v < (0, 5, 19):
            return EnvValue(False, f"{ENV_DEFERRED_RELEASE} set but SGLang {s.version} has no deferred release")
        return EnvValue(_as_bool(raw), f"{ENV_DEFERRED_RELEASE}={raw}")
    if v is None:
        return EnvValue(None, "unknown (version unknown and no environment given)")
    if v < (0, 5, 19):
        return EnvValue(False, f"SGLang {s.version} has no deferred decode release")
    if v < (0, 5, 21):
        return EnvValue(False, f"default for SGLang {s.version} (off before 0.5.21)")
    return EnvValue(True, f"default for SGLang {s.version} (on from 0.5.21)")


def mooncake_batch_limit(s: ServerSnapshot) -> EnvValue:
    raw = s.env.get(ENV_MOONCAKE_BATCH)
    v = s.version_tuple
    if v is not None and v < (0, 5, 20):
        return EnvValue(0, f"SGLang {s.version} has no {ENV_MOONCAKE_BATCH} (added in 0.5.20)")
    if raw is not None:
        return EnvValue(_as_int(raw) or 0, f"{ENV_MOONCAKE_BATCH}={raw}")
    how = "assumed; environment not given" if not s.env_known else "not set"
    return EnvValue(0, f"default 0 ({how})")


def _rule_version(s: ServerSnapshot) -> list[Finding]:
    v = s.version_tuple
    if v is None:
        return [
            Finding(
                "version-unknown",
                Severity.WARNING,
                s.role,
                f"could not tell the SGLang version from {s.source}; version-dependent defaults are guesses",
                "audit the live /server_info (it reports 'version') or pass --sglang-version",
            )
        ]
    if v >= MIN_SAFE_VERSION:
        return []
    sev = Severity.CRITICAL if v < (0, 5, 21) else Severity.WARNING
    why = (
        "too-long requests aborted on prefill can still be handed to decode as a 1-token stub and decoded over "
        "unwritten pages (#33507, #30233); no KV checksum; deferred decode release off by default"
        if v < (0, 5, 21)
        else "no --disaggregation-decode-allocation-policy consistency (added in 0.5.22)"
    )
    return [
        Finding(
            "version-below-0.5.22",
            sev,
            s.role,
            f"SGLang {s.version} is below 0.5.22: {why}",
            "upgrade prefill and decode to SGLang >= 0.5.22 (0.5.23 also warns when the pool is below the context)",
        )
    ]


def _rule_role(s: ServerSnapshot) -> list[Finding]:
    mode = s.args.get("disaggregation_mode")
    if mode in (None, "") or str(mode) == s.role:
        return []
    return [
        Finding(
            "role-mode-mismatch",
            Severity.CRITICAL,
            s.role,
            f"given as the {s.role} server but it runs with --disaggregation-mode {mode}",
            "check the URLs / files passed to --prefill and --decode; each side must run its own mode",
        )
    ]


def _rule_context_vs_pool(s: ServerSnapshot) -> list[Finding]:
    ctx = context_length(s)
    pool, where = pool_tokens(s)
    if ctx is None or pool is None:
        missing = " and ".join(x for x, v in (("context length", ctx), ("pool size", pool)) if v is None)
        return [
            Finding(
                "context-vs-pool-unchecked",
                Severity.INFO,
                s.role,
                f"could not check context length against the KV pool: {missing} unknown",
                "audit the live server (/server_info has max_total_num_tokens; /v1/models has max_model_len)",
            )
        ]
    if ctx <= pool:
        return []
    return [
        Finding(
            "context-exceeds-pool",
            Severity.CRITICAL,
            s.role,
            f"context length {ctx} is above the KV pool of {pool} tokens ({where}); one full-length request "
            "cannot fit, and over-pool prompts take the abort path that leaked KV across requests",
            f"lower --context-length to <= {pool}, or give the pool more memory (--mem-fraction-static, "
            "--max-total-tokens) on this side",
        )
    ]


def _rule_checksum_single(s: ServerSnapshot) -> list[Finding]:
    kind, _ = pool_kind(s)
    if checksum_enabled(s) and kind == "dsv4":
        return [
            Finding(
                "kv-checksum-uncovered-layout",
                Severity.CRITICAL,
                s.role,
                "--disaggregation-enable-kv-checksum is on for a DeepSeek V4 pool, whose state buffers the "
                "checksum has no indices for (asserts or leaves them unverified)",
                "do not rely on the checksum for this model; keep deferred release on and audit logs for failures",
            )
        ]
    return []


def _rule_canary(s: ServerSnapshot) -> list[Finding]:
    v = s.version_tuple
    if v is not None and v < (0, 5, 19):
        return []  # no --kv-canary before 0.5.19; the version rule already fires
    mode = canary_mode(s)
    kind, evidence = pool_kind(s)
    if mode == "none":
        if kind in CANARY_UNSUPPORTED:
            return [
                Finding(
                    "kv-canary-off",
                    Severity.INFO,
                    s.role,
                    f"--kv-canary is off; it does not support this pool ({POOL_KIND_LABEL[kind]}, {evidence}) anyway",
                    "rely on the KV checksum and deferred release for this model",
                )
            ]
        return [
            Finding(
                "kv-canary-off",
                Severity.WARNING,
                s.role,
                "--kv-canary is off: stale or foreign KV in this engine's pool goes undetected",
                "start with --kv-canary log (or raise)",
            )
        ]
    if kind in CANARY_UNSUPPORTED:
        return [
            Finding(
                "kv-canary-unsupported-pool",
                Severity.CRITICAL,
                s.role,
                f"--kv-canary {mode} is set but the model uses {POOL_KIND_LABEL[kind]} ({evidence}); "
                "the canary raises NotImplementedError at startup for MLA/DSA/hybrid-linear pools",
                "drop --kv-canary for this model (use --kv-canary none) and rely on the KV checksum",
            )
        ]
    return []


def _rule_deferred_release(s: ServerSnapshot) -> list[Finding]:
    ev = deferred_release(s)
    if ev.value is True:
        return []
    if ev.value is None:
        return [
            Finding(
                "deferred-decode-release-unknown",
                Severity.WARNING,
                s.role,
                f"cannot tell whether deferred decode KV release is on: {ev.source}",
                f"pass --sglang-version or --decode-env {ENV_DEFERRED_RELEASE}=...; make sure it is 1 on decode",
            )
        ]
    return [
        Finding(
            "deferred-decode-release-off",
            Severity.CRITICAL,
            s.role,
            f"deferred decode KV release is off ({ev.source}): on abort, decode frees pages that a prefill "
            "transfer may still write into, and the next request can read them",
            f"set {ENV_DEFERRED_RELEASE}=1 on the decode server (SGLang >= 0.5.19; default on from 0.5.21)",
        )
    ]


def _rule_mooncake(s: ServerSnapshot) -> list[Finding]:
    if transfer_backend(s) not in ("mooncake", "mooncake_tcp"):
        return []
    ev = mooncake_batch_limit(s)
    if ev.value and ev.value > 0:
        return []
    return [
        Finding(
            "mooncake-unbounded-batch",
            Severity.WARNING,
            s.role,
            f"Mooncake sends all layers of a request in one unbounded batch ({ev.source}); very large batches "
            "fail the session and surface as KVTransferError on decode",
            f"set {ENV_MOONCAKE_BATCH}=1024 on prefill and decode (SGLang >= 0.5.20)",
        )
    ]


def _pair_mismatch(
    rule: str, what: str, p: Any, d: Any, fix: str, severity: Severity = Severity.CRITICAL
) -> list[Finding]:
    if p is None or d is None or p == d:
        return []
    return [Finding(rule, severity, "both", f"{what} differs: prefill {p}, decode {d}", fix)]


def _rules_pair(p: ServerSnapshot, d: ServerSnapshot) -> list[Finding]:
    out: list[Finding] = []
    out += _pair_mismatch(
        "pd-version-mismatch",
        "SGLang version",
        p.version,
        d.version,
        "run the same SGLang release on both sides",
        Severity.WARNING,
    )
    out += _pair_mismatch(
        "pd-context-length-mismatch",
        "context length",
        context_length(p),
        context_length(d),
        "set the same --context-length on prefill and decode (no SGLang startup check compares them)",
    )
    out += _pair_mismatch(
        "pd-page-size-mismatch", "page size", page_size(p), page_size(d), "set the same --page-size on both sides"
    )
    out += _pair_mismatch(
        "pd-kv-dtype-mismatch",
        "KV cache dtype",
        kv_cache_dtype(p),
        kv_cache_dtype(d),
        "set the same --kv-cache-dtype on both sides",
    )
    out += _pair_mismatch(
        "pd-dtype-mismatch", "model dtype", model_dtype(p), model_dtype(d), "set the same --dtype on both sides"
    )
    pm, dm = model_id(p), model_id(d)
    if pm and dm and pm != dm and Path(pm).name != Path(dm).name:
        out.append(
            Finding(
                "pd-model-mismatch",
                Severity.CRITICAL,
                "both",
                f"model differs: prefill {pm}, decode {dm}",
                "serve the same model (same weights and revision) on prefill and decode",
            )
        )
    pa, da = architectures(p), architectures(d)
    if pa and da and pa != da:
        out.append(
            Finding(
                "pd-model-mismatch",
                Severity.CRITICAL,
                "both",
                f"architectures differ: prefill {pa}, decode {da}",
                "serve the same model on prefill and decode",
            )
        )
    out += _pair_mismatch(
        "pd-transfer-backend-mismatch",
        "transfer backend",
        transfer_backend(p),
        transfer_backend(d),
        "set the same --disaggregation-transfer-backend on both sides",
    )
    out += _pair_mismatch(
        "pd-allocation-policy-mismatch",
        "decode allocation policy",
        allocation_policy(p),
        allocation_policy(d),
        "set the same --disaggregation-decode-allocation-policy on both sides (SGLang >= 0.5.22)",
    )
    pp, _ = pool_tokens(p)
    dp, _ = pool_tokens(d)
    if pp and dp and pp != dp:
        out.append(
            Finding(
                "pd-pool-size-differs",
                Severity.INFO,
                "both",
                f"KV pools differ: prefill {pp} tokens, decode {dp} tokens; each side admits prompts on its own",
                "keep both pools at or above the context length so no prompt fits one side but not the other",
            )
        )
    # Checksum: off, one side, or on where it is skipped.
    v = p.version_tuple or d.version_tuple
    pc, dc = checksum_enabled(p), checksum_enabled(d)
    if v is not None and v < (0, 5, 21) and not (pc or dc):
        out.append(
            Finding(
                "kv-checksum-unavailable",
                Severity.WARNING,
                "both",
                f"SGLang {p.version or d.version} has no --disaggregation-enable-kv-checksum (added in 0.5.21): "
                "decode admits transferred KV unverified",
                "upgrade to >= 0.5.22 and start both sides with --disaggregation-enable-kv-checksum",
            )
        )
    elif pc != dc:
        on = "prefill" if pc else "decode"
        out.append(
            Finding(
                "kv-checksum-one-side",
                Severity.CRITICAL,
                "both",
                f"--disaggregation-enable-kv-checksum is on only on {on}: the digest is 0 and every transfer is "
                "admitted unverified, silently",
                "enable --disaggregation-enable-kv-checksum on both prefill and decode",
            )
        )
    elif not pc:
        out.append(
            Finding(
                "kv-checksum-off",
                Severity.WARNING,
                "both",
                "--disaggregation-enable-kv-checksum is off: decode admits transferred KV unverified",
                "start both sides with --disaggregation-enable-kv-checksum (SGLang >= 0.5.21)",
            )
        )
    else:
        diffs = [
            name
            for name, a, b in (
                ("page size", page_size(p), page_size(d)),
                ("KV dtype", kv_cache_dtype(p), kv_cache_dtype(d)),
                ("TP size", p.args.get("tp_size"), d.args.get("tp_size")),
            )
            if a is not None and b is not None and a != b
        ]
        if diffs:
            out.append(
                Finding(
                    "kv-checksum-skipped-layout",
                    Severity.WARNING,
                    "both",
                    f"the KV checksum is on but the layouts differ ({', '.join(diffs)}): decode logs 'KV checksum "
                    "skipped' once and admits every request unverified",
                    "make the prefill and decode KV layouts identical (page size, KV dtype, TP size)",
                )
            )
    # --allow-auto-truncate
    pt, dt = bool(_as_bool(p.args.get("allow_auto_truncate"))), bool(_as_bool(d.args.get("allow_auto_truncate")))
    if pt != dt:
        out.append(
            Finding(
                "allow-auto-truncate",
                Severity.CRITICAL,
                "both",
                f"--allow-auto-truncate is on only on {'prefill' if pt else 'decode'}: one side truncates the prompt "
                "and the other allocates for the full length",
                "turn --allow-auto-truncate off on both sides (reject too-long prompts with 400)",
            )
        )
    elif pt:
        out.append(
            Finding(
                "allow-auto-truncate",
                Severity.WARNING,
                "both",
                "--allow-auto-truncate is on: too-long prompts are silently cut instead of rejected",
                "turn --allow-auto-truncate off so clients get a 400 and can shorten the prompt",
            )
        )
    return out


def _rule_truncate_single(s: ServerSnapshot) -> list[Finding]:
    if not _as_bool(s.args.get("allow_auto_truncate")):
        return []
    return [
        Finding(
            "allow-auto-truncate",
            Severity.WARNING,
            s.role,
            "--allow-auto-truncate is on: too-long prompts are silently cut instead of rejected",
            "turn --allow-auto-truncate off so clients get a 400 and can shorten the prompt",
        )
    ]


def audit(prefill: ServerSnapshot | None, decode: ServerSnapshot | None) -> list[Finding]:
    """All rules over one or both sides; pair rules run only when both are given."""
    out: list[Finding] = []
    for s in (prefill, decode):
        if s is None:
            continue
        out += _rule_version(s)
        out += _rule_role(s)
        out += _rule_context_vs_pool(s)
        out += _rule_canary(s)
        out += _rule_checksum_single(s)
        out += _rule_mooncake(s)
    if decode is not None:
        out += _rule_deferred_release(decode)
    if prefill is not None and decode is not None:
        out += _rules_pair(prefill, decode)
    else:
        for s in (prefill, decode):
            if s is not None:
                out += _rule_truncate_single(s)
    return out


def facts(s: ServerSnapshot) -> dict[str, Any]:
    """The resolved values each rule looked at, for the JSON report."""
    pool, where = pool_tokens(s)
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
        "context_length": context_length(s),
        "pool_tokens": pool,
        "pool_tokens_source": where,
        "max_req_input_len": s.args.get("max_req_input_len"),
        "page_size": page_size(s),
        "kv_cache_dtype": kv_cache_dtype(s),
        "dtype": model_dtype(s),
        "transfer_backend": transfer_backend(s),
        "decode_allocation_policy": allocation_policy(s),
        "kv_checksum": checksum_enabled(s),
        "kv_canary": canary_mode(s),
        "allow_auto_truncate": bool(_as_bool(s.args.get("allow_auto_truncate"))),
        "deferred_decode_release": {"value": dr.value, "source": dr.source},
        "mooncake_max_transfer_batch_indices": {"value": mb.value, "source": mb.source},
        "env_known": s.env_known,
    }
