"""`kvfence probe URL --kv-params CONNECTOR`: does a vLLM decode instance fail closed on fabricated
`kv_transfer_params`? The method of vLLM issue #52234, for an instance the operator owns.

What it knows: the decode-side `kv_transfer_params` each connector reads in vLLM 0.32 (NixlConnector:
`do_remote_prefill`, `remote_engine_id`, `remote_request_id`, `remote_block_ids`, `remote_host`, `remote_port`,
`tp_size`; MooncakeConnector: `do_remote_prefill`, `transfer_id`, `remote_engine_id`, `remote_bootstrap_addr`,
`remote_block_ids`; kvfence's KvfenceConnector: the `{"kvfence": {"role": "consume", ...}}` message of
kvfence.integrations.vllm.params, written out here because this layer may not import it), and the cases:
- unknown remote request: a reference to a request no prefill holds;
- out-of-range block ids: block ids far beyond any pool;
- reused reference (only with `prefill_url`): a real reference from the prefill instance, used once with its own
  prompt, then again with another prompt.
Each is a temperature-0 `/v1/completions` with a token-id prompt; the same prompt is first answered without params
(the instance computes it alone: the reference answer). A case that gets an error (any non-200, or a 200 with no
token) failed closed. A 200 with tokens different from the reference answer is critical: the instance served KV it
did not verify. A 200 with the reference tokens is a warning: the instance accepted a reference it cannot have
verified, and either ignored the params (no connector for this shape: check CONNECTOR) or loaded KV that happened
to be right; from outside the two cannot be told apart.
What it does not know: the instance's configuration (`kvfence audit vllm` reads it) or the model's vocabulary
(prompts use token ids 10..99, inside any vocabulary). Loopback only unless `allow_remote`.
"""

from __future__ import annotations

import random
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

from kvfence.audit.findings import Finding, Severity
from kvfence.audit.probe import check_target
from kvfence.errors import KvfenceError
from kvfence.integrity.digest import token_hash
from kvfence.math_utils import cdiv

CONNECTORS = ("nixl", "mooncake", "kvfence")
FAR_BLOCK = 10**7


@dataclass(frozen=True)
class KvParamsProbeConfig:
    url: str
    model: str
    connector: str  # one of CONNECTORS
    prefill_url: str | None = None
    prompt_tokens: int = 96
    max_tokens: int = 8
    request_timeout_s: float = 60.0
    allow_remote: bool = False
    api_key: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.connector in CONNECTORS and self.prompt_tokens > 0 and self.max_tokens > 0


@dataclass
class CaseResult:
    case: str
    status: int  # HTTP status, 0 for a transport error
    tokens: list[int] | None  # the reply's token ids on a 200 with tokens
    reference: list[int]  # the instance's own answer to the same prompt without params
    error: str = ""

    @property
    def verdict(self) -> str:
        if self.status != 200 or not self.tokens:
            return "failed closed"
        return "200, same tokens" if self.tokens == self.reference else "200, DIFFERENT tokens"

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "status": self.status, "verdict": self.verdict, "error": self.error[:300]}


@dataclass
class KvParamsReport:
    url: str
    connector: str
    cases: list[CaseResult]
    findings: list[Finding]
    not_established: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "connector": self.connector,
            "cases": [c.to_dict() for c in self.cases],
            "findings": [f.to_dict() for f in self.findings],
            "not_established": self.not_established,
        }


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 100) for _ in range(n)]


def fabricated(connector: str, ids: list[int], case: str, block_size_guess: int = 16) -> dict[str, Any]:
    """Decode-side params naming a request no prefill holds (`case` "unknown" or "out-of-range" block ids)."""
    nonce = secrets.token_hex(8)
    n_blocks = max(1, cdiv(len(ids), block_size_guess))
    blocks = list(range(n_blocks)) if case == "unknown" else [FAR_BLOCK + i for i in range(n_blocks)]
    port = closed_port()
    if connector == "nixl":
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"kvfence-probe-{nonce}",
                "remote_request_id": f"kvfence-probe-{nonce}", "remote_block_ids": blocks, "remote_host": "127.0.0.1",
                "remote_port": port, "tp_size": 1}  # fmt: skip
    if connector == "mooncake":
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": f"kvfence-probe-{nonce}",
                "remote_engine_id": f"kvfence-probe-{nonce}", "remote_bootstrap_addr": f"127.0.0.1:{port}",
                "remote_block_ids": blocks}  # fmt: skip
    body = {"v": 1, "role": "consume", "request_id": f"kvfence-probe-{nonce}", "transfer_id": secrets.token_hex(16),
            "tokens_expected": len(ids), "token_hash": token_hash(ids), "pull": f"tcp://127.0.0.1:{port}",
            "record_to": f"tcp://127.0.0.1:{port}"}  # fmt: skip
    if case != "unknown":
        body["remote_block_ids"] = blocks
    return {"kvfence": body}


def produce_params(connector: str) -> dict[str, Any]:
    """What the prefill instance is asked for, so that its reply carries a reference decode can load."""
    if connector == "kvfence":
        return {"kvfence": {"v": 1, "role": "produce", "request_id": f"kvfence-probe-{secrets.token_hex(8)}",
                            "transfer_id": secrets.token_hex(16)}}  # fmt: skip
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
            "remote_host": None, "remote_port": None}  # fmt: skip


def consume_params(connector: str, produced: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    """The decode-side params for prompt `ids` from prefill's reply (for kvfence: its produced message)."""
    if connector != "kvfence":
        return dict(produced)
    p = produced.get("kvfence") or {}
    port = closed_port()  # nobody collects the record: the probe judges by the HTTP answer
    return {"kvfence": {"v": 1, "role": "consume", "request_id": p.get("request_id"),
                        "transfer_id": p.get("transfer_id"), "tokens_expected": len(ids), "token_hash": token_hash(ids),
                        "pull": p.get("pull"), "record_to": f"tcp://127.0.0.1:{port}"}}  # fmt: skip


class _Client:
    def __init__(self, cfg: KvParamsProbeConfig) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.Client(headers=headers, timeout=cfg.request_timeout_s)
        self.cfg = cfg

    def complete(
        self, base: str, ids: list[int], params: dict[str, Any] | None, max_tokens: int
    ) -> tuple[int, dict[str, Any], str]:
        import httpx

        body: dict[str, Any] = {"model": self.cfg.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        if params is not None:
            body["kv_transfer_params"] = params
        try:
            r = self.http.post(base.rstrip("/") + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            return 0, {}, f"{type(e).__name__}: {e}"
        try:
            doc = r.json()
        except ValueError:
            doc = {}
        return r.status_code, doc if isinstance(doc, dict) else {}, r.text[:300] if r.status_code != 200 else ""

    def close(self) -> None:
        self.http.close()


def reply_tokens(doc: dict[str, Any]) -> list[int] | None:
    """The reply's token ids (vLLM's `return_token_ids`), else its text's characters as a stand-in; None for none."""
    choices = doc.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    if isinstance(c.get("token_ids"), list) and c["token_ids"]:
        return [int(t) for t in c["token_ids"]]
    text = c.get("text")
    return [ord(ch) for ch in text] if isinstance(text, str) and text else None


def judge(results: list[CaseResult], connector: str) -> list[Finding]:
    """One finding per case that did not fail closed."""
    out: list[Finding] = []
    for r in results:
        if r.verdict == "200, DIFFERENT tokens":
            out.append(Finding(f"kv-params-{r.case}", Severity.CRITICAL, "decode",
                               f"{r.case}: fabricated {connector} kv_transfer_params got HTTP 200 with tokens that "
                               "differ from the instance's own answer to the same prompt: it served KV it did not "
                               "verify", "put kvfence's KvfenceConnector on prefill and decode (docs/vllm.md)"))  # fmt: skip  # noqa: E501
        elif r.verdict == "200, same tokens":
            out.append(Finding(f"kv-params-{r.case}", Severity.WARNING, "decode",
                               f"{r.case}: fabricated {connector} kv_transfer_params got HTTP 200 (tokens equal to its "
                               "own answer): it did not fail closed; either no connector reads this shape (check "
                               "--kv-params) or it loaded a reference it cannot have verified",
                               "use a connector that verifies the KV it loads (KvfenceConnector) and "
                               "kv_load_failure_policy 'fail'"))  # fmt: skip
    return out


def run_kv_params_probe(cfg: KvParamsProbeConfig) -> KvParamsReport:
    check_target(cfg.url, cfg.allow_remote)
    if cfg.prefill_url:
        check_target(cfg.prefill_url, cfg.allow_remote)
    client = _Client(cfg)
    try:
        results: list[CaseResult] = []
        notes: list[str] = []

        def reference(ids: list[int]) -> list[int]:
            status, doc, err = client.complete(cfg.url, ids, None, cfg.max_tokens)
            toks = reply_tokens(doc) if status == 200 else None
            if toks is None:
                raise KvfenceError(f"{cfg.url} did not answer a plain completion (HTTP {status}: {err[:200]})")
            return toks

        for n, case in enumerate(("unknown", "out-of-range")):
            ids = prompt(cfg.seed * 10 + n, cfg.prompt_tokens)
            ref = reference(ids)
            status, doc, err = client.complete(cfg.url, ids, fabricated(cfg.connector, ids, case), cfg.max_tokens)
            name = "unknown-remote-request" if case == "unknown" else "out-of-range-block-ids"
            results.append(CaseResult(name, status, reply_tokens(doc) if status == 200 else None, ref, err))
        if cfg.prefill_url:
            a, b = prompt(cfg.seed * 10 + 7, cfg.prompt_tokens), prompt(cfg.seed * 10 + 8, cfg.prompt_tokens)
            ref_b = reference(b)
            status, doc, err = client.complete(cfg.prefill_url, a, produce_params(cfg.connector), 1)
            produced = doc.get("kv_transfer_params") if status == 200 else None
            if not isinstance(produced, dict):
                notes.append(f"reused reference: the prefill instance gave no kv_transfer_params (HTTP {status}; "
                             f"{err[:120] or 'none in its reply'})")  # fmt: skip
            else:
                first, _, _ = client.complete(cfg.url, a, consume_params(cfg.connector, produced, a), cfg.max_tokens)
                if first != 200:
                    notes.append(f"reused reference: its first, legitimate use already failed (HTTP {first}); the "
                                 "reuse case was not judged")  # fmt: skip
                else:
                    status, doc, err = client.complete(
                        cfg.url, b, consume_params(cfg.connector, produced, b), cfg.max_tokens
                    )
                    results.append(
                        CaseResult("reused-reference", status, reply_tokens(doc) if status == 200 else None, ref_b, err)
                    )
        else:
            notes.append("reused reference: not run (give --prefill URL of the prefill instance)")
        return KvParamsReport(cfg.url, cfg.connector, results, judge(results, cfg.connector), notes)
    finally:
        client.close()
