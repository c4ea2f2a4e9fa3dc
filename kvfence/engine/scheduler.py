"""Continuous batching: which requests run in the next forward, with how many tokens.

What it knows: the waiting queue and the running list; a per-step token budget
shared by decode tokens and prefill chunks (`max_num_batched_tokens`, prompts cut
into chunks of at most `chunked_prefill_size`); pages taken from the
`PageAllocator` on demand, and preemption by recomputation when they run out (the
most recently admitted running request gives its pages back and waits again). After
the forward it records the sampled tokens and applies the token-level stop rules
(max_tokens, eos, stop token ids, context length); stop strings need text, so the
engine reports those back through `finish_request`. For a forward that runs several decode steps it grows
each request's pages ahead (without preempting anyone), says how many tokens each request may still sample and
which tokens stop it, and records each step's tokens as that step's own forward.

Hooks for disaggregation: a `prefill_only` request finishes as "prefill_done" once
its first token is sampled but keeps its pages (held by request id until `release`),
so a prefill worker can send them; `reserve` sets pages aside for a prompt whose KV
someone else will write, and `add_prefilled` admits that request for decoding as if
it had prefilled here.

With a `PrefixCache`, a request that starts (or restarts after preemption) first takes the longest cached
prefix of its tokens under its `cache_salt` (digest-checked by the cache; at most up to its last token, which
must run to give logits; none for a request that wants prompt logprobs), and after every forward its full,
computed pages go into the cache. Cached pages are read by reference: a request stops reading them when it
finishes, is preempted or released; the pool's unreferenced cached pages are evicted (LRU) when pages run short,
before any running request is preempted. `check()` asserts the allocator's and the cache's conservation and
that each cached page's refcount is the number of live requests whose page table holds it.

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
from kvfence.kv.prefix_cache import CACHE_OWNER, PrefixCache
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
        prefix_cache: PrefixCache | None = None,
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
        self.prefix_cache = prefix_cache

    # -- admission ------------------------------------------------------------
    def _check_new_id(self, request_id: str) -> None:
        if (
            request_id == CACHE_OWNER
            or request_id in self.requests
            or request_id in self.held
            or request_id in self.reserved
        ):
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
        if not self._make_room(n):
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
        request.prefix_cacheable = False  # its KV came from elsewhere; only a prefilling engine shares prefixes
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

    def _shortfall(self, request: Request, num_tokens: int) -> int:
        """Pages the request's table lacks to hold `num_tokens` tokens."""
        return max(0, self.pages_for(num_tokens) - len(request.page_table))

    def _ensure_pages(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's page table to hold `num_tokens` tokens; False if the pool is short."""
        need = self._shortfall(request, num_tokens)
        if need == 0:
            return True
        if not self._make_room(need):
            return False
        request.page_table.extend(self.allocator.allocate(request.request_id, need))
        return True

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can have now: the free ones and the cached ones no request reads (evicted on
        demand). Equals the pool's pages when the engine is idle, whatever the prefix cache holds."""
        return self.allocator.num_free + (self.prefix_cache.num_evictable if self.prefix_cache is not None else 0)

    def _make_room(self, num_pages: int) -> bool:
        """Whether `num_pages` can be allocated now, evicting unreferenced cached pages if that makes it so."""
        short = num_pages - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None and self.prefix_cache.num_evictable >= short:
            self.prefix_cache.evict(short)
        return self.allocator.can_allocate(num_pages)

    def _drop_pages(self, request: Request) -> None:
        """The request stops reading its cached pages and gives back its own."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(request.page_table)
        self.allocator.free(request.request_id)
        request.page_table = []
        request.num_cached_pages, request.prefix_key = 0, None

    def _uses_cache(self, request: Request) -> bool:
        return self.prefix_cache is not None and request.prefix_cacheable

    def _match_prefix(self, request: Request) -> int:
        """Before a request's first chunk: take its cached prefix; returns the tokens it covers."""
        if not self._uses_cache(request) or request.num_computed_tokens or request.page_table:
            return 0
        assert self.prefix_cache is not None
        limit = (request.num_tokens - 1) // self.page_size  # the last token runs: its logits give the next one
        m = self.prefix_cache.match(request.sampling_params.cache_salt, request.token_ids, limit)
        request.page_table = list(m.pages)
        request.num_cached_pages, request.prefix_key = len(m.pages), m.key
        request.num_computed_tokens = len(m.pages) * self.page_size
        return request.num_computed_tokens

    def _unmatch(self, request: Request) -> None:
        """Undo `_match_prefix` for a request that could not be admitted after all."""
        assert self.prefix_cache is not None and not self.allocator.pages_of(request.request_id)
        self.prefix_cache.release(request.page_table)
        request.page_table, request.num_cached_pages, request.num_computed_tokens = [], 0, 0
        request.prefix_key = None

    def _cache_pages(self, request: Request) -> None:
        """Offer the request's full, computed pages to the prefix cache."""
        if not self._uses_cache(request) or request.status is not RequestStatus.RUNNING:
            return
        assert self.prefix_cache is not None
        num_full = request.num_computed_tokens // self.page_size
        if num_full > request.num_cached_pages:
            request.prefix_key = self.prefix_cache.insert(
                request.request_id,
                request.sampling_params.cache_salt,
                request.token_ids,
                request.page_table,
                request.num_cached_pages,
                num_full,
                request.prefix_key,
            )
            request.num_cached_pages = num_full

    def _preempt(self, request: Request) -> None:
        self._drop_pages(request)
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
                hit = self._match_prefix(req)
                n = req.num_uncomputed_tokens
                if n > budget and self.config.chunked_prefill_size is None:
                    if hit:
                        self._unmatch(req)
                    break  # without chunking a prompt waits until it fits in one step
                n = min(n, self.chunk_limit, budget)
                if not self._ensure_pages(req, req.num_computed_tokens + n):
                    if hit:
                        self._unmatch(req)
                    break
                if self._uses_cache(req) and req.num_preemptions == 0 and req.num_output_tokens == 0:
                    assert self.prefix_cache is not None
                    self.prefix_cache.record_query(req.num_prompt_tokens, hit)
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
            self._cache_pages(req)
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

    # -- several decode steps per forward ------------------------------------------
    def steps_left(self, req: Request) -> int:
        """Tokens a running request may still sample before max_tokens or the context length stops it (>= 1)."""
        return min(req.sampling_params.max_tokens - req.num_output_tokens, self.context_length - req.num_tokens)

    def stop_tokens(self, req: Request) -> tuple[int, ...]:
        """The sampled tokens that finish the request: eos (unless ignore_eos) and its stop_token_ids."""
        eos = () if req.sampling_params.ignore_eos else tuple(sorted(self.eos_token_ids))
        return eos + tuple(req.sampling_params.stop_token_ids)

    def grow_for_steps(self, output: SchedulerOutput, steps: int) -> bool:
        """Before a decode forward that runs `steps` steps: each request's pages then hold its tokens up to the
        last step's. All or nothing: False, with no page taken and nothing evicted or preempted, unless the
        free pages (and the prefix cache's unreferenced ones) cover every request's shortfall."""
        assert all(c.num_tokens == 1 for c in output.chunks), "several steps are for decode batches only"
        if not self._make_room(sum(self._shortfall(c.request, c.start + steps) for c in output.chunks)):
            return False
        for c in output.chunks:  # the room is there: each request takes its share as a single step would
            grown = self._ensure_pages(c.request, c.start + steps)
            assert grown, c.request
        return True

    def step_output(self, output: SchedulerOutput, step: int) -> SchedulerOutput:
        """The decode batch `output` as its `step`-th step (0: itself) would have been scheduled."""
        if step == 0:
            return output
        return SchedulerOutput([c._replace(start=c.start + step) for c in output.chunks], [])

    # -- stopping -------------------------------------------------------------
    def _check_stop(self, req: Request, token: int) -> bool:
        """Apply token-level stop rules to a just-sampled token; sets the status when it stops."""
        params = req.sampling_params
        if req.prefill_only:
            req.status = RequestStatus.FINISHED_PREFILL_DONE
        elif token in self.stop_tokens(req):  # the same list the multi-step decode stops on
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
            self._drop_pages(req)

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
            if self.prefix_cache is not None:
                self.prefix_cache.release(req.page_table)
            req.page_table = []
        if quarantine:
            return self.allocator.quarantine(request_id)
        return self.allocator.free(request_id)

    # -- invariants -----------------------------------------------------------
    def check(self) -> None:
        """Conservation of the allocator and the prefix cache; each cached page's refcount is its readers."""
        self.allocator.check()
        if self.prefix_cache is None:
            return
        self.prefix_cache.check()
        readers: dict[int, int] = {}
        live = [*self.waiting, *self.running, *self.held.values()]
        for req in live:
            for p in req.page_table:
                if self.prefix_cache.is_cached(p):
                    readers[p] = readers.get(p, 0) + 1
        for p in self.allocator.pages_of(CACHE_OWNER):
            assert self.prefix_cache.refcount(p) == readers.get(p, 0), (p, self.prefix_cache.refcount(p), readers)

    # -- counters -------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
