"""What each SGLang release 0.5.19 .. 0.5.23 does on the paths the audits judge, read from its PyPI wheel.

What it knows (file paths under sglang/srt/; tests/test_audit_sources.py checks each against the wheels):
- A prompt rejected at intake (`Req.set_finish_with_abort`, managers/schedule_batch.py) becomes a 1-token
  stub. 0.5.19 bootstraps it and sends its one page to decode (disaggregation/prefill.py has no abort check
  on the last-chunk path); 0.5.20 forwards it, then `_retire_aborted_prefill_result` aborts the sender before
  any KV is sent; from 0.5.21 `PrefillBootstrapQueue.add` retires it before bootstrap (`is_unadmitted_reject`).
- `--disaggregation-enable-kv-checksum` exists from 0.5.21 (arg_groups/fields/disagg.py); 0.5.23 alone skips
  (and logs) a prefill whose layout signature differs, earlier ones compare digests across layouts.
- `SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE` (environ.py) defaults off in 0.5.19/0.5.20 and on from
  0.5.21; it acts on the decode side only. From 0.5.21 it takes effect only for transfer backends whose
  KV manager sets `supports_deferred_decode_kv_release` (mooncake and its subclass ascend, nixl; mori from
  0.5.22; never fake); before, every CommonKVManager backend (mooncake, ascend, nixl, mori) read it.
  Prefill holds no deferred release of its own source pages in any of these releases.
- `SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES` exists from 0.5.20 (default 0: one unbounded batch).
- The `Request prompt exceeds the KV memory budget` abort exists from 0.5.21; the start-up warning
  `KV pool holds N tokens, fewer than --context-length M` only in 0.5.23; `--disaggregation-decode-allocation-
  policy` from 0.5.22.
What it does not know: releases outside 0.5.19 .. 0.5.23 (the functions say "unknown" by returning None).
"""

from __future__ import annotations

import re

Version = tuple[int, int, int]

FIRST, LAST = (0, 5, 19), (0, 5, 23)
KV_CHECKSUM_FROM = (0, 5, 21)
ALLOCATION_POLICY_FROM = (0, 5, 22)
KV_BUDGET_ABORT_FROM = (0, 5, 21)
POOL_WARNING_FROM = (0, 5, 23)
MOONCAKE_BATCH_ENV_FROM = (0, 5, 20)
DEFERRED_DEFAULT_ON_FROM = (0, 5, 21)
ENV_DEFERRED_RELEASE = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
ENV_MOONCAKE_BATCH = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"
# --disaggregation-transfer-backend values that resolve to another backend (arg_groups/pd_disaggregation_hook.py)
BACKEND_ALIASES = {"mooncake_tcp": "mooncake"}


def parse_version(v: object) -> Version | None:
    """'0.5.21.post1' -> (0, 5, 21); 'v0.5.22rc0' -> (0, 5, 22); None for unparseable."""
    if not v:
        return None
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(v).strip())
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def label(v: Version | None) -> str:
    return ".".join(map(str, v)) if v else "unknown"


def known(v: Version | None) -> bool:
    return v is not None and FIRST <= v <= LAST


def has_kv_checksum(v: Version | None) -> bool | None:
    return None if v is None else v >= KV_CHECKSUM_FROM


def stub_fate(v: Version | None) -> str | None:
    """What happens to a prompt rejected at intake on a prefill server of this release."""
    if v is None:
        return None
    if v < (0, 5, 20):
        return "handed to decode as a 1-token stub (one page sent, reported complete)"
    if v < (0, 5, 21):
        return "forwarded as a 1-token stub, then retired before any KV is sent"
    return "retired before bootstrap; nothing is sent to decode"


def stub_reaches_decode(v: Version | None) -> bool | None:
    return None if v is None else v < (0, 5, 20)


def deferred_release_default(v: Version | None) -> bool | None:
    return None if v is None else v >= DEFERRED_DEFAULT_ON_FROM


def deferred_release_backends(v: Version | None) -> frozenset[str] | None:
    """Transfer backends on whose decode side the deferred-release variable takes effect."""
    if v is None:
        return None
    if v < (0, 5, 21):
        return frozenset({"mooncake", "ascend", "nixl", "mori"})
    if v < (0, 5, 22):
        return frozenset({"mooncake", "ascend", "nixl"})
    return frozenset({"mooncake", "ascend", "nixl", "mori"})


def resolve_backend(name: str) -> str:
    return BACKEND_ALIASES.get(name, name)
