"""One SGLang server as the audit reads it, from wherever the operator has it; every value with its source.

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
- The resolved value of each setting the rules look at (a `Fact`: value and where it came from), and
  `facts()`, all of them for a report.
What it does not know: values nothing reported. A page size that neither `/server_info` nor the command line
states is "unknown" (SGLang resolves it per attention backend at start-up), and a live server's environment is
unknown unless it exposes it. What is safe is kvfence.audit.sglang's business (the rules).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from kvfence.audit import sglang_releases as rel
from kvfence.audit.live_server import LiveServer
from kvfence.audit.metrics import MetricsSnapshot, parse_metrics
from kvfence.audit.sglang_cli import parse_argv, parse_launch_command, version_index
from kvfence.errors import KvfenceError

ENV_DEFERRED_RELEASE = rel.ENV_DEFERRED_RELEASE
ENV_MOONCAKE_BATCH = rel.ENV_MOONCAKE_BATCH


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
    launch_line: int | None = None  # a launch script: the line where the launch command starts
    arg_lines: dict[str, int] = field(default_factory=dict)  # a launch script: field -> line of its option
    env_lines: dict[str, int] = field(default_factory=dict)  # a launch script: variable -> line that set it

    def line_of(self, *names: str) -> int | None:
        """The script line that sets the first of these fields or variables that it sets, else the launch line;
        None when the input is no script."""
        if self.launch_line is None:
            return None
        for n in names:
            line = self.arg_lines.get(n) or self.env_lines.get(n)
            if line:
                return line
        return self.launch_line

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


def as_bool(v: Any) -> bool | None:
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


def rank_states(s: ServerSnapshot) -> list[dict[str, Any]]:
    return [st for st in (s.args.get("internal_states") or []) if isinstance(st, dict)]


def pool_tokens(s: ServerSnapshot) -> Fact:
    """KV pool size in tokens and where it came from (smallest over DP ranks)."""
    n = _as_int(s.args.get("max_total_num_tokens"))
    if n:
        return Fact(n, "/server_info max_total_num_tokens")
    caps = [c for c in (_as_int((st.get("memory_usage") or {}).get("token_capacity")) for st in rank_states(s)) if c]
    if caps:
        return Fact(min(caps), "/server_info internal_states[].memory_usage.token_capacity")
    m = s.metrics
    n = m.gauge_min("sglang:max_total_num_tokens") if m is not None else None
    if n and m is not None:
        return Fact(n, f"sglang:max_total_num_tokens ({m.source})")
    n = _as_int(s.args.get("max_total_tokens"))
    if n:
        return Fact(n, "--max-total-tokens (an upper bound; the real pool may be smaller)")
    return Fact(None, "unknown")


def context_length(s: ServerSnapshot) -> Fact:
    """The context length the server enforces and where it came from."""
    n = _as_int(s.args.get("context_length"))
    if n:
        return Fact(n, "--context-length" if s.from_command_line else "/server_info context_length")
    for st in rank_states(s):
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
    m = s.metrics
    n = m.gauge_min("sglang:context_len") if m is not None else None
    if n and m is not None:
        return Fact(n, f"sglang:context_len ({m.source})")
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
    return bool(as_bool(s.args.get("disaggregation_enable_kv_checksum")))


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

SERVER_INFO_KEYS = ("version", "max_total_num_tokens", "max_req_input_len", "internal_states", "model_path")


def _looks_like_url(src: str) -> bool:
    return src.startswith("http://") or src.startswith("https://")


def _looks_like_metrics(text: str) -> bool:
    head = text.lstrip()[:4096]
    return head.startswith("# HELP") or head.startswith("# TYPE") or "\nsglang:" in "\n" + head


def fetch_live(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """GET the SGLang info endpoints (and /metrics when served) of one server; returns a bundle dict."""
    bundle: dict[str, Any] = {}
    with LiveServer(url, timeout) as live:
        server_info = live.get_json("/server_info", "/get_server_info")
        if server_info is None:
            raise KvfenceError(f"{live.base} answered neither /server_info nor /get_server_info with JSON")
        bundle["server_info"] = server_info
        bundle["model_info"] = live.get_json("/model_info", "/get_model_info") or {}
        bundle["v1_models"] = live.get_json("/v1/models") or {}
        r = live.get("/metrics")
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
    exposed: list[dict[str, Any]] = [
        e
        for e in (st.get("env_vars") for st in args.get("internal_states") or [] if isinstance(st, dict))
        if isinstance(e, dict)
    ]
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
        recognised=any(k in args for k in SERVER_INFO_KEYS),
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
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise KvfenceError(f"cannot read {src}: {e.strerror or e}") from e
        source = str(path)
    elif len(src.split()) == 1 and not src.lstrip().startswith("{"):
        # One word is a path, never a launch command (that has at least `sglang serve` or `-m ...`).
        why = "is a directory" if path.is_dir() else "no such file"
        raise KvfenceError(f"cannot read the {role} source {src}: {why}")
    else:
        text, source = src, "command line"
    if text.lstrip().startswith("{"):
        try:
            bundle = json.loads(text)
        except json.JSONDecodeError as e:
            raise KvfenceError(f"{source}: invalid JSON: {e}") from e
        snap = snapshot_from_bundle(role, source, bundle)
        if source != "command line":
            snap = replace(snap, launch_line=1, arg_lines=_json_key_lines(text))
        return snap, None
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
    in_file = source != "command line"
    snap = ServerSnapshot(
        role=role,
        source=source,
        args=cmd.args,
        env=cmd.env,
        env_known=True,
        env_source=f"{source} (command line)",
        from_command_line=True,
        problems=tuple(cmd.problems),
        launch_line=cmd.line if in_file else None,
        arg_lines=dict(cmd.arg_lines) if in_file else {},
        env_lines=dict(cmd.env_lines) if in_file else {},
    )
    return snap, None


_JSON_KEY_RE = re.compile(r'^\s*"([A-Za-z_][A-Za-z0-9_]*)":', re.MULTILINE)


def _json_key_lines(text: str) -> dict[str, int]:
    """Key -> 1-based line of its first occurrence in a pretty-printed JSON file (the top-level fields come first)."""
    out: dict[str, int] = {}
    for m in _JSON_KEY_RE.finditer(text):
        out.setdefault(m.group(1), text.count("\n", 0, m.start()) + 1)
    return out


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
        return EnvValue(as_bool(raw), f"{ENV_DEFERRED_RELEASE}={raw} ({s.env_source or 'environment'})")
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
        "allow_auto_truncate": bool(as_bool(s.args.get("allow_auto_truncate"))),
        "deferred_decode_release": {"value": dr.value, "source": dr.source},
        "mooncake_max_transfer_batch_indices": {"value": mb.value, "source": mb.source},
        "env_known": s.env_known,
        "env_source": s.env_source,
        "launch_problems": list(s.problems),
        "metrics": s.metrics.facts() if s.metrics is not None else None,
    }
