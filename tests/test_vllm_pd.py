"""kvfence's connector in real vLLM processes: a prefill and a decode instance behind `kvfence proxy`.

One prefill (kv_producer, a 10 s lease, kvfence's sender-side faults aimed at request ids) and one decode
(kv_consumer, the receiver-side fault) are started once for the module. Every test checks that the client never
gets HTTP 200 with tokens that differ from a single vLLM instance's greedy output (the prefill instance serving a
plain request alone), that a failure's record names its reason, and that innocent requests running at the same time
get exactly their solo tokens. The #52234 cases are synthetic `kv_transfer_params` sent straight to the decode
instance, as that issue did; kvfence's faults go through the proxy. At the end no block is left held on either
instance.

Run in a venv with vLLM (`.ci/vllm.sh`): `python -m pytest -q -m vllm tests/test_vllm_pd.py`.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM is not installed here (docs/vllm.md: its own venv, .ci/vllm.sh)")

from kvfence.auth.keys import ENV_KEY, ClusterKey  # noqa: E402
from kvfence.config import resolve_model_dir  # noqa: E402
from kvfence.integrations.vllm import control  # noqa: E402
from kvfence.integrations.vllm.control import ControlServer  # noqa: E402
from kvfence.integrations.vllm.launch import VllmServer, VllmSpec, kvfence_transfer_config, start_all  # noqa: E402
from kvfence.integrations.vllm.params import ConsumeParams, ProduceParams  # noqa: E402
from kvfence.integrations.vllm.proxy import VllmPDClient, build_client  # noqa: E402
from kvfence.integrity.digest import token_hash  # noqa: E402
from kvfence.models.tokenizer import Tokenizer  # noqa: E402
from kvfence.server.api import ApiSettings, build_app  # noqa: E402
from kvfence.server.launch import ServerThread  # noqa: E402

BLOCK = 32
LEASE_S = 10.0
PREFILL_FAULTS = (
    "placeholder_handoff@*fault-placeholder*,short_write@*fault-short*#1,drop_page@*fault-drop*#2,"
    "corrupt_byte@*fault-corrupt*#3,reorder_pages@*fault-reorder*#1,wrong_layout@*fault-layout*"
)
DECODE_FAULTS = "stale_page@*fault-stale*#2"


@dataclass
class Deployment:
    prefill: VllmServer
    decode: VllmServer
    proxy_url: str
    client: VllmPDClient
    model: str
    records: dict[str, dict]  # transfer id -> record, for synthetic requests aimed at decode directly
    record_address: str
    key: ClusterKey


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    model = resolve_model_dir(None)
    logs = tmp_path_factory.mktemp("vllm-logs")
    key = ClusterKey.generate()  # the deployment's key: in the instances' environment, as `kvfence proxy --launch` does
    common = {"block_size": BLOCK, "max_model_len": 1024, "kv_cache_gib": 1, "env": {ENV_KEY: key.to_hex()}}
    specs = [
        VllmSpec(
            "prefill",
            model,
            kvfence_transfer_config("prefill", {"lease_s": LEASE_S, "inject_fault": PREFILL_FAULTS}),
            **common,
        ),  # type: ignore[arg-type]  # noqa: E501
        VllmSpec("decode", model, kvfence_transfer_config("decode", {"inject_fault": DECODE_FAULTS}), **common),  # type: ignore[arg-type]  # noqa: E501
    ]
    prefill, decode = start_all(specs, timeout_s=900, log_dir=logs)
    records: dict[str, dict] = {}

    def on_record(header: dict, peer: str) -> dict:
        records[str(header.get("xid"))] = dict(header.get("record") or {})
        return {"t": "ok"}

    listener = ControlServer(on_record, control.control_key(key))
    client = build_client(prefill.url, decode.url, key, record_timeout_s=30.0)
    tok = Tokenizer.from_dir(model)
    app = build_app(client, tok, ApiSettings(served_model_name="tiny", vocab_size=tok.vocab_size))
    try:
        with ServerThread(app) as srv:
            d = Deployment(prefill, decode, srv.url, client, model, records, listener.address, key)
            for s in (prefill, decode):  # warm both up: the first request of an instance pays for lazy set-up
                _plain(s, [7, 8, 9], 2)
            yield d
    finally:
        client.close()
        listener.close()
        prefill.stop()
        decode.stop()


def _plain_choice(server: VllmServer, ids: list[int], max_tokens: int, logprobs: int | None = None) -> dict:
    """A single vLLM instance's greedy completion choice for `ids` (no handoff: the instance computes the prompt
    itself), with the top `logprobs` of every output token if asked (legacy completions shape)."""
    body = {"model": server.spec.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    if logprobs is not None:
        body["logprobs"] = logprobs
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = dict(r.json()["choices"][0])
    assert len(choice["token_ids"]) == max_tokens
    return choice


def _plain(server: VllmServer, ids: list[int], max_tokens: int) -> str:
    """_plain_choice's text: what vLLM's detokenizer makes of its tokens (what the proxy relays from decode)."""
    return str(_plain_choice(server, ids, max_tokens)["text"])


# How close two candidates' logprobs may be for greedy to pick either under another batch: vLLM's CPU kernels are not
# batch-invariant, so a request decoded beside others can move its logits by ~1e-5 and take the other side of a near
# tie (seen on an Ice Lake box: the default model's random weights give many). A request that read another request's
# KV moves them by far more, and from its first decode step.
NEAR_TIE = 0.01


def _assert_greedy_equal(got: dict, solo: dict) -> None:
    """`got` (a completion choice with logprobs) is `solo`'s greedy output, or follows it exactly up to a token where
    solo's own top two were a near tie and `got` took the other one (after which the two may differ)."""
    mine, theirs = got["logprobs"]["tokens"], solo["logprobs"]["tokens"]
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a == b:
            continue
        top = solo["logprobs"]["top_logprobs"][i]
        assert i > 0 and a in top and top[b] - top[a] < NEAR_TIE, (
            f"differs from the single instance at token {i} of {len(theirs)}: {a!r} against {b!r}; the single "
            f"instance's top logprobs there: {top}; got {got['text']!r}, single {solo['text']!r}"
        )
        return


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 2000 + 40 for i in range(n)]


def _proxy(
    d: Deployment, ids: list[int], max_tokens: int, rid: str, stream: bool = False, logprobs: int | None = None
) -> tuple[int, dict]:
    """(status, body) of a completion through the proxy; streamed bodies are folded into one."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}  # fmt: skip
    if logprobs is not None:
        body["logprobs"] = logprobs
    headers = {"X-Request-Id": rid}
    if not stream:
        r = httpx.post(f"{d.proxy_url}/v1/completions", json=body, headers=headers, timeout=180)
        return r.status_code, r.json()
    with httpx.stream("POST", f"{d.proxy_url}/v1/completions", json=body, headers=headers, timeout=180) as r:
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        status = r.status_code
    parsed = [json.loads(e) for e in events if e != "[DONE]"]
    errors = [e for e in parsed if "error" in e]
    if errors:
        return 500, errors[-1]
    text = "".join(e["choices"][0]["text"] for e in parsed)
    integrity = next(e["choices"][0]["kvfence"]["integrity"] for e in parsed if e["choices"][0].get("kvfence"))
    return status, {"choices": [{"text": text, "kvfence": {"integrity": integrity}}]}


def _record(body: dict) -> dict:
    if "choices" in body:
        return body["choices"][0]["kvfence"]["integrity"]
    return body["kvfence"]["integrity"][0]


def _kv_usage(server: VllmServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    assert m is not None, "vLLM exports vllm:kv_cache_usage_perc"
    return float(m.group(1))


def _drained(d: Deployment, timeout_s: float = LEASE_S + 20) -> None:
    """Both instances hold no block any more (held transfers released, failed loads handed back)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        usage = (_kv_usage(d.prefill), _kv_usage(d.decode))
        if usage == (0.0, 0.0):
            return
        time.sleep(0.5)
    raise AssertionError(f"blocks still in use after {timeout_s} s: prefill, decode usage = {usage}")


# -- the handoff works and equals a single instance ----------------------------------------------------------------


@pytest.mark.parametrize("n,stream", [(5, False), (33, True), (200, False), (200, True)])
def test_verified_handoff_equals_single_instance(dep: Deployment, n: int, stream: bool) -> None:
    ids = _prompt(n, n)
    solo = _plain(dep.prefill, ids, 12)
    status, body = _proxy(dep, ids, 12, f"ok-{n}-{stream}", stream)
    assert status == 200, body
    rec = _record(body)
    assert rec["status"] == "verified" and rec["tokens_expected"] == n and rec["pages"] == math.ceil(n / BLOCK)
    assert body["choices"][0]["text"] == solo


# -- kvfence's faults through the proxy, each next to innocent requests --------------------------------------------

FAULTS = [
    ("placeholder", "token_count_mismatch"),
    ("short", "coverage_gap"),
    ("drop", "coverage_gap"),
    ("corrupt", "digest_mismatch"),
    ("reorder", "digest_mismatch"),
    ("stale", "digest_mismatch"),
    ("layout", "layout_mismatch"),
]


@pytest.mark.parametrize("fault,reason", FAULTS)
def test_fault_fails_closed_and_innocents_are_exact(dep: Deployment, fault: str, reason: str) -> None:
    # a prompt of its own per fault: decode's blocks can still hold an earlier request's KV of the same prompt, and a
    # stale page that happens to be the right page verifies (correctly), which would hide the stale_page fault
    bad_ids = _prompt(200 + [f for f, _ in FAULTS].index(fault), 150)
    innocent = [_prompt(2, 150), _prompt(3, 97)]
    solos = [_plain_choice(dep.prefill, ids, 10, logprobs=2) for ids in innocent]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        bad = pool.submit(_proxy, dep, bad_ids, 10, f"fault-{fault}-{secrets.token_hex(3)}")
        good = [
            pool.submit(_proxy, dep, ids, 10, f"innocent-{fault}-{k}", logprobs=2) for k, ids in enumerate(innocent)
        ]
        status, body = bad.result()
        results = [g.result() for g in good]
    assert status == 500, f"{fault}: the client got {status} {body}"
    rec = _record(body)
    assert rec["status"] in ("rejected", "failed") and rec["reason"] == reason, rec
    for (s, b), solo in zip(results, solos, strict=True):
        assert s == 200 and _record(b)["status"] == "verified", b
        _assert_greedy_equal(b["choices"][0], solo)


# -- vLLM #52234: synthetic kv_transfer_params straight to decode ------------------------------------------------


def _decode_direct(d: Deployment, ids: list[int], params: dict) -> httpx.Response:
    body = {"model": d.decode.spec.model, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": params}  # fmt: skip
    return httpx.post(f"{d.decode.url}/v1/completions", json=body, timeout=120)


def _pull_address(d: Deployment) -> str:
    """Prefill's pull address, as its response to a produce request names it."""
    ids, xid = _prompt(99, 40), secrets.token_hex(16)
    body = {"model": d.prefill.spec.model, "prompt": ids, "max_tokens": 1,
            "kv_transfer_params": ProduceParams("probe-pull", xid).to_params()}  # fmt: skip
    r = httpx.post(f"{d.prefill.url}/v1/completions", json=body, timeout=60)
    return str(r.json()["kv_transfer_params"]["kvfence"]["pull"])


def _wait_record(d: Deployment, xid: str, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while xid not in d.records and time.monotonic() < deadline:
        time.sleep(0.05)
    return d.records[xid]


def _consume(d: Deployment, ids: list[int], xid: str, pull: str, rid: str = "synthetic") -> dict:
    return ConsumeParams(rid, xid, len(ids), token_hash(ids), pull, d.record_address).to_params()


def test_52234_unknown_remote_request(dep: Deployment) -> None:
    ids, xid = _prompt(11, 120), secrets.token_hex(16)
    r = _decode_direct(dep, ids, _consume(dep, ids, xid, _pull_address(dep)))
    assert r.status_code != 200, r.text
    rec = _wait_record(dep, xid)
    assert rec["reason"] == "transfer_error" and "unknown transfer id" in rec["detail"], rec


def test_streamed_failure_carries_no_token(dep: Deployment) -> None:
    """Streamed straight from decode, a failed load is an error event and nothing else: vLLM's stream has sent its
    200 headers before the failure, but no token (the load fails before the first decode step)."""
    ids, xid = _prompt(21, 120), secrets.token_hex(16)
    body = {"model": dep.decode.spec.model, "prompt": ids, "max_tokens": 8, "temperature": 0, "stream": True,
            "kv_transfer_params": _consume(dep, ids, xid, _pull_address(dep))}  # fmt: skip
    with httpx.stream("POST", f"{dep.decode.url}/v1/completions", json=body, timeout=120) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert events and "error" in events[-1], events
    assert not any(e.get("choices") and e["choices"][0].get("text") for e in events), events
    assert "unknown transfer id" in _wait_record(dep, xid)["detail"]


def test_52234_out_of_range_block_ids(dep: Deployment) -> None:
    """NIXL-shaped params naming blocks far outside any pool: not a kvfence message, refused before any read."""
    ids = _prompt(12, 120)
    nixl_like = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [10**7, 10**7 + 1],
                 "remote_engine_id": "x", "remote_host": "127.0.0.1", "remote_port": 1}  # fmt: skip
    r = _decode_direct(dep, ids, nixl_like)
    assert r.status_code != 200, r.text
    # kvfence's own message has no block ids at all; extra fields change nothing: the transfer id decides
    xid = secrets.token_hex(16)
    params = _consume(dep, ids, xid, _pull_address(dep))
    params["kvfence"]["remote_block_ids"] = [10**7]
    r = _decode_direct(dep, ids, params)
    assert r.status_code != 200, r.text
    assert _wait_record(dep, xid)["reason"] == "transfer_error"


def _handoff(d: Deployment, ids: list[int], rid: str) -> tuple[str, str]:
    """One whole handoff driven by the test as the router would (the client of the proxy never learns a transfer
    id): (transfer id, prefill's pull address), after decode answered 200 with the single instance's tokens."""
    xid = secrets.token_hex(16)
    body = {"model": d.prefill.spec.model, "prompt": ids, "max_tokens": 1,
            "kv_transfer_params": ProduceParams(rid, xid).to_params()}  # fmt: skip
    pull = httpx.post(f"{d.prefill.url}/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]["kvfence"]
    r = _decode_direct(d, ids, _consume(d, ids, xid, pull["pull"], rid))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _plain(d.prefill, ids, 8), r.text
    assert _wait_record(d, xid)["status"] == "verified"
    d.records.pop(xid)
    return xid, str(pull["pull"])


def test_52234_consumed_reference_reused(dep: Deployment) -> None:
    ids, new = _prompt(13, 150), _prompt(23, 150)
    xid, pull = _handoff(dep, ids, "consumed-a")
    r = _decode_direct(dep, new, _consume(dep, new, xid, pull, "consumed-a"))  # the reference again, a new prompt
    assert r.status_code != 200, r.text
    rec = _wait_record(dep, xid)
    assert rec["reason"] == "transfer_error" and "consumed" in rec["detail"], rec


def test_52234_stale_reference_after_blocks_reused(dep: Deployment) -> None:
    a, b = _prompt(14, 150), _prompt(15, 150)
    xid, pull = _handoff(dep, a, "stale-a")
    status, _ = _proxy(dep, b, 8, "stale-b")  # prefill reuses A's freed blocks for B
    assert status == 200
    # the new prompt with the old reference: decode's own prompt is not the one the reference was issued for
    old = ConsumeParams("stale-a", xid, len(a), token_hash(a), pull, dep.record_address)
    r = _decode_direct(dep, b, old.to_params())
    assert r.status_code != 200, r.text
    assert _wait_record(dep, xid)["reason"] == "token_hash_mismatch"
    dep.records.pop(xid)
    # the old prompt with the old reference: prefill no longer holds it
    r = _decode_direct(dep, a, _consume(dep, a, xid, pull, "stale-a"))
    assert r.status_code != 200, r.text
    assert "consumed" in _wait_record(dep, xid)["detail"]


def test_52234_lease_expiry(dep: Deployment) -> None:
    ids, xid = _prompt(16, 150), secrets.token_hex(16)
    body = {"model": dep.prefill.spec.model, "prompt": ids, "max_tokens": 1,
            "kv_transfer_params": ProduceParams("lease", xid).to_params()}  # fmt: skip
    r = httpx.post(f"{dep.prefill.url}/v1/completions", json=body, timeout=60)
    pull = r.json()["kv_transfer_params"]["kvfence"]["pull"]
    time.sleep(LEASE_S + 2)
    r = _decode_direct(dep, ids, _consume(dep, ids, xid, pull, "lease"))
    assert r.status_code != 200, r.text
    rec = _wait_record(dep, xid)
    assert rec["reason"] == "transfer_error" and "lease" in rec["detail"], rec


def test_pull_without_the_cluster_key_is_refused(dep: Deployment) -> None:
    """Knowing a held transfer id is not enough: a pull that does not carry the cluster key's MAC moves nothing."""
    ids, xid = _prompt(24, 100), secrets.token_hex(16)
    body = {"model": dep.prefill.spec.model, "prompt": ids, "max_tokens": 1,
            "kv_transfer_params": ProduceParams("keyless", xid).to_params()}  # fmt: skip
    pull = httpx.post(f"{dep.prefill.url}/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
    header = {"t": "pull", "rid": "keyless", "xid": xid, "to": "tcp://127.0.0.1:9"}
    address = pull["kvfence"]["pull"]
    assert control.request(address, header, None)["t"] == "refused"
    assert control.request(address, header, control.control_key(ClusterKey.generate()))["t"] == "refused"


def test_prompt_not_the_routers_is_refused(dep: Deployment) -> None:
    """Decode's prompt must hash to the expectation, or verified KV would be read for another prompt."""
    a, b = _prompt(17, 64), _prompt(18, 64)
    xid = secrets.token_hex(16)
    r = _decode_direct(dep, b, _consume(dep, a, xid, _pull_address(dep)))
    assert r.status_code != 200
    assert _wait_record(dep, xid)["reason"] == "token_hash_mismatch"


def test_plain_requests_still_served_alone(dep: Deployment) -> None:
    ids = _prompt(19, 50)
    assert _plain(dep.decode, ids, 6) == _plain(dep.prefill, ids, 6)


def test_client_abort_mid_stream_leaks_no_block(dep: Deployment) -> None:
    ids = _prompt(20, 200)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{dep.proxy_url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the first token arrived: go away
    _drained(dep)


def test_no_block_held_at_the_end(dep: Deployment) -> None:
    """After every test above (failures, refusals, expired leases, aborts), both pools are empty again."""
    _drained(dep)
    m = httpx.get(f"{dep.decode.url}/metrics", timeout=10).text
    assert re.search(r"^vllm:kvfence_handoffs_verified_total\{[^}]*\} [1-9]", m, re.M), "verified loads are counted"
    assert re.search(r'^vllm:kvfence_handoffs_failed_total\{[^}]*reason="digest_mismatch"[^}]*\} [1-9]', m, re.M)
