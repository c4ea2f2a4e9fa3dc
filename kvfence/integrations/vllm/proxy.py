"""`kvfence proxy`: kvfence's OpenAI front end over a vLLM prefill instance and a vLLM decode instance.

What it knows: `VllmPDClient`, an `EngineClient` (engine/engine_client.py), so the HTTP surface, admission, metrics,
logs and error shapes are exactly `kvfence serve`'s (server/api.py). It plays kvfence's router for vLLM:

1. The API tokenized the prompt with the model's own tokenizer (kvfence's). For each choice the client draws a
   fresh secret transfer id (`secrets.token_hex(16)`, 128 bits) and computes the expected token count and token hash
   (`integrity.digest.token_hash`) itself; prefill never supplies them.
2. Prefill gets the token ids, `max_tokens` 1 and `kv_transfer_params` {produce, request id, transfer id}; its
   response names its pull address (params.py). Prompt logprobs, when asked for, come from here: prefill computed
   every prompt position in its own process.
3. Decode gets the same token ids, the sampling parameters and {consume, transfer id, expected count and hash,
   prefill's pull address, this proxy's record address}; it streams its tokens. Its connector sends the integrity
   record here (a `control.ControlServer`) when it verified, or failed, the handoff, which is before decode's first
   token. The proxy releases no token before a `verified` record: a failure, a missing record, or decode answering
   without one (an instance without the connector) fails the choice, with the record naming the reason.
4. Every choice ends with its record (`choices[i].kvfence.integrity`), counted in `kvfence_handoff_*` metrics and
   logged as one JSON line, like `kvfence serve`.

What it does not know: vLLM's internals (only its OpenAI HTTP API, with the vLLM extensions `return_token_ids`,
`return_tokens_as_token_ids`, `prompt_logprobs` and `kv_transfer_params`), nor how the instances were started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from kvfence.auth.keys import ClusterKey
from kvfence.engine.engine_client import Capacity, GenerationChunk
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.token_logprobs import TokenLogprobs
from kvfence.errors import KvfenceError
from kvfence.integrations.vllm import control
from kvfence.integrations.vllm.control_messages import MessageError, Ok, Record, Refused, request_from, to_header
from kvfence.integrations.vllm.params import ConsumeParams, ParamsError, ProducedParams, ProduceParams
from kvfence.integrity.digest import token_hash
from kvfence.integrity.record import IntegrityMetrics, IntegrityRecord
from kvfence.integrity.verify import Reason, VerifyResult
from kvfence.transfer.base import transfer_ref

logger = logging.getLogger(__name__)
integrity_logger = logging.getLogger("kvfence.integrity")

_TOKEN_AS_ID = re.compile(r"token_id:(-?\d+)")
_ERROR_BODY = 300  # characters of an instance's error body quoted in a record


def vllm_sampling(params: SamplingParams) -> dict[str, Any]:
    """kvfence's sampling parameters as vLLM's /v1/completions fields (same semantics: kvfence follows vLLM's)."""
    d: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "min_tokens": params.min_tokens,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
    }
    if params.seed is not None:
        d["seed"] = params.seed
    if params.logit_bias:
        d["logit_bias"] = {str(t): b for t, b in params.logit_bias}
    if params.logprobs is not None:
        d["logprobs"] = params.logprobs
        d["return_tokens_as_token_ids"] = True
    so = params.structured_outputs
    if so is not None:
        d["structured_outputs"] = {"json_object": True} if so.json_object else {"json": json.loads(so.json or "{}")}
    return d


def _token_id(text: str) -> int:
    m = _TOKEN_AS_ID.fullmatch(text)
    if m is None:
        raise ValueError(f"logprob token {text!r} is not in token_id:N form")
    return int(m.group(1))


def completion_logprobs(lp: dict[str, Any] | None, n: int) -> list[TokenLogprobs] | None:
    """vLLM's completion `logprobs` object (tokens as `token_id:N`) as kvfence's per-token entries, best n first."""
    if not lp:
        return None
    out = []
    for tok, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp.get("top_logprobs") or [], strict=False):
        ranked = sorted(((_token_id(t), float(v)) for t, v in (top or {}).items()), key=lambda kv: -kv[1])
        out.append(TokenLogprobs(_token_id(tok), float(logprob), tuple(ranked[:n])))
    return out


def prompt_logprobs_of(entries: list[Any] | None, ids: list[int], n: int) -> list[TokenLogprobs | None] | None:
    """vLLM's `prompt_logprobs` (None, then {token id: {logprob, rank, ...}} per position) as kvfence's entries."""
    if entries is None:
        return None
    out: list[TokenLogprobs | None] = []
    for tok, entry in zip(ids, entries, strict=False):
        if not entry:
            out.append(None)
            continue
        scores = {int(k): float(v["logprob"]) for k, v in entry.items()}
        ranked = sorted(scores.items(), key=lambda kv: -kv[1])
        out.append(TokenLogprobs(tok, scores.get(tok, float("-inf")), tuple(ranked[:n])))
    return out


class _Failure(Exception):
    """A choice that fails: its reason and detail, and decode's record when the failure is the one it recorded."""

    def __init__(self, reason: Reason, detail: str, record: IntegrityRecord | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.record = reason, detail, record


class VllmPDClient:
    """An `EngineClient` over one vLLM prefill instance and one vLLM decode instance running `KvfenceConnector`."""

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        *,
        vllm_model: str,
        model_name: str | None = None,
        capacity: Capacity,
        key: ClusterKey,
        record_host: str = "127.0.0.1",
        record_timeout_s: float = 30.0,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.model_name, self.vllm_model = model_name or vllm_model, vllm_model
        self._capacity = capacity
        self.key = key
        self.record_timeout_s, self.request_timeout_s = record_timeout_s, request_timeout_s
        self.integrity_metrics = IntegrityMetrics()
        self.integrity_counts: dict[str, int] = {}
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[IntegrityRecord]]] = {}
        self._early: dict[str, IntegrityRecord] = {}
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._http: httpx.AsyncClient | None = None
        self.records = control.ControlServer(self._on_record, self._control_key(), record_host, 0)

    def _control_key(self) -> bytes:
        return control.control_key(self.key)

    # -- EngineClient ---------------------------------------------------------------------------------------------
    def capacity(self) -> Capacity:
        return self._capacity

    def server_info(self) -> dict[str, Any]:
        return {
            "engine": "vllm",
            "prefill_url": self.prefill_url,
            "decode_url": self.decode_url,
            "vllm_model": self.vllm_model,
            "record_address": self.records.address,
            "cluster_key": self.key.describe(),
        }

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self._waiting), "integrity": dict(self.integrity_counts)}

    async def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None and not task.done():
            task.cancel()

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        return self._generate(request_id, list(prompt_token_ids), params)

    async def _generate(self, rid: str, ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        xid = secrets.token_hex(16)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[IntegrityRecord] = loop.create_future()
        self._waiting[xid] = (loop, fut)
        current = asyncio.current_task()
        if current is not None:
            self._tasks[rid] = current
        t0 = time.monotonic()
        record: IntegrityRecord | None = None
        try:
            pull, prompt_lps = await self._prefill(rid, xid, ids, params)
            async for chunk in self._decode(rid, xid, ids, params, pull, prompt_lps, fut):
                if chunk.finished:
                    record = fut.result()
                    chunk.integrity = record.to_api()
                yield chunk
        except _Failure as f:
            record = f.record or self._proxy_record(rid, xid, ids, f.reason, f.detail, t0)
            yield self._error_chunk(ids, record, f.detail)
        finally:
            self._waiting.pop(xid, None)
            self._early.pop(xid, None)
            self._tasks.pop(rid, None)
            if record is not None:
                self._observe(record)

    # -- the two instances ----------------------------------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            # idle connections are dropped before vLLM's server (uvicorn, 5 s) closes them, so a request is never sent
            # on a connection the server is closing
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0)
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s, connect=10.0), limits=limits)
        return self._http

    async def _prefill(
        self, rid: str, xid: str, ids: list[int], params: SamplingParams
    ) -> tuple[ProducedParams, list[TokenLogprobs | None] | None]:
        body: dict[str, Any] = {
            "model": self.vllm_model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": ProduceParams(rid, xid).to_params(),
        }
        if params.prompt_logprobs is not None:
            body["prompt_logprobs"] = params.prompt_logprobs
        url = f"{self.prefill_url}/v1/completions"
        try:
            try:
                r = await self._client().post(url, json=body, headers={"X-Request-Id": rid})
            except (httpx.RemoteProtocolError, httpx.ReadError):  # a kept-alive connection the server had closed
                r = await self._client().post(url, json=body, headers={"X-Request-Id": rid})
        except httpx.HTTPError as e:
            raise _Failure(Reason.TRANSFER_ERROR, f"prefill at {self.prefill_url} did not answer: {e!r}") from None
        if r.status_code != 200:
            raise _Failure(Reason.TRANSFER_ERROR, f"prefill answered {r.status_code}: {r.text[:_ERROR_BODY]}")
        data = r.json()
        try:
            produced = ProducedParams.parse(data.get("kv_transfer_params"))
        except ParamsError as e:
            raise _Failure(Reason.TRANSFER_ERROR, f"prefill did not hold the prompt's KV: {e}; its answer: "
                           f"{json.dumps(data.get('kv_transfer_params'))[:_ERROR_BODY]}") from None  # fmt: skip
        if produced.transfer_id != xid or produced.request_id != rid:
            raise _Failure(Reason.TRANSFER_ERROR, "prefill answered for another transfer")
        if produced.num_tokens != len(ids):
            raise _Failure(
                Reason.TOKEN_COUNT_MISMATCH, f"prefill computed {produced.num_tokens} tokens, the prompt has {len(ids)}"
            )
        n = params.prompt_logprobs or 0
        prompt_lps = prompt_logprobs_of(data["choices"][0].get("prompt_logprobs"), ids, n)
        return produced, prompt_lps

    async def _decode(
        self,
        rid: str,
        xid: str,
        ids: list[int],
        params: SamplingParams,
        produced: ProducedParams,
        prompt_lps: list[TokenLogprobs | None] | None,
        fut: asyncio.Future[IntegrityRecord],
    ) -> AsyncIterator[GenerationChunk]:
        consume = ConsumeParams(rid, xid, len(ids), token_hash(ids), produced.pull, self.records.address)
        body = {
            "model": self.vllm_model,
            "prompt": ids,
            "stream": True,
            "return_token_ids": True,
            **vllm_sampling(params),
            "kv_transfer_params": consume.to_params(),
        }
        url = f"{self.decode_url}/v1/completions"
        record: IntegrityRecord | None = None
        num_out = 0
        first = True
        try:
            async with self._client().stream("POST", url, json=body, headers={"X-Request-Id": rid}) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:_ERROR_BODY]
                    raise await self._decode_failed(fut, f"decode answered {resp.status_code}: {text}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        what = f"decode's stream failed: {str(event['error'])[:_ERROR_BODY]}"
                        raise await self._decode_failed(fut, what)
                    choice = (event.get("choices") or [None])[0]
                    if choice is None:
                        continue
                    if record is None:  # nothing decode computed leaves before the handoff verified
                        record = await self._record(fut)
                        if record.status != "verified":
                            raise _Failure(Reason(record.reason or "transfer_error"), record.detail, record)
                    token_ids = list(choice.get("token_ids") or [])
                    num_out += len(token_ids)
                    finish = choice.get("finish_reason")
                    chunk = GenerationChunk(
                        token_ids=token_ids,
                        text=choice.get("text") or "",
                        finished=finish is not None,
                        finish_reason=finish,
                        num_prompt_tokens=len(ids),
                        num_output_tokens=num_out,
                        logprobs=completion_logprobs(choice.get("logprobs"), params.logprobs or 0),
                        prompt_logprobs=prompt_lps if first else None,
                    )
                    first = False
                    if finish is not None:
                        if finish == "error":
                            raise _Failure(Reason.TRANSFER_ERROR, "decode finished the request with an error")
                        yield chunk
                        return
                    yield chunk
        except httpx.HTTPError as e:
            raise await self._decode_failed(fut, f"decode at {self.decode_url} failed: {e!r}") from None
        raise await self._decode_failed(fut, "decode's stream ended without a finish reason")

    async def _decode_failed(self, fut: asyncio.Future[IntegrityRecord], what: str) -> _Failure:
        """The failure to report when decode answered with an error: its connector's record when one came (it names
        the handoff's reason), else what decode said."""
        try:
            record = await self._record(fut, timeout_s=min(5.0, self.record_timeout_s))
        except _Failure:
            return _Failure(Reason.TRANSFER_ERROR, f"{what}; no integrity record came from decode")
        if record.status == "verified":
            return _Failure(Reason.TRANSFER_ERROR, f"{what} (after its handoff verified)")
        return _Failure(Reason(record.reason or "transfer_error"), record.detail, record)

    async def _record(self, fut: asyncio.Future[IntegrityRecord], timeout_s: float | None = None) -> IntegrityRecord:
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s or self.record_timeout_s)
        except asyncio.TimeoutError:
            raise _Failure(
                Reason.TIMEOUT,
                "decode sent no integrity record: is KvfenceConnector loaded on the decode instance, as kv_consumer?",
            ) from None

    # -- records ----------------------------------------------------------------------------------------------------
    def _on_record(self, header: control.Header, peer: str) -> control.Header:
        """A record from decode's connector (its own thread): hand it to the waiting request."""
        try:
            msg = request_from(header)
        except MessageError as e:
            return to_header(Refused(str(e)))
        if not isinstance(msg, Record) or msg.xid not in self._waiting:
            return to_header(Refused("no request waits for this transfer id"))
        xid = msg.xid
        try:
            record = IntegrityRecord.from_dict(msg.record)
        except (TypeError, ValueError) as e:
            return to_header(Refused(f"malformed record: {e}"))
        if record.transfer_ref != transfer_ref(xid):
            return to_header(Refused("the record is for another transfer"))
        loop, fut = self._waiting[xid]

        def deliver() -> None:
            if not fut.done():
                fut.set_result(record)

        loop.call_soon_threadsafe(deliver)
        return to_header(Ok())

    def _proxy_record(self, rid: str, xid: str, ids: list[int], reason: Reason, detail: str, t0: float):
        """The record of a choice whose failure the proxy saw itself (or took from decode's record)."""
        result = VerifyResult(False, reason, detail, 0, 0)
        return IntegrityRecord.from_result(
            rid,
            result,
            tokens_expected=len(ids),
            pages=0,
            layout_fingerprint="",
            transfer_ref=transfer_ref(xid),
            role="decode",
            timings={"total": round(time.monotonic() - t0, 6)},
        )

    def _error_chunk(self, ids: list[int], record: IntegrityRecord, detail: str) -> GenerationChunk:
        return GenerationChunk(
            token_ids=[],
            text="",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=len(ids),
            integrity=record.to_api(),
            error=f"KV handoff {record.status} ({record.reason}): {detail}",
        )

    def _observe(self, record: IntegrityRecord) -> None:
        self.integrity_metrics.observe(record)
        self.integrity_counts[record.status] = self.integrity_counts.get(record.status, 0) + 1
        integrity_logger.info(record.to_json())

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    def close(self) -> None:
        self.records.close()


# -- building the front end ------------------------------------------------------------------------------------------

_INFO_LABEL = re.compile(r'(\w+)="([^"]*)"')


def discover(url: str, timeout_s: float = 10.0) -> tuple[str, int, int, int]:
    """(model id, max_model_len, KV blocks, block size) of a vLLM instance, from /v1/models and /metrics."""
    try:
        models = httpx.get(f"{url}/v1/models", timeout=timeout_s).json()["data"][0]
        metrics = httpx.get(f"{url}/metrics", timeout=timeout_s).text
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise KvfenceError(f"cannot read {url}/v1/models and /metrics (is it a vLLM server?): {e}") from None
    info = next((line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{")), "")
    labels = dict(_INFO_LABEL.findall(info))
    try:
        blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        raise KvfenceError(f"{url}/metrics has no vllm:cache_config_info with the KV pool size") from None
    return str(models["id"]), int(models["max_model_len"]), blocks, block_size


def build_client(prefill_url: str, decode_url: str, key: ClusterKey, **kw: Any) -> VllmPDClient:
    """A `VllmPDClient` for two running instances, its capacity read from them (both must serve the same model)."""
    p_model, p_len, p_blocks, p_bs = discover(prefill_url)
    d_model, d_len, d_blocks, d_bs = discover(decode_url)
    if p_model != d_model:
        raise KvfenceError(f"prefill serves {p_model!r} but decode serves {d_model!r}")
    if p_bs != d_bs:
        raise KvfenceError(f"prefill's block size is {p_bs}, decode's {d_bs}: their KV cannot be exchanged")
    capacity = Capacity(min(p_len, d_len), {"prefill": p_blocks * p_bs, "decode": d_blocks * d_bs}, p_bs)
    return VllmPDClient(prefill_url, decode_url, vllm_model=p_model, capacity=capacity, key=key, **kw)
