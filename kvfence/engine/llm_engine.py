"""The engine loop: requests in, one scheduled forward per `step()`, token and text deltas out.

What it knows: how to build the pieces from an `EngineConfig` (model, KV pool,
allocator, scheduler, runner) after the start-up capacity check, how to validate a
request into clear errors, and how to turn sampled tokens into incremental
`RequestOutput`s with text (incremental detokenization; stop strings are found in
the text once min_tokens are out, cut from it, and finish the request) and the log
probabilities a request asked for (its prompt's with its first output). It keeps each
`response_format` request's grammar in step with the tokens it appends. A decode batch of greedy requests that
need nothing from Python between tokens runs several steps in one forward where the runner can
(`SchedulerConfig.max_decode_steps`), each step's tokens recorded as its own forward would have. It also exposes
the disaggregation hooks: `prefill_only` requests that keep their pages until `release`, and
`reserve` + `add_prefilled_request` for a decode worker that receives KV from
elsewhere, and `first_token_text`, so a prefill worker can say what text that decode
worker's output will start with.

What it does not know: HTTP, routing, transfers or KV verification; those sit above
and talk to it through these methods and `pool` / `allocator`.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from kvfence.config import (
    ConfigError,
    EngineConfig,
    ResolvedEngineConfig,
    check_capacity,
    check_scheduler_fits,
)
from kvfence.engine.request import Request, RequestStatus
from kvfence.engine.runner import ModelRunner, RunnerOutput
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.scheduler import Scheduler, SchedulerOutput
from kvfence.engine.token_logprobs import TokenLogprobs
from kvfence.errors import ContextLengthExceededError, InvalidRequestError, KvfenceError
from kvfence.integrity.digest import digest_algorithm_for, page_digests
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.pool import KVPool
from kvfence.kv.prefix_cache import PrefixCache
from kvfence.models.heap import HeapBounds, bound_step_heap, release_freed_heap
from kvfence.models.startup_pages import release_startup_pages
from kvfence.models.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from kvfence.engine.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RequestOutput:
    """What one step produced for one request: tokens and text since its previous output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefill_done"
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    stop_reason: int | str | None = None  # the stop token id or stop string, when finish_reason == "stop"
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the request's first output, when asked for


@dataclass
class Completion:
    """A whole finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_held: int  # prefill_done requests whose pages wait for `release`
    num_reserved: int  # reservations waiting for `add_prefilled_request`
    num_pages: int
    num_free_pages: int
    num_used_pages: int
    num_quarantined_pages: int
    num_preemptions: int
    num_cached_pages: int = 0  # prefix-cache pages (read by requests or evictable); counted in num_used_pages
    num_evictable_pages: int = 0  # of those, the ones no request reads: free for any allocation (vLLM counts them free)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's meaning)
    prefix_cache_hits: int = 0  # of those, tokens served from it
    prefix_cache_corrupt: int = 0  # cached pages whose digest no longer matched when reused (dropped, recomputed)


def resolve_kernels(config: EngineConfig) -> str:
    """ "torch" or "native" for this engine. Native kernels run on CPU float32 or bfloat16 weights and pools
    and need building (done here, once per machine): asked for by name they must, "auto" takes them where
    they can. The model then holds its weights as the native kernels' panels only (no second copy)."""
    from kvfence.models.native_kernels import NativeKernelsUnavailable, load

    asked = config.model.kernels
    if asked == "torch":
        return "torch"
    if torch.device(config.model.device).type != "cpu" or config.model.dtype not in ("float32", "bfloat16"):
        if asked == "auto":
            return "torch"
        raise ConfigError(
            f"--kernels native runs on the CPU in float32 or bfloat16; got device {config.model.device!r}, "
            f"dtype {config.model.dtype!r}"
        )
    try:
        load()
    except NativeKernelsUnavailable as e:
        if asked == "auto":
            logger.warning("native kernels unavailable, running the torch kernels: %s", e)
            return "torch"
        raise ConfigError(f"--kernels native: {e}") from e
    return "native"


class _OutputState:
    """Per-request output bookkeeping: tokens already sent, full text, text already sent."""

    __slots__ = ("num_sent", "detok", "text", "num_text_sent", "prompt_sent")

    def __init__(self, detok: StreamDecoder | None) -> None:
        self.num_sent = 0
        self.prompt_sent = False  # prompt logprobs go out once, with the first output
        self.detok = detok
        self.text = ""  # text so far (cut at a stop string once one is found)
        self.num_text_sent = 0


def _plain_greedy(req: Request) -> bool:
    """Greedy, and nothing to do in Python between its tokens: no logprobs, penalties or bias, stop strings,
    grammar, or prefill-only hand-off."""
    p = req.sampling_params
    return (
        p.greedy
        and not p.processes_logits
        and p.logprobs is None
        and p.prompt_logprobs is None
        and not p.stop
        and req.grammar is None
        and not req.prefill_only
    )


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: Any = None, progress: bool = False) -> None:
        """Load the model (or take an already `loaded` one), check capacity, build the pool and scheduler."""
        self.config = config
        # the imports' start-up code (torch's registrations) leaves the resident set before the weights and the
        # pool arrive, so that the build's peak does not hold it (models.startup_pages); again once built, below
        release_startup_pages()
        dtype = _DTYPES[config.model.dtype]
        kernels = resolve_kernels(config)
        if loaded is None:
            from kvfence.models.loader import load_model

            loaded = load_model(
                config.model.model_dir,
                dtype=dtype,
                device=config.model.device,
                progress=progress,
                panels=kernels == "native",  # the native copy made at load, the only one
            )
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        model_context = int(loaded.context_length)
        context_length = config.context_length or model_context
        if context_length > model_context:
            from kvfence.models.loader import context_length_source

            raise ConfigError(
                f"--context-length {context_length} exceeds the model's context length {model_context} "
                f"({context_length_source(loaded.hf_config)})"
            )
        page_size = config.cache.page_size
        num_pages = config.cache.num_pages_for(context_length)
        check_capacity(context_length, num_pages, page_size)
        check_scheduler_fits(context_length, config.scheduler)
        layout = loaded.kv_layout(page_size, dtype)
        self.pool = KVPool(layout, num_pages, device=config.model.device)
        self.allocator = PageAllocator(num_pages)
        self.resolved = ResolvedEngineConfig(
            context_length=context_length,
            page_size=page_size,
            num_pages=num_pages,
            layout_fingerprint=layout.fingerprint,
            bytes_per_page=layout.bytes_per_page,
            kernels=kernels,
        )
        eos = list(getattr(self.tokenizer, "eos_token_ids", []) or [])
        self.prefix_cache: PrefixCache | None = None
        if config.cache.enable_prefix_caching:
            pool, algorithm = self.pool, digest_algorithm_for(self.pool)
            self.prefix_cache = PrefixCache(
                self.allocator, page_size, lambda pages: page_digests(pool, pages, algorithm)
            )
        self.scheduler = Scheduler(
            config.scheduler, self.allocator, page_size, context_length, eos, prefix_cache=self.prefix_cache
        )
        self.runner = ModelRunner(
            loaded.model,
            self.pool,
            device=config.model.device,
            eos_token_ids=tuple(eos),
            kernels=kernels,
        )
        if hasattr(loaded.model, "use_native_kernels"):  # a model shared by engines follows the last one built
            was_native = getattr(loaded.model, "panels", False)
            loaded.model.use_native_kernels(kernels == "native")
            if was_native != (kernels == "native"):  # the weights changed layout: return what the old one held
                release_freed_heap()
        # a prefill's large activations are mapped on their own and returned when freed (models.heap)
        self.heap_bounds: HeapBounds | None = bound_step_heap()
        self.vocab_size = int(getattr(loaded.hf_config, "vocab_size", 0) or 0)
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first response_format request
        self._grammar_lock = threading.Lock()
        self._seed_rng = random.Random(config.seed)
        self._outputs: dict[str, _OutputState] = {}
        self._pending: list[Request] = []  # requests to report at the next step without a forward
        self._trim_thread: threading.Thread | None = None  # the idle heap trim in flight, if any
        self.num_multi_step_forwards = 0  # forwards that ran more than one decode step (_run_decode_steps)
        # the loader's code that ran once leaves the resident set; what runs again faults back from the page cache
        self.startup_pages_released_kib = release_startup_pages()

    # -- requests -------------------------------------------------------------
    def _tokenize(self, prompt: str | None, prompt_token_ids: Sequence[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt or prompt_token_ids", param="prompt")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = list(prompt_token_ids)  # type: ignore[arg-type]
        if not ids:
            raise InvalidRequestError("prompt is empty (0 tokens)", param="prompt")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (self.vocab_size and t >= self.vocab_size):
                raise InvalidRequestError(
                    f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})", param="prompt_token_ids"
                )
        return ids

    def _validate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, prefill_only: bool = False
    ) -> None:
        """Refuse what this engine can never serve. A `prefill_only` request (prefill of a disaggregated pair) holds
        its prompt and first token only: its max_tokens are decode's business, checked by decode and the router."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", param="sampling_params")
        n, ctx = len(prompt_ids), self.resolved.context_length
        if n > ctx:
            raise ContextLengthExceededError(
                f"prompt has {n} tokens but the context length is {ctx} tokens; shorten the prompt"
            )
        vocab = self.vocab_size
        for param, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = next((t for t in ids if vocab and t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param
                )
        pool_tokens = self.resolved.pool_tokens
        if prefill_only and n + 1 > pool_tokens:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + its first token do not fit in the KV pool of {pool_tokens} tokens",
                param="prompt",
            )
        if not prefill_only and n + params.max_tokens > pool_tokens:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} tokens "
                f"do not fit in the KV pool of {pool_tokens} tokens; lower max_tokens or raise --max-total-tokens",
                param="max_tokens",
            )

    def _make_request(
        self, request_id: str, ids: list[int], params: SamplingParams, prefill_only: bool = False
    ) -> Request:
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            generator = torch.Generator().manual_seed(seed)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler().grammar(params.structured_outputs)
        return Request(request_id, ids, params, prefill_only=prefill_only, generator=generator, grammar=grammar)

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of `response_format` grammars for this engine's tokenizer (made on first use)."""
        with self._grammar_lock:  # the server's front end and the step loop may both ask first: one compiler
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("response_format needs the model's tokenizer", param="response_format")
                from kvfence.engine.structured_output import GrammarCompiler

                eos: frozenset[int] = frozenset(getattr(self.tokenizer, "eos_token_ids", frozenset()))
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, eos)
            return self._grammar_compiler

    def _decoder(self, params: SamplingParams) -> StreamDecoder | None:
        return StreamDecoder(self.tokenizer) if params.detokenize and self.tokenizer is not None else None

    def _track(self, request: Request) -> None:
        self._outputs[request.request_id] = _OutputState(self._decoder(request.sampling_params))

    def first_token_text(self, token_id: int, params: SamplingParams) -> str | None:
        """The text a request's output starts with when `token_id` is its first token and does not end it
        (what `add_prefilled_request` then `report_pending` give, before stop strings); None when this engine
        has no tokenizer, "" when the request does not detokenize or the token is an incomplete character."""
        if self.tokenizer is None:
            return None
        detok = self._decoder(params)
        return detok.push(token_id) if detok is not None else ""

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        prefill_only: bool = False,
    ) -> None:
        """Queue a request; raises InvalidRequestError / ContextLengthExceededError on bad input.

        prefill_only: run the prompt, sample the first token, finish with "prefill_done"
        and keep the pages (under `request_id`) until `release(request_id)`.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        ids = self._tokenize(prompt, prompt_token_ids)
        self._validate(request_id, ids, params, prefill_only)
        req = self._make_request(request_id, ids, params, prefill_only)
        self.scheduler.add_request(req)
        self._track(req)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; its pages are freed. False if the id is unknown."""
        self._outputs.pop(request_id, None)
        self._pending = [r for r in self._pending if r.request_id != request_id]
        return self.scheduler.abort_request(request_id)

    # -- disaggregation hooks -------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Decode side, phase 1: set aside pages for `num_tokens` prompt tokens (the count the router gave).

        Returns the page ids (in logical order) for the sender to fill, or None when the
        pool cannot hold them now. Give them back with `release(request_id)` if the
        handoff fails, or hand them to `add_prefilled_request` once the KV is verified.
        """
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise InvalidRequestError(f"num_tokens must be a positive integer, got {num_tokens!r}", param="num_tokens")
        if num_tokens > self.resolved.context_length:
            raise ContextLengthExceededError(
                f"prompt has {num_tokens} tokens but the context length is {self.resolved.context_length} tokens"
            )
        return self.scheduler.reserve(request_id, num_tokens)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        sampling_params: SamplingParams,
        page_table: Sequence[int] | None = None,
        first_logprobs: TokenLogprobs | None = None,
    ) -> None:
        """Decode side, phase 2: admit a request whose prompt KV was written into its reserved pages.

        From here on it decodes exactly as if it had prefilled here: its next step()
        output starts with `first_token` (and `first_logprobs`, the scores prefill gave it,
        which a request that asked for logprobs must bring). `page_table`, when given, must
        equal the reserved pages (a cheap guard against mixing up requests).
        """
        ids = self._tokenize(None, prompt_token_ids)
        self._validate(request_id, ids, sampling_params)
        if not isinstance(first_token, int) or first_token < 0 or (self.vocab_size and first_token >= self.vocab_size):
            raise InvalidRequestError(f"first_token {first_token!r} is outside the vocabulary", param="first_token")
        if page_table is not None and list(page_table) != self.allocator.pages_of(request_id):
            raise InvalidRequestError(
                f"page_table of request {request_id!r} does not match the pages reserved for it", param="page_table"
            )
        if sampling_params.logprobs is not None and first_logprobs is None:
            raise InvalidRequestError("the request asks for logprobs but its first token has none", param="logprobs")
        req = self._make_request(request_id, ids, sampling_params)
        if req.grammar is not None and not req.grammar.accept(first_token):
            raise InvalidRequestError(f"first_token {first_token} does not follow the response_format grammar")
        if sampling_params.logprobs is not None:
            req.logprobs.append(first_logprobs)  # type: ignore[arg-type]
        self.scheduler.add_prefilled(req, first_token)
        self._track(req)
        self._pending.append(req)

    def release(self, request_id: str, quarantine: bool = False) -> list[int]:
        """Give back the pages of a prefill_done or reserved request; returns them ([] if none).

        quarantine=True moves them to quarantine instead (a transfer may still write);
        end it with `allocator.release_quarantine(request_id)`.
        """
        return self.scheduler.release(request_id, quarantine) or []

    def held_pages(self, request_id: str) -> list[int]:
        """Pages a prefill_done request keeps, in logical order ([] if it is not held)."""
        req = self.scheduler.held.get(request_id)
        return list(req.page_table) if req is not None else []

    # -- the loop -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; returns one output per request that changed."""
        report: list[Request] = self._pending
        self._pending = []
        sched = self.scheduler.schedule()
        if sched.chunks:
            steps = self._decode_steps(sched)
            if steps > 1:
                report += self._run_decode_steps(sched, steps)
            else:
                result = self.runner.execute(sched)
                self._keep_logprobs(sched, result)  # before the update: it may finish (and forget) requests
                changed = self.scheduler.update_from_output(sched, result.token_ids)
                for req in changed:
                    if req.grammar is not None and not req.grammar.accept(req.token_ids[-1]):
                        raise KvfenceError(f"request {req.request_id}: sampled a token its grammar does not allow")
                report += changed
            if not self.scheduler.has_unfinished():
                self._release_when_idle()
        return self._outputs_of(report)

    def _decode_steps(self, sched: SchedulerOutput) -> int:
        """How many decode steps this forward runs: more than one only for a decode batch of greedy requests that
        need nothing from Python between tokens (SchedulerConfig.max_decode_steps), as many as the requests' length
        limits, the time budget and the pool allow."""
        cfg = self.config.scheduler
        B = len(sched.chunks)
        if cfg.max_decode_steps <= 1 or not self.runner.can_run_steps(B):
            return 1
        steps = min(cfg.max_decode_steps, self.runner.steps_within(B, cfg.decode_steps_ms / 1e3))
        for c in sched.chunks:
            req = c.request
            if c.num_tokens != 1 or not c.sample or not _plain_greedy(req):
                return 1
            steps = min(steps, self.scheduler.steps_left(req))
        if steps <= 1 or not self.scheduler.grow_for_steps(sched, steps):
            return 1
        return steps

    def _run_decode_steps(self, sched: SchedulerOutput, steps: int) -> list[Request]:
        """Run up to `steps` decode steps of `sched` in one call and record each step's tokens as its own step
        would have; returns the requests that got tokens or finished."""
        stops = [self.scheduler.stop_tokens(c.request) for c in sched.chunks]
        changed: list[Request] = []
        ran = self.runner.execute_steps(sched, stops, steps)
        for i, tokens in enumerate(ran):
            changed += self.scheduler.update_from_output(self.scheduler.step_output(sched, i), list(tokens))
        self.num_multi_step_forwards += len(ran) > 1  # a stop token sampled at the first step ends the call there
        return changed

    def _release_when_idle(self) -> None:
        """After a forward that left nothing to run: hand the heap's free pages (the steps' activations, which
        glibc keeps once its mmap threshold has risen) back to the OS, on a thread of its own so that the last
        tokens do not wait for it (malloc_trim takes a few ms and releases the GIL). One at a time."""
        if self._trim_thread is not None and self._trim_thread.is_alive():
            return
        self._trim_thread = threading.Thread(target=release_freed_heap, name="kvfence-heap-trim", daemon=True)
        self._trim_thread.start()

    @staticmethod
    def _keep_logprobs(sched: SchedulerOutput, result: RunnerOutput) -> None:
        """Store each running request's new scores; an aborted one takes no token, hence no entry."""
        for chunk, entry, prompt in zip(sched.chunks, result.logprobs, result.prompt_logprobs, strict=True):
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue
            if prompt:
                assert req.prompt_logprobs is not None
                req.prompt_logprobs.extend(prompt)
            if entry is not None:
                req.logprobs.append(entry)

    def report_pending(self) -> list[RequestOutput]:
        """Outputs of requests that changed outside a forward (a prefilled request's first token), now,
        without running the model; `step` would otherwise report them after its next forward."""
        report, self._pending = self._pending, []
        return self._outputs_of(report)

    def _outputs_of(self, report: list[Request]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        seen: set[str] = set()
        for req in report:
            if req.request_id in seen or req.request_id not in self._outputs:
                continue
            seen.add(req.request_id)
            outputs.append(self._make_output(req))
        return outputs

    def _make_output(self, req: Request) -> RequestOutput:
        state = self._outputs[req.request_id]
        ids = req.token_ids
        new_ids = ids[req.num_prompt_tokens + state.num_sent :]
        new_logprobs = None
        if req.sampling_params.logprobs is not None:
            new_logprobs = req.logprobs[state.num_sent : state.num_sent + len(new_ids)]
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not state.prompt_sent:
            prompt_logprobs, state.prompt_sent = list(req.prompt_logprobs), True
        state.num_sent += len(new_ids)
        new_text = self._text_delta(req, state, new_ids) if state.detok is not None else ""
        finish_reason = req.finish_reason  # after _text_delta: a stop string may have finished it
        if finish_reason is not None:
            del self._outputs[req.request_id]
        return RequestOutput(
            req.request_id,
            new_ids,
            new_text,
            finish_reason is not None,
            finish_reason,
            req.num_prompt_tokens,
            len(ids) - req.num_prompt_tokens,
            req.stop_reason,
            new_logprobs,
            prompt_logprobs,
        )

    def _text_delta(self, req: Request, state: _OutputState, new_ids: list[int]) -> str:
        """Detokenize new ids, look for stop strings, and return the text that is safe to send."""
        assert state.detok is not None
        old_len = len(state.text)
        state.text += "".join([state.detok.push(t) for t in new_ids])
        if req.is_finished:
            state.text += state.detok.flush()
        stops = req.sampling_params.stop
        hold = 0
        # like vLLM, stop strings are looked for only once the output is longer than min_tokens
        if (
            stops
            and req.status is not RequestStatus.FINISHED_PREFILL_DONE
            and (req.num_output_tokens > req.sampling_params.min_tokens)
        ):
            longest = max(len(s) for s in stops)
            search_from = max(0, old_len - longest + 1)
            hits = [(i, s) for s in stops if (i := state.text.find(s, search_from)) >= 0]
            if hits:
                pos, stop = min(hits)
                state.text = state.text[:pos]
                if req.is_finished:  # also finished by a token rule at this very token: the string wins
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                else:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop)
            elif not req.is_finished:
                hold = longest - 1  # a stop string may be starting at the end: keep it back
        upto = max(state.num_text_sent, len(state.text) - hold)
        delta = state.text[state.num_text_sent : upto]
        state.num_text_sent = upto
        return delta

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run prompts (text, or token id lists) to completion; results in prompt order."""
        one = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch: list[str | Sequence[int]] = [cast("str | Sequence[int]", prompts)] if one else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(batch)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise InvalidRequestError(
                    f"{len(params_list)} sampling params for {len(batch)} prompts", param="sampling_params"
                )
        base = f"gen-{id(self):x}-{self._seed_rng.getrandbits(32):08x}"
        ids = [f"{base}-{i}" for i in range(len(batch))]
        results: dict[str, Completion] = {}
        try:
            for rid, prompt, params in zip(ids, batch, params_list, strict=True):
                prompt_ids = self._tokenize(prompt, None) if isinstance(prompt, str) else self._tokenize(None, prompt)
                self.add_request(rid, sampling_params=params, prompt_token_ids=prompt_ids)
                results[rid] = Completion(rid, prompt_ids, [], "", "")
            num_done = 0
            while num_done < len(ids):
                outs = self.step()
                if not outs and not self.scheduler.running and self.scheduler.waiting:
                    raise KvfenceError(
                        f"no request can be scheduled: {self.scheduler.num_free_pages} free pages, "
                        f"{len(self.scheduler.held)} held and {len(self.scheduler.reserved)} reserved requests"
                    )
                for o in outs:
                    c = results.get(o.request_id)
                    if c is None:
                        continue
                    c.token_ids += o.new_token_ids
                    c.text += o.new_text
                    if o.new_logprobs is not None:
                        c.logprobs = (c.logprobs or []) + o.new_logprobs
                    if o.prompt_logprobs is not None:
                        c.prompt_logprobs = o.prompt_logprobs
                    if o.finished:
                        c.finish_reason, c.stop_reason = o.finish_reason or "", o.stop_reason
                        num_done += 1
        except BaseException:
            for rid in ids:
                self.abort_request(rid)
            raise
        return [results[rid] for rid in ids]

    # -- numbers for metrics --------------------------------------------------
    def stats(self) -> EngineStats:
        a, s, pc = self.allocator, self.scheduler, self.prefix_cache
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_held=len(s.held),
            num_reserved=len(s.reserved),
            num_pages=a.num_pages,
            num_free_pages=a.num_free,
            num_used_pages=a.num_used,
            num_quarantined_pages=a.num_quarantined,
            num_preemptions=s.num_preemptions,
            num_cached_pages=pc.num_cached if pc is not None else 0,
            num_evictable_pages=pc.num_evictable if pc is not None else 0,
            prefix_cache_queries=pc.num_queries if pc is not None else 0,
            prefix_cache_hits=pc.num_hits if pc is not None else 0,
            prefix_cache_corrupt=pc.num_corrupt if pc is not None else 0,
        )
