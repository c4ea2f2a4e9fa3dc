"""Continuous batching: which requests run in the next forward, with how many tokens.

What it knows: the waiting queue and the running list; a per-step token budget
shared by decode tokens and prefill chunks (`max_num_batched_tokens`, prompts cut
into chunks of at most `chunked_prefill_size`); pages taken from the
`PageAllocator` on demand, and preemption by recomputation when they run out (the
most recently admitted running request gives its pages back and waits again). After
the forward it records the sampled tokens and applies the token-level stop rules
(max_tokens, eos, stop token ids, context length); stop strings need text, so the
engine reports those back through `finish_request`.

Hooks for disaggregation: a `prefill_only` request finishes as "prefill_done" once
its first token is sampled but keeps its pages (held by request id until `release`),
so a prefill worker can send them; `reserve` sets pages aside for a prompt whose KV
someone else will write, and `add_prefilled` admits that request for decoding as if
it had prefilled here.

What it does not know: the model, tensors or text.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from kvfence.config import SchedulerConfig
from kvfence.engine.request import Request, RequestStatus
from kvfence.errors import InvalidRequestError
from kvfence.kv.allocator import PageAllocator
from kvfence.math_utils import cdiv


class ScheduledChunk(NamedTuple):
    request: Request
    start: int  # request.num_computed_tokens when scheduled
    num_tokens: int  # tokens of request.token_ids[start : start + num_tokens] run in this forward
    sample: bool  # the chunk reaches the request's last known token: sample the next one


class SchedulerOutput(NamedTuple):
    chunks: list[ScheduledChunk]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        page_size: int,
        context_length: int,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.context_length = context_length
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chunk_limit = config.chunk_limit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the last one is preempted first
        self.held: dict[str, Request] = {}  # prefill_done requests whose pages wait for `release`
        self.reserved: dict[str, int] = {}  # request id -> tokens its reserved pages cover
        self.requests: dict[str, Request] = {}  # every waiting or running request by id
        self.num_preemptions = 0

    # -- admission ------------------------------------------------------------
    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.held or request_id in self.reserved:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")

    def add_request(self, request: Request) -> None:
        self._check_new_id(request.request_id)
        assert request.status is RequestStatus.WAITING and not request.page_table, request
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Set aside pages for `num_tokens` tokens that another worker will write; None if the pool is short."""
        self._check_new_id(request_id)
        assert num_tokens > 0, num_tokens
        n = self.pages_for(num_tokens)
        if not self.allocator.can_allocate(n):
            return None
        pages = self.allocator.allocate(request_id, n)
        self.reserved[request_id] = num_tokens
        return pages

    def add_prefilled(self, request: Request, first_token: int) -> Request:
        """Admit a request whose prompt KV already sits in its reserved pages; it then decodes as usual.

        `request` is fresh (WAITING, nothing computed); its pages are the ones `reserve`
        set aside under its id. Returns the request, possibly already finished by its
        first token (then its pages are freed).
        """
        rid = request.request_id
        if rid not in self.reserved:
            raise InvalidRequestError(f"request {rid!r} has no reserved pages; call reserve first", param="request_id")
        if self.reserved[rid] < request.num_prompt_tokens:
            raise InvalidRequestError(
                f"request {rid!r} reserved pages for {self.reserved[rid]} tokens but its prompt has "
                f"{request.num_prompt_tokens}",
                param="prompt_token_ids",
            )
        del self.reserved[rid]
        request.page_table = self.allocator.pages_of(rid)
        request.num_computed_tokens = request.num_prompt_tokens
        request.token_ids.append(first_token)
        self.requests[rid] = request
        if self._check_stop(request, first_token):
            self._finish(request)
        else:
            self.waiting.append(request)
        return request

    # -- the step -------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def _ensure_pages(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's page table to hold `num_tokens` tokens; False if the pool is short."""
        need = self.pages_for(num_tokens) - len(request.page_table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        request.page_table.extend(self.allocator.allocate(request.request_id, need))
        return True

    def _preempt(self, request: Request) -> None:
        self.allocator.free(request.request_id)
        request.page_table = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    @staticmethod
    def _chunk(req: Request, n: int) -> ScheduledChunk:
        return ScheduledChunk(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []

        # 1) running requests, in admission order: decode tokens and unfinished prefill chunks
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, self.chunk_limit, budget)
            while not self._ensure_pages(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself: everything after it is gone as well
            chunks.append(self._chunk(req, n))
            budget -= n
            i += 1

        # 2) waiting requests, first come first served, while budget, seats and pages last
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                n = req.num_uncomputed_tokens
                if n > budget and self.config.chunked_prefill_size is None:
                    break  # without chunking a prompt waits until it fits in one step
                n = min(n, self.chunk_limit, budget)
                if not self._ensure_pages(req, req.num_computed_tokens + n):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                chunks.append(self._chunk(req, n))
                budget -= n
        return SchedulerOutput(chunks, preempted)

    def update_from_output(self, output: SchedulerOutput, sampled: list[int | None]) -> list[Request]:
        """Record a forward's results; returns the requests that got a token or finished."""
        assert len(sampled) == len(output.chunks), (len(sampled), len(output.chunks))
        changed: list[Request] = []
        any_finished = False
        for chunk, token in zip(output.chunks, sampled, strict=True):
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while its forward ran
            req.num_computed_tokens += chunk.num_tokens
            if not chunk.sample:
                continue
            assert token is not None and req.num_computed_tokens == req.num_tokens, (req, token)
            req.token_ids.append(token)
            if self._check_stop(req, token):
                self._finish(req, remove_from_running=False)
                any_finished = True
            changed.append(req)
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return changed

    # -- stopping -------------------------------------------------------------
    def _check_stop(self, req: Request, token: int) -> bool:
        """Apply token-level stop rules to a just-sampled token; sets the status when it stops."""
        params = req.sampling_params
        if req.prefill_only:
            req.status = RequestStatus.FINISHED_PREFILL_DONE
        elif token in self.eos_token_ids and not params.ignore_eos:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif token in params.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.context_length:
            req.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True

    def _finish(self, req: Request, remove_from_running: bool = True) -> None:
        """Bookkeeping for a request whose status was just set to a FINISHED_* value."""
        assert req.is_finished, req
        self.requests.pop(req.request_id, None)
        if remove_from_running and req in self.running:
            self.running.remove(req)
        if req.status is RequestStatus.FINISHED_PREFILL_DONE:
            self.held[req.request_id] = req  # pages stay with the request id until `release`
        else:
            self.allocator.free(req.request_id)
            req.page_table = []

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        """Finish a waiting or running request from outside (stop string, abort); frees its pages."""
        assert status.is_finished and status is not RequestStatus.FINISHED_PREFILL_DONE, status
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.stop_reason = stop_reason
        self._finish(req, remove_from_running=False)
        return True

    def abort_request(self, request_id: str) -> bool:
        """Abort a request wherever it is (queued, running, held or reserved); its pages are freed."""
        if self.finish_request(request_id, RequestStatus.FINISHED_ABORTED):
            return True
        return self.release(request_id) is not None

    def release(self, request_id: str, quarantine: bool = False) -> list[int] | None:
        """Give back the pages a held (prefill_done) or reserved request keeps; returns them.

        None if the id is neither held nor reserved. With `quarantine`, the pages are set
        aside instead of freed (a transfer may still touch them); the caller ends that with
        `allocator.release_quarantine(request_id)`.
        """
        req = self.held.pop(request_id, None)
        was_reserved = self.reserved.pop(request_id, None) is not None
        if req is None and not was_reserved:
            return None
        if req is not None:
            req.page_table = []
        if quarantine:
            return self.allocator.quarantine(request_id)
        return self.allocator.free(request_id)

    # -- counters -------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
