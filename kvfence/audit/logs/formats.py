"""The lines SGLang 0.5.19 .. 0.5.23 writes that the log audit reads: their text, who writes them, in which releases.

What it knows: each line kind (`FORMATS`: the message head, the file under sglang/srt/ that writes it, the first and
last release that does, and the source fragments that build it; tests/test_audit_sources.py checks every entry
against the PyPI wheels), the line prefix `[YYYY-MM-DD HH:MM:SS(.mmm)( DPn)( PPn)( TPn)( EPn)...] `
(utils/common.py configure_logger; `--log-requests` lines carry `[YYYY-MM-DD HH:MM:SS] ` only), and the compiled
patterns that pull them out of a window of the file: one `findall` per window returns every line the audit reads,
in file order, as a row (`Row` names its fields); `Prefill batch` / `Decode batch` and `ReqTimeStats(...)` rows
come out already split into fields, every other kind as its head and the rest of its line.
What it does not know: what a line means for a request or a rule (kvfence.audit.logs.handlers and .rules).
"""

from __future__ import annotations

import re
from typing import NamedTuple


class LineFormat(NamedTuple):
    kind: str
    head: bytes  # the message (after the prefix) starts with this
    source: str  # file under sglang/srt/ that writes it
    releases: tuple[str, str] | None  # first and last release that writes it; None: none of 0.5.19 .. 0.5.23
    fragments: tuple[str, ...]  # source text of that file which builds the line


_ALL = ("0.5.19", "0.5.23")
FORMATS: list[LineFormat] = [
    LineFormat("server_args", b"server_args={", "entrypoints/engine.py", _ALL, ('logger.info(f"server_args={',)),
    LineFormat("server_args", b"server_args=ServerArgs(", "entrypoints/engine.py", None, ("server_args=ServerArgs(",)),
    LineFormat("startup", b"max_total_num_tokens=", "managers/scheduler.py", _ALL,
               ('f"max_total_num_tokens={self.max_total_num_tokens}, "',
                'f"context_len={self.model_config.context_len}, "')),
    LineFormat("pool_warning", b"KV pool holds ", "managers/tp_worker.py", ("0.5.23", "0.5.23"),
               ('"KV pool holds %d tokens, fewer than --context-length %d. One "',)),
    LineFormat("too_long", b"Input length (", "managers/utils.py", _ALL,
               ('f"Input length ({len(req.origin_input_ids)} tokens) exceeds "',
                'f"the maximum allowed length ({max_req_input_len} tokens). "')),
    LineFormat("kv_budget", b"Request prompt exceeds the KV memory budget", "managers/scheduler.py",
               ("0.5.21", "0.5.23"), ('f"Request prompt exceeds the KV memory budget: input_len={input_len}."',)),
    LineFormat("abort_rid", b"", "managers/schedule_batch.py", _ALL, ('logger.error(f"{error_msg}, {self.rid=}")',)),
    LineFormat("truncated", b"Request length is longer than the KV cache pool size or ", "managers/utils.py", _ALL,
               ('"Request length is longer than the KV cache pool size or "',
                'f"{len(req.origin_input_ids)=}, {max_req_input_len=}."')),
    LineFormat("context_reject", b"[http_server] Error: The input (", "entrypoints/http_server.py", _ALL,
               ('logger.error(f"[http_server] Error: {e}")',)),
    LineFormat("context_truncated", b"The input (", "managers/tokenizer_manager.py", _ALL,
               ('f"The input ({input_token_num} tokens) is longer than the "', '"Truncating the input."')),
    LineFormat("capacity", b"Request ", "disaggregation/decode.py", _ALL,
               ('f"Request {req.rid} exceeds the maximum number of tokens: {input_len} > {capacity}"',)),
    LineFormat("capacity", b"Request ", "disaggregation/prefill.py", _ALL,
               ('exceeds the maximum number of tokens: {len(req.origin_input_ids)} > ',)),
    LineFormat("receive", b"Receive: obj=", "utils/request_logger.py", _ALL, ('f"Receive: obj={',)),
    LineFormat("finish", b"Finish: obj=", "utils/request_logger.py", _ALL,
               ('self._log(f"Finish: obj={obj_str}{headers_str}{out_str}")',)),
    LineFormat("json_request", b'{"timestamp": ', "utils/request_logger.py", _ALL,
               ('log_json(self.targets, "request.received", log_data)',
                'log_json(self.targets, "request.finished", log_data)')),
    LineFormat("time_stats", b"ReqTimeStats(", "managers/schedule_batch.py", _ALL,
               ('f"ReqTimeStats("', 'f"rid={self.rid}{bootstrap_info}, "', 'f"output_len={len(self.output_ids)}, "',
                'f"type={self.time_stats.disagg_mode_str()})"')),
    LineFormat("transfer_total", b"", "observability/req_time_stats.py", _ALL,
               ('f"transfer_total={self.transfer_total_mb:.2f} MB"',)),
    LineFormat("transfer_failed", b"Prefill transfer failed for request rank=", "disaggregation/prefill.py", _ALL,
               ('f"Prefill transfer failed for request rank=',)),
    LineFormat("transfer_failed", b"Decode transfer failed for request rank=", "disaggregation/decode.py", _ALL,
               ('f"Decode transfer failed for request rank={self.tp_rank} "',)),
    LineFormat("bootstrap_failed", b"Prefill bootstrap failed for request rank=", "disaggregation/prefill.py",
               _ALL, ('f"Prefill bootstrap failed for request rank=',)),
    LineFormat("bootstrap_failed", b"Decode handshake failed for request rank=", "disaggregation/decode.py", _ALL,
               ('f"Decode handshake failed for request rank={self.tp_rank} ',)),
    LineFormat("checksum_mismatch", b"KV checksum mismatch", "disaggregation/decode.py", ("0.5.21", "0.5.23"),
               ('f"KV checksum mismatch req={req.rid} "',)),
    LineFormat("checksum_skipped", b"KV checksum skipped: ", "disaggregation/decode.py", ("0.5.23", "0.5.23"),
               ('"KV checksum skipped: prefill layout signature %#x differs from "',)),
    LineFormat("corruption", b"Context corruption detected: ", "disaggregation/decode.py", _ALL,
               ('f"Context corruption detected: Request {decode_req.req.rid} "',)),
    LineFormat("deferred_timeout", b"Deferred KV release for room ", "disaggregation/decode.py", _ALL,
               ('f"Deferred KV release for room {room} timed out after "',)),
    LineFormat("canary_violation", b"kv_canary violation: ", "kv_canary/runner/violation_reporter.py", _ALL,
               ('f"kv_canary violation: "', 'f"launch_tag={tag_label} "')),
    LineFormat("canary_stats", b"[canary] step=", "kv_canary/runner/stats_logger.py", _ALL,
               ('"[canary] step=%d protected_tokens=%d sweep_passes=%d violations=%d "',)),
    LineFormat("canary_overflow", b"kv-canary: per-forward verify skipped", "kv_canary/runner/enable_warner.py",
               _ALL, ('"kv-canary: per-forward verify skipped this step due to overflow "',)),
    LineFormat("canary_perturb", b"kv_canary perturb", "kv_canary/perturb/utils.py", _ALL,
               ('"kv_canary perturb %s: group=%s source_idx=%d slot=%d row=%d col=%d "',)),
    LineFormat("canary_install", b"install_canary: ", "kv_canary/api.py", _ALL,
               ('"install_canary: disaggregation_mode=%s config=%s perturb_config=%s "',)),
    LineFormat("prefill_batch", b"Prefill batch", "managers/scheduler_components/metrics_reporter.py", _ALL,
               ('f"Prefill batch{iter_msg}, "', 'f"#new-seq: {prefill_stats.num_new_seqs}, "')),
    LineFormat("decode_batch", b"Decode batch", "managers/scheduler_components/metrics_reporter.py", _ALL,
               ('msg = f"Decode batch{iter_msg}, #running-req: {num_running_reqs}, {token_usage_msg}"',)),
]  # fmt: skip


# Fields of a row of FREQUENT_RE[window].findall (the timestamp is split into the window key and the rest).
KEY, REST, NEW_SEQ, NEW_TOKEN, PREFILL_USAGE, DECODE_USAGE, RID, ROOM, INPUT_LEN, OUTPUT_LEN = range(10)
IS_PREFILL, TRANSFER_MB, OTHER_TYPE, RARE_HEAD, RARE_REST = range(10, 15)
Row = tuple[bytes, ...]

WINDOW_LEN = {"minute": 16, "10min": 15, "hour": 13, "day": 10}  # characters of the timestamp that key a window
FREQUENT_KINDS = ("prefill_batch", "decode_batch", "time_stats")
_RARE_HEADS = sorted({f.head for f in FORMATS if f.head and f.kind not in FREQUENT_KINDS}, key=len, reverse=True)
# The head must start the message: `[^\]\n]*\] ` cannot cross a "]".
_FREQUENT_TAIL = (
    rb"[^\]\n]*\] (?:Prefill batch(?: \[\d+\])?, #new-seq: (\d+), #new-token: (\d+), #cached-token: \d+, "
    rb"(?:full )?token usage: ([\d.]+)|Decode batch(?: \[\d+\])?, #running-req: \d+, #[a-z ]*token: \d+, "
    rb"[a-z ]*token usage: ([\d.]+)|ReqTimeStats\(rid=([^,\s]+), (?:bootstrap_room=(\w+), )?input_len=(\d+), "
    rb"cached_input_len=\d+, output_len=(\d+), attempts=\d+, type=(?:(prefill)\):[^\n]* transfer_total=([\d.]+) MB"
    rb"|(\w+)\))|(" + b"|".join(re.escape(h) for h in _RARE_HEADS) + rb")([^\n]*))"
)
FREQUENT_RE = {
    name: re.compile(rb"\[" + ts + _FREQUENT_TAIL)
    for name, ts in (
        ("minute", rb"(\d{4}-\d\d-\d\d \d\d:\d\d)(:\d\d)"),
        ("10min", rb"(\d{4}-\d\d-\d\d \d\d:\d)(\d:\d\d)"),
        ("hour", rb"(\d{4}-\d\d-\d\d \d\d)(:\d\d:\d\d)"),
        ("day", rb"(\d{4}-\d\d-\d\d)( \d\d:\d\d:\d\d)"),
    )
}
KIND_OF = {f.head: f.kind for f in FORMATS if f.head}

# Fields inside the rare lines.
RID_RE = re.compile(r"\brid=['\"]?([^'\",\s)]+)")
ROOM_RE = re.compile(r"bootstrap_room=(\d+)")
TOO_LONG_RE = re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)")
BUDGET_RE = re.compile(r"KV memory budget: input_len=(\d+)")
TRUNC_RE = re.compile(r"len\(req\.origin_input_ids\)=(\d+), max_req_input_len=(\d+)")
CAP_RE = re.compile(r"Request (\S+) exceeds the maximum number of tokens: (\d+) > (\d+)")
CTX_RE = re.compile(r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")
FIN_ID_RE = re.compile(r"'id': '([^']+)'")
FIN_REASON_RE = re.compile(r"'finish_reason': \{'type': '(\w+)'")
FIN_PROMPT_RE = re.compile(r"'prompt_tokens': (\d+)")
FIN_COMPLETION_RE = re.compile(r"'completion_tokens': (\d+)")
STARTUP_RE = re.compile(r"max_total_num_tokens=(\d+).*?context_len=(\d+)")
POOL_WARN_RE = re.compile(r"KV pool holds (\d+) tokens, fewer than --context-length (\d+)")
MISMATCH_REQ_RE = re.compile(r"req=['\"]?([^'\",\s]+)")
CANARY_STATS_RE = re.compile(r"violations=(\d+)")
CANARY_TAG_RE = re.compile(r"launch_tag=(\S+) fail_reason=(\S+)")
DEFERRED_ROOM_RE = re.compile(r"for room (\d+)")


def window_label(key: str, kind: str) -> str:
    """The printed name of a window from its key ("2026-03-02 10" -> "2026-03-02 10:00" for hours)."""
    if kind == "10min":
        return key + "0"
    if kind == "hour":
        return key + ":00"
    return key
