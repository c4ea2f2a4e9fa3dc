"""`KvfenceConnector`: vLLM's KV connector (`KVConnectorBase_V1`) with kvfence's verified handoff.

Load it in vLLM with

    --kv-transfer-config '{"kv_connector": "KvfenceConnector",
                           "kv_connector_module_path": "kvfence.integrations.vllm.connector",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {...HandoffConfig fields...}}'

and put `kvfence proxy` in front (it plays kvfence's router: tokenizes, issues the transfer id, supplies the
expected token count and hash, returns the integrity record). What each hook does:

Scheduler process (`role == SCHEDULER`):
  on_new_request            reads the request's kvfence `kv_transfer_params` (params.py); a consumer refuses, at
                            load time, any kv_transfer_params that are not a well-formed kvfence consume message
  get_num_new_matched_tokens consumer: the whole prompt comes from prefill, asynchronously (WAITING_FOR_REMOTE_KVS)
  update_state_after_alloc  consumer: the blocks vLLM allocated become the load's page table; the prompt vLLM will
                            decode must hash to the router's token hash, or the load is refused
  build_connector_meta      producer: the step whose forward completes a prompt tells the worker to digest its
                            blocks; finished/preempted requests are held or dropped; consumer: loads to start/abort
  request_finished          producer: a finished prompt's blocks stay allocated (True) until the worker releases
                            them, and prefill's response carries the pull address under the transfer id
Worker process:
  register_kv_caches        builds the `VllmBlockPool` over every layer's cache tensor, in vLLM's layer order
  start_load_kv             consumer: starts the loads (pull + kvfence TCP receive into the blocks)
  wait_for_save             producer: digests + canaries of the blocks completed by this step's forward
  get_transfer_results      producer: blocks released (verdict in, or lease expired); consumer: loads verified
                            (finished_recving) or failed (failed_recving too: vLLM fails the request with
                            kv_load_failure_policy "fail", which this connector requires on a consumer)

Fail closed: a consumer reports a load finished only after every check of `integrity.verify` passed, or as failed
(`failed_recving`); vLLM 0.32 then finishes the request with FINISHED_ERROR, which its OpenAI server answers with an
error (HTTP 500, or an error event in a stream) and never with tokens. Its blocks are handed back only once no
write of the transfer can land in them.

What it does not know: kvfence's handoff itself (handoff.py), the front end (proxy.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from kvfence.auth.keys import INSECURE_WARNING, load_cluster_key
from kvfence.integrations.vllm import params as kp
from kvfence.integrations.vllm.handoff import (
    ConsumerHandoff,
    HandoffConfig,
    ProducerHandoff,
    VllmBlockPool,
    check_prompt,
    refuse,
    vllm_layout,
)
from kvfence.integrity.verify import Reason, VerifyResult
from kvfence.kv.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _log_to_stderr() -> None:
    """vLLM configures only its own loggers: give kvfence's (connector, handoff, integrity records) a stderr handler
    at INFO in vLLM's processes, once."""
    root = logging.getLogger("kvfence")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False


_HOLD_STATUSES = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


# -- what the scheduler tells the worker each step ------------------------------------------------------------------


@dataclass(frozen=True)
class DigestOrder:
    vllm_id: str
    request_id: str
    transfer_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass(frozen=True)
class LoadOrder:
    vllm_id: str
    params: kp.ConsumeParams | None
    block_ids: list[int]
    refused: VerifyResult | None  # the load fails at once, for this reason
    record_to: str | None


@dataclass
class KvfenceMetadata(KVConnectorMetadata):
    digests: list[DigestOrder] = field(default_factory=list)
    holds: list[str] = field(default_factory=list)  # producer: finished, blocks kept for the transfer
    drops: list[str] = field(default_factory=list)  # producer: preempted or not finished: blocks gone
    loads: list[LoadOrder] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # consumer: finished while loading


@dataclass
class KvfenceHandshake(KVConnectorHandshakeMetadata):
    """What the worker tells the scheduler once its listeners are up (ports may be picked by the OS)."""

    pull_address: str | None
    data_address: str | None
    layout_fingerprint: str


@dataclass
class _Tracked:
    request: Request
    role: str  # "produce" | "consume"
    produce: kp.ProduceParams | None = None
    consume: kp.ConsumeParams | None = None
    error: str | None = None  # the params did not parse
    digested: bool = False
    load_started: bool = False


def _request_amx() -> None:
    """Ask Linux for AMX tile state for this process before any forward. vLLM 0.32's CPU attention kernel uses AMX
    without asking; when a worker's first forward is the last token of a prompt whose KV was loaded (the first step
    of a consumer), no matmul has asked before it and the worker dies of SIGILL. Asking is harmless elsewhere."""
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init is not None:
        init()


def _config_error(message: str) -> ValueError:
    return ValueError(f"KvfenceConnector: {message}")


class KvfenceConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        _log_to_stderr()
        ktc = self._kv_transfer_config
        try:
            self.config = HandoffConfig.from_extra(ktc.kv_connector_extra_config)
        except ValueError as e:
            raise _config_error(str(e)) from None
        self.is_producer, self.is_consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        self._check_config(vllm_config, kv_cache_config)
        # the deployment's key: extra_config's cluster_key_file, else $KVFENCE_CLUSTER_KEY_FILE / $KVFENCE_CLUSTER_KEY;
        # none refuses to start unless insecure_no_auth is set (auth.keys.load_cluster_key says which)
        self.key = load_cluster_key(self.config.cluster_key_file, self.config.insecure_no_auth)
        if not self.key.secure:
            logger.warning("kvfence: %s", INSECURE_WARNING)
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._meta = KvfenceMetadata()
        self._pull_address: str | None = None
        # worker side
        self.producer: ProducerHandoff | None = None
        self.consumer: ConsumerHandoff | None = None
        self._layout: KVLayout | None = None
        self._stats_seen: dict[str, float] = {}

    def _check_config(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        ktc = self._kv_transfer_config
        if self.is_consumer and ktc.kv_load_failure_policy != "fail":
            raise _config_error(
                f"a consumer needs kv_load_failure_policy 'fail' (got {ktc.kv_load_failure_policy!r}): a load that "
                "does not verify must fail the request, not be recomputed silently"
            )
        if self.is_consumer and vllm_config.cache_config.enable_prefix_caching:
            raise _config_error(
                "a consumer needs prefix caching off (--no-enable-prefix-caching): the whole prompt's KV comes from "
                "prefill and is verified page by page; a local prefix hit would leave pages it cannot verify"
            )
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise _config_error("only tensor_parallel_size 1 and pipeline_parallel_size 1 are supported")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise _config_error(
                f"{len(kv_cache_config.kv_cache_groups)} KV cache groups; this connector covers models whose every "
                "layer's KV lives in one group (it does not declare hybrid-allocator support, so vLLM puts all "
                "attention layers in one group; this model has other kinds of state)"
            )

    # ==== worker side ====================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        _request_amx()
        group = self._kv_cache_config.kv_cache_groups[0]
        names = list(group.layer_names)
        if set(names) != set(kv_caches):
            raise _config_error(
                f"vLLM registered caches for {sorted(kv_caches)} but the KV cache group lists {sorted(names)}"
            )
        tensors = [kv_caches[n] for n in names]
        first = tensors[0]
        mc = self._vllm_config.model_config
        layout = vllm_layout(
            architecture=(mc.architectures or ["unknown"])[0],
            backend=first.device.type,
            block_shape=tuple(first.shape[1:]),
            dtype=first.dtype,
            block_size=group.kv_cache_spec.block_size,
            num_layers=len(tensors),
        )
        pool = VllmBlockPool(layout, tensors)
        self._layout = layout
        if self.is_producer:
            self.producer = ProducerHandoff(pool, self.config, self.key)
        if self.is_consumer:
            self.consumer = ConsumerHandoff(pool, self.config, self.key)
        logger.info(
            "kvfence: connector ready (%s), layout %s %s, pull %s, data %s, cluster key %s",
            "producer" if self.is_producer and not self.is_consumer else "consumer" if not self.is_producer else "both",
            layout.fingerprint,
            layout.describe(),
            self.producer.pull_address if self.producer else None,
            self.consumer.data_address if self.consumer else None,
            self.key.key_id if self.key.secure else "none (insecure)",
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return KvfenceHandshake(
            self.producer.pull_address if self.producer else None,
            self.consumer.data_address if self.consumer else None,
            self._layout.fingerprint if self._layout is not None else "",
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfenceMetadata)
        if self.consumer is None:
            return
        for order in meta.loads:
            self.consumer.start(order.vllm_id, order.params, order.block_ids, order.refused, order.record_to)
        for vllm_id in meta.aborts:
            self.consumer.abort(vllm_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous: nothing runs before they verified

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kw: Any):
        return  # the producer reads the blocks once, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfenceMetadata)
        if self.producer is None:
            return
        for vllm_id in meta.drops:
            self.producer.drop(vllm_id)
        for vllm_id in meta.holds:
            self.producer.hold(vllm_id)
        for d in meta.digests:  # this step's forward has written these prompts' KV
            self.producer.digest(d.vllm_id, d.request_id, d.transfer_id, d.token_ids, d.block_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.producer is not None:
            out.finished_sending = self.producer.poll()
        if self.consumer is not None:
            loads = self.consumer.poll()
            out.finished_recving, out.failed_recving = loads.finished, loads.failed
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        from kvfence.integrations.vllm.stats import KvfenceStats

        now: dict[str, float] = {}
        if self.consumer is not None:
            c = self.consumer
            now.update({f"consumer_{k}": float(v) for k, v in c.counts.items()})
            now.update({f"failed_reason_{k}": float(v) for k, v in c.failed_by_reason.items()})
            now["records_undelivered"] = float(c.records_undelivered)
        if self.producer is not None:
            now.update({f"producer_{k}": float(v) for k, v in self.producer.counts.items()})
        delta = {k: v - self._stats_seen.get(k, 0.0) for k, v in now.items() if v != self._stats_seen.get(k, 0.0)}
        self._stats_seen = now
        if self.producer is not None:
            delta["producer_held_now"] = float(self.producer.stats().held)
        return KvfenceStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        from kvfence.integrations.vllm.stats import KvfenceStats

        return KvfenceStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ) -> KVConnectorPromMetrics | None:
        from kvfence.integrations.vllm.stats import KvfencePromMetrics

        return KvfencePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()

    # ==== scheduler side =================================================================================
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        for meta in metadata.values():
            if isinstance(meta, KvfenceHandshake) and meta.pull_address:
                self._pull_address = meta.pull_address

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        role = kp.role_of(params)
        if role is None and not (self.is_consumer and params):
            return  # a plain request: served by this instance alone, no handoff
        t = _Tracked(request, "consume" if self.is_consumer and role != "produce" else "produce")
        try:
            if t.role == "produce":
                if not self.is_producer:
                    raise kp.ParamsError("this instance is not a kv_producer")
                t.produce = kp.ProduceParams.parse(params)
            else:
                t.consume = kp.ConsumeParams.parse(params)
        except kp.ParamsError as e:
            t.error = str(e)
            logger.warning("kvfence: request %s: %s", request.request_id, e)
        self._tracked[request.request_id] = t

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self._tracked.get(request.request_id)
        if t is None or t.role != "consume" or t.load_started:
            return 0, False
        return len(request.prompt_token_ids or ()) - num_computed_tokens, True

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))  # every group comes from prefill

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        t = self._tracked.get(request.request_id)
        if t is None or t.role != "consume" or t.load_started or num_external_tokens <= 0:
            return
        t.load_started = True
        refused: VerifyResult | None = None
        if t.error is not None:
            refused = refuse(Reason.TRANSFER_ERROR, f"kv_transfer_params refused: {t.error}")
        elif t.consume is not None:
            refused = check_prompt(t.consume, request.prompt_token_ids or [])
        record_to = t.consume.record_to if t.consume is not None else kp.record_address(request.kv_transfer_params)
        self._meta.loads.append(
            LoadOrder(request.request_id, t.consume, list(blocks.get_block_ids()[0]), refused, record_to)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._meta
        for vllm_id in scheduler_output.preempted_req_ids or ():
            t = self._tracked.get(vllm_id)
            if t is not None and t.role == "produce" and t.digested:
                t.digested = False  # its blocks were freed: computed again, digested again
                meta.drops.append(vllm_id)
        for vllm_id, n in scheduler_output.num_scheduled_tokens.items():
            t = self._tracked.get(vllm_id)
            if t is None or t.role != "produce" or t.produce is None or t.digested:
                continue
            req = t.request
            prompt = list(req.prompt_token_ids or [])
            if req.num_computed_tokens + n < len(prompt):
                continue  # a chunk of a longer prompt: digest when the last chunk ran
            assert self._kv_cache_manager is not None
            blocks = self._kv_cache_manager.get_blocks(vllm_id).get_block_ids()[0]
            t.digested = True
            meta.digests.append(DigestOrder(vllm_id, t.produce.request_id, t.produce.transfer_id, prompt, list(blocks)))
        self._meta = KvfenceMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        t = self._tracked.pop(request.request_id, None)
        if t is None:
            return False, None
        if t.role == "consume":
            if t.load_started:
                self._meta.aborts.append(request.request_id)  # ignored by the worker once the load ended
            return False, None
        if t.produce is None:
            return False, {kp.KEY: {"v": kp.VERSION, "role": "error", "error": t.error}}
        if not t.digested or request.status not in _HOLD_STATUSES:
            if t.digested:
                self._meta.drops.append(request.request_id)
            why = f"prefill did not complete the prompt (status {request.status.name})"
            return False, {kp.KEY: {"v": kp.VERSION, "role": "error", "error": why}}
        if self._pull_address is None:
            self._meta.drops.append(request.request_id)
            return False, {kp.KEY: {"v": kp.VERSION, "role": "error", "error": "prefill's pull channel is not up"}}
        self._meta.holds.append(request.request_id)
        produced = kp.ProducedParams(
            t.produce.request_id, t.produce.transfer_id, self._pull_address, len(request.prompt_token_ids or ())
        )
        return True, produced.to_params()
