"""One vLLM instance of a P/D pair as `kvfence audit vllm` reads it: a launch command, a saved file, or a live URL.

What it knows: the shell shapes of a vLLM launch (`vllm serve MODEL ...`, `python -m
vllm.entrypoints.openai.api_server --model MODEL ...`, KEY=VAL prefixes, `export` lines and backslash continuations
in a script), the flags the audit needs (`--kv-transfer-config` as JSON, and vLLM's dotted form
`--kv-transfer-config.key value` / `--kv-transfer-config.key=value`, nested keys and `key+` list items, combined as
vLLM's FlexibleArgumentParser combines them: the dotted keys replace a JSON value whole, which is flagged;
`--max-model-len`, `--block-size`, `--kv-cache-dtype`, `--dtype`, `--enable-prefix-caching` /
`--no-enable-prefix-caching`, `--model`, `--served-model-name`; dashes or underscores),
the script line that set each, and `KVTransferConfig`'s field names in vLLM 0.32 (`KV_TRANSFER_FIELDS`; a test
derives them from the installed wheel). Saved files: the `--kv-transfer-config` JSON alone, a bundle written by
`--save-bundle`, or vLLM's `/server_info?config_format=json` body (served with VLLM_SERVER_DEV_MODE=1). Live: that
endpoint when the instance serves it, else `/version`, `/v1/models` (`max_model_len`) and `/metrics`
(`vllm:cache_config_info`: block size and block count), with the KV transfer config then unknown.
What it does not know: `--config FILE` contents, shell expansions, and any default: a value not given is None,
and the rules (kvfence.audit.vllm) say what vLLM 0.32 does then.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvfence.audit.live_server import LiveServer
from kvfence.audit.sglang_cli import _ENV_RE, _before_shell_stop, _shell_commands, _token_line
from kvfence.errors import KvfenceError

# vLLM 0.32.0 vllm/config/kv_transfer.py, class KVTransferConfig (checked against the wheel by
# tests/test_audit_vllm.py when vLLM is installed)
KV_TRANSFER_FIELDS = (
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_role",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
)
KV_DEFAULTS: dict[str, Any] = {  # what vLLM 0.32 uses for a field not given (engine_id, kv_buffer_device: computed)
    "kv_connector": None,
    "kv_role": None,
    "kv_port": 14579,
    "kv_connector_extra_config": {},
    "kv_connector_module_path": None,
    "enable_permute_local_kv": False,
    "kv_load_failure_policy": "fail",
}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_LOAD_FAILURE_POLICY = KV_DEFAULTS["kv_load_failure_policy"]

# flags read (vLLM's dest names); the value-less ones
_VALUED = ("model", "max_model_len", "block_size", "kv_cache_dtype", "dtype", "served_model_name")
_SWITCHES = {"enable_prefix_caching": True, "no_enable_prefix_caching": False}
_LAUNCH_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")


@dataclass(frozen=True)
class VllmSnapshot:
    """What could be learnt of one instance. `kv_transfer` is None when its KV transfer config is unknown, {} when
    the instance has none."""

    role: str  # "prefill" | "decode"
    source: str  # URL, file path, or "command line"
    kv_transfer: dict[str, Any] | None
    args: dict[str, Any] = field(default_factory=dict)  # model, max_model_len, block_size, ... (given values only)
    env: dict[str, str] = field(default_factory=dict)
    version: str | None = None
    pool_tokens: int | None = None  # blocks x block size, when /metrics or /server_info shows them
    problems: tuple[str, ...] = ()  # what vLLM would refuse in the launch command or config
    recognised: bool = True
    launch_line: int | None = None
    arg_lines: dict[str, int] = field(default_factory=dict)

    def line_of(self, *names: str) -> int | None:
        if self.launch_line is None:
            return None
        for n in names:
            if n in self.arg_lines:
                return self.arg_lines[n]
        return self.launch_line

    @property
    def connector(self) -> str | None:
        return None if self.kv_transfer is None else self.kv_transfer.get("kv_connector")

    def connectors(self) -> list[str]:
        """The connector, or a MultiConnector's children."""
        c = self.connector
        if c != "MultiConnector":
            return [c] if c else []
        extra = (self.kv_transfer or {}).get("kv_connector_extra_config") or {}
        children = extra.get("connectors") if isinstance(extra, dict) else None
        return [str(x.get("kv_connector")) for x in children or [] if isinstance(x, dict)]


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _nested_set(target: dict[str, Any], keys: list[str], value: Any) -> None:
    for k in keys[:-1]:
        nxt = target.get(k)
        if not isinstance(nxt, dict):
            nxt = target[k] = {}
        target = nxt
    target[keys[-1]] = value


def _dotted_value(raw: str, append: bool) -> Any:
    if append:
        return raw.split(",")
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_argv(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any] | None, list[str], dict[str, str]]:
    """(flags read, the KV transfer config or None when not given, problems, dest -> option token as written).

    As vLLM 0.32's FlexibleArgumentParser: the dotted `--kv-transfer-config.key value` options merge into one JSON
    value appended after every other option, so when both forms are given the dotted ones replace the JSON whole."""
    args: dict[str, Any] = {}
    whole: dict[str, Any] | None = None  # the last `--kv-transfer-config JSON`
    dotted: dict[str, Any] | None = None  # every `--kv-transfer-config.key value`, merged
    problems: list[str] = []
    given: dict[str, str] = {}
    i = 0
    if argv and not argv[0].startswith("-"):  # `vllm serve MODEL`
        args["model"], given["model"] = argv[0], "serve"
        i = 1
    while i < len(argv):
        tok = argv[i]
        i += 1
        if not tok.startswith("--"):
            continue
        name, eq, inline = tok.partition("=")
        dest = _dest(name)
        if dest in _SWITCHES:
            args["enable_prefix_caching"], given["enable_prefix_caching"] = _SWITCHES[dest], name
            continue
        if eq:
            value: str | None = inline
        elif i < len(argv) and not argv[i].startswith("--"):
            value, i = argv[i], i + 1
        else:
            value = None
        if dest == "kv_transfer_config" or dest.startswith("kv_transfer_config."):
            given["kv_transfer_config"] = name
            if value is None:
                problems.append(f"{name} needs a value")
                continue
            if dest == "kv_transfer_config":
                try:
                    obj = json.loads(value)
                except json.JSONDecodeError as e:
                    problems.append(f"{name}: not JSON ({e.msg})")
                    continue
                if not isinstance(obj, dict):
                    problems.append(f"{name}: a JSON object is expected")
                    continue
                whole = obj  # argparse: the last one wins
            else:
                dotted = dotted if dotted is not None else {}
                path = dest.split(".")[1:]
                append = path[-1].endswith("+")
                path[-1] = path[-1].rstrip("+")
                _nested_set(dotted, path, _dotted_value(value, append))
            continue
        if dest in _VALUED:
            if value is None:
                problems.append(f"{name} needs a value")
                continue
            args[dest], given[dest] = value, name
    kv = dotted if dotted is not None else whole
    if whole is not None and dotted is not None:
        lost = sorted(set(whole) - set(dotted))
        problems.append(
            "both --kv-transfer-config JSON and --kv-transfer-config.KEY are given: vLLM 0.32 does not merge them, "
            "the dotted keys replace the whole JSON" + (f" (dropping {', '.join(lost)})" if lost else "")
        )
        problems += [f"the JSON value alone: {p}" for p in config_problems(whole)]
    for key in ("max_model_len", "block_size"):
        if key in args:
            try:
                args[key] = int(str(args[key]))
            except ValueError:
                problems.append(f"--{key.replace('_', '-')} {args[key]!r} is not an integer")
                del args[key]
    return args, kv, problems, given


def config_problems(kv: dict[str, Any]) -> list[str]:
    """What vLLM 0.32's KVTransferConfig would refuse in `kv` (unknown fields, roles, policies)."""
    out = [f"{k!r} is not a KVTransferConfig field" for k in kv if k not in KV_TRANSFER_FIELDS]
    role = kv.get("kv_role")
    if role is not None and role not in KV_ROLES:
        out.append(f"kv_role {role!r} is not one of {', '.join(KV_ROLES)}")
    if kv.get("kv_connector") is not None and role is None:
        out.append("kv_connector is set without kv_role (vLLM refuses to start)")
    policy = kv.get("kv_load_failure_policy")
    if policy is not None and policy not in LOAD_FAILURE_POLICIES:
        out.append(f"kv_load_failure_policy {policy!r} is not one of {', '.join(LOAD_FAILURE_POLICIES)}")
    extra = kv.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        out.append("kv_connector_extra_config must be an object")
    return out


def _split_launch(tokens: list[str]) -> tuple[list[str], list[str]] | None:
    for k, tok in enumerate(tokens):
        if tok in _LAUNCH_MODULES:
            return tokens[:k], tokens[k + 1 :]
        if (tok == "vllm" or tok.endswith("/vllm")) and k + 1 < len(tokens) and tokens[k + 1] == "serve":
            return tokens[:k], tokens[k + 2 :]
    return None


def from_launch(role: str, text: str, source: str) -> VllmSnapshot | None:
    """The first vLLM launch in a command line or script; None when there is none."""
    physical = text.splitlines()
    env: dict[str, str] = {}
    for first, tokens in _shell_commands(text):
        split = _split_launch(tokens)
        if split is None:
            for t in tokens[1:] if tokens and tokens[0] == "export" else tokens:
                if _ENV_RE.match(t):
                    name, val = t.split("=", 1)
                    env[name] = val
            continue
        before, argv = split
        env.update(t.split("=", 1) for t in before if _ENV_RE.match(t))  # type: ignore[misc]
        argv = _before_shell_stop(argv)
        args, kv, problems, given = parse_argv(argv)
        problems += config_problems(kv or {})
        if "config" in args:
            problems.append("--config: options in that file are not read here")
        in_file = source != "command line"
        lines = {d: _token_line(physical, first, tok) for d, tok in given.items() if tok != "serve"}
        return VllmSnapshot(
            role, source, kv if kv is not None else {}, args, env, problems=tuple(problems),
            launch_line=first if in_file else None, arg_lines=lines if in_file else {},
        )  # fmt: skip
    return None


_CACHE_INFO_RE = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


def _metrics_pool(text: str) -> tuple[int | None, int | None]:
    """(block size, blocks) from `vllm:cache_config_info`'s labels, when the scrape has them."""
    m = _CACHE_INFO_RE.search(text)
    if not m:
        return None, None
    labels = dict(_LABEL_RE.findall(m.group(1)))

    def num(k: str) -> int | None:
        try:
            return int(float(labels[k]))
        except (KeyError, ValueError):
            return None

    return num("block_size"), num("num_gpu_blocks") or num("num_cpu_blocks")


def from_bundle(role: str, source: str, doc: dict[str, Any]) -> VllmSnapshot:
    """A saved or live document: a bundle ({"server_info", "version", "v1_models", "metrics"}), a
    /server_info?config_format=json body, or the --kv-transfer-config JSON alone."""
    if "server_info" in doc or "v1_models" in doc or "kv_transfer_config" in doc:
        info = doc.get("server_info") or {}
        cfg = info.get("vllm_config") if isinstance(info, dict) else None
        kv = doc.get("kv_transfer_config")
    elif isinstance(doc.get("vllm_config"), dict):
        cfg, kv = doc["vllm_config"], None
    elif set(doc) & set(KV_TRANSFER_FIELDS):
        return VllmSnapshot(role, source, dict(doc), problems=tuple(config_problems(doc)))
    else:
        return VllmSnapshot(role, source, None, recognised=False)
    args: dict[str, Any] = {}
    pool = None
    if isinstance(cfg, dict):
        kv = cfg.get("kv_transfer_config") if kv is None else kv
        kv = {} if kv is None else kv
        mc, cc = cfg.get("model_config") or {}, cfg.get("cache_config") or {}
        for key, val in (("model", mc.get("model")), ("max_model_len", mc.get("max_model_len")),
                         ("dtype", mc.get("dtype")), ("block_size", cc.get("block_size")),
                         ("kv_cache_dtype", cc.get("cache_dtype")),
                         ("enable_prefix_caching", cc.get("enable_prefix_caching"))):  # fmt: skip
            if val is not None:
                args[key] = val
        blocks = cc.get("num_gpu_blocks") or cc.get("num_cpu_blocks")
        if isinstance(blocks, int) and isinstance(args.get("block_size"), int):
            pool = blocks * args["block_size"]
    models = (doc.get("v1_models") or {}).get("data") or []
    if models and isinstance(models[0], dict):
        args.setdefault("model", models[0].get("root") or models[0].get("id"))
        if models[0].get("max_model_len"):
            args.setdefault("max_model_len", models[0]["max_model_len"])
    if isinstance(doc.get("metrics"), str):
        bs, blocks = _metrics_pool(doc["metrics"])
        if bs:
            args.setdefault("block_size", bs)
        if bs and blocks and pool is None:
            pool = bs * blocks
    problems = tuple(config_problems(kv)) if isinstance(kv, dict) else ()
    version = (doc.get("version") or {}).get("version") if isinstance(doc.get("version"), dict) else None
    return VllmSnapshot(role, source, kv if isinstance(kv, dict) else None, args, version=version, pool_tokens=pool,
                        problems=problems)  # fmt: skip


def fetch_live(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """GET what a vLLM instance tells about itself; a bundle for `from_bundle` (and --save-bundle)."""
    bundle: dict[str, Any] = {}
    with LiveServer(url, timeout) as live:
        for key, path in (("version", "/version"), ("v1_models", "/v1/models"),
                          ("server_info", "/server_info?config_format=json")):  # fmt: skip
            value = live.get_json(path)
            if value is not None:
                bundle[key] = value
        r = live.get("/metrics")
        if r is not None:
            bundle["metrics"] = r.text
    if "v1_models" not in bundle:
        raise KvfenceError(f"{live.base} answered no /v1/models: not a vLLM OpenAI server")
    return bundle


def load_snapshot(
    role: str, src: str, timeout: float = 10.0, fetch: Callable[[str, float], dict[str, Any]] = fetch_live
) -> tuple[VllmSnapshot, dict[str, Any] | None]:
    """One side from a URL, a JSON file, a launch script, or a literal command; (snapshot, bundle if live)."""
    if src.startswith(("http://", "https://")):
        bundle = fetch(src, timeout)
        return from_bundle(role, src, bundle), bundle
    path = Path(src)
    if path.is_file():
        try:
            text, source = path.read_text(encoding="utf-8", errors="replace"), str(path)
        except OSError as e:
            raise KvfenceError(f"cannot read {src}: {e.strerror or e}") from e
    elif len(src.split()) == 1 and not src.lstrip().startswith("{"):
        raise KvfenceError(
            f"cannot read the {role} source {src}: {'is a directory' if path.is_dir() else 'no such file'}"
        )
    else:
        text, source = src, "command line"
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise KvfenceError(f"{source}: invalid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise KvfenceError(f"{source}: a JSON object is expected")
        snap = from_bundle(role, source, doc)
        return (replace(snap, launch_line=1) if source != "command line" else snap), None
    launched = from_launch(role, text, source)
    if launched is None:
        raise KvfenceError(
            f"{source}: not a vLLM launch command ('vllm serve MODEL ...' or 'python -m "
            "vllm.entrypoints.openai.api_server ...'), a saved JSON, or a URL"
        )
    return launched, None
