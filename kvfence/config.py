"""Start-up configuration, layered by process, and the checks that run before serving.

What it knows: the frozen settings a user chooses (model directory and dtype, KV page
size and pool size, scheduler budgets, context length override, seed), their
validation, and the capacity rule every role obeys at start: the KV pool must hold
at least one full context (tokens = pages x page size >= context length). Values
found at run time (the model's own context length, the number of pages actually
made) live in `ResolvedEngineConfig`, never written back into a config.

What it does not know: how a model is loaded or how many bytes a page takes (the
engine resolves those), nor anything about HTTP, routing or transfers.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfence.errors import CapacityConfigError, KvfenceError
from kvfence.math_utils import cdiv

_DTYPES = ("float32", "float16", "bfloat16")
KERNEL_BACKENDS = ("auto", "torch", "native")
# How long the first use of the native kernels takes to build them; the README, --help and the build's log line say
# this same text
DEFAULT_MIN_POOL_TOKENS = 16384  # pool size when --max-total-tokens is not given (at least one context)


class ConfigError(KvfenceError):
    """A setting that can never work (negative sizes, unknown dtype, ...)."""


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model_dir: str
    dtype: str = "float32"  # weights and KV pool dtype
    device: str = "cpu"
    # "torch": torch ops only; "native": C++ kernels (models.native_kernels; built on first use, CPU float32
    # or bfloat16) for decode attention (reads the paged pool in place) and RMSNorm, and for Llama-family
    # models the whole decode step of a small batch in one call, the weights held once as their panels;
    # "auto": native where they apply and build (a CPU float32 or bfloat16 engine on a machine with a C++
    # compiler), else torch. The engine's choice is in its `resolved`.
    kernels: str = "auto"

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ConfigError("model_dir must be a non-empty path")
        if self.kernels not in KERNEL_BACKENDS:
            raise ConfigError(f"kernels must be one of {', '.join(KERNEL_BACKENDS)}, got {self.kernels!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16  # tokens per KV page
    max_total_tokens: int | None = None  # KV pool capacity in tokens; None -> max(context length, 16384)
    # reuse full KV pages of shared prefixes (per cache_salt, digest-checked), as vLLM and SGLang do by default
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _positive("page_size (--page-size)", self.page_size)
        _positive("max_total_tokens (--max-total-tokens)", self.max_total_tokens, allow_none=True)

    def num_pages_for(self, context_length: int) -> int:
        """Pages in the pool: max_total_tokens rounded up to whole pages."""
        tokens = self.max_total_tokens
        if tokens is None:
            tokens = max(context_length, DEFAULT_MIN_POOL_TOKENS)
        return cdiv(tokens, self.page_size)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 2048  # tokens per forward: decode tokens + prefill chunks
    chunked_prefill_size: int | None = 512  # longest prefill chunk; None -> a prompt is prefilled in one piece
    # A decode batch of greedy requests that need nothing per token from Python (no logprobs, stop strings,
    # penalties, grammar) may run up to this many steps in one native call (kernels "native", Llama family),
    # tokens then reaching the engine's output together; 1 turns it off. The steps of one call are held to
    # about decode_steps_ms of model time (measured on the batch size's previous steps), so a request that
    # arrives meanwhile waits at most about that long for its prefill.
    max_decode_steps: int = 8
    decode_steps_ms: float = 4.0

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("chunked_prefill_size (--chunked-prefill-size)", self.chunked_prefill_size, allow_none=True)
        _positive("max_decode_steps (--max-decode-steps)", self.max_decode_steps)
        if not isinstance(self.decode_steps_ms, (int, float)) or not self.decode_steps_ms > 0:
            raise ConfigError(
                f"decode_steps_ms (--decode-steps-ms) must be a positive number, got {self.decode_steps_ms!r}"
            )

    @property
    def chunk_limit(self) -> int:
        """Most prompt tokens one request may prefill in one step."""
        if self.chunked_prefill_size is None:
            return self.max_num_batched_tokens
        return min(self.chunked_prefill_size, self.max_num_batched_tokens)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    context_length: int | None = None  # override of the model's own (config.json) context length
    seed: int | None = 0  # seeds requests that give no seed of their own; None: random per engine start

    def __post_init__(self) -> None:
        _positive("context_length (--context-length)", self.context_length, allow_none=True)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")


@dataclass(frozen=True)
class ResolvedEngineConfig:
    """What the engine found at start: the numbers it actually runs with."""

    context_length: int
    page_size: int
    num_pages: int
    layout_fingerprint: str
    bytes_per_page: int
    kernels: str = "torch"  # "torch" or "native": what ModelConfig.kernels came to on this machine

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size


def check_capacity(context_length: int, num_pages: int, page_size: int, role: str = "engine") -> None:
    """Refuse to start when one full context cannot fit in the KV pool."""
    capacity = num_pages * page_size
    if context_length > capacity:
        raise CapacityConfigError(
            f"{role}: context length {context_length} tokens does not fit in the KV pool of {capacity} tokens "
            f"({num_pages} pages x {page_size}); raise --max-total-tokens to at least {context_length} "
            f"or lower --context-length to at most {capacity}"
        )


def check_scheduler_fits(context_length: int, scheduler: SchedulerConfig) -> None:
    """Without chunked prefill a whole prompt must fit in one step's token budget."""
    if scheduler.chunked_prefill_size is None and scheduler.max_num_batched_tokens < context_length:
        raise CapacityConfigError(
            f"with chunked prefill off, max_num_batched_tokens {scheduler.max_num_batched_tokens} must be at least "
            f"the context length {context_length}; set --chunked-prefill-size or lower --context-length"
        )


# --- command-line flags shared by every command that builds an engine ---------------------------------


def add_engine_arguments(parser: Any) -> None:
    """Add --model, --dtype, --page-size, --max-total-tokens, ... to an argparse parser.

    Each default is the config dataclass's own (stated once, there)."""
    from kvfence.models.native_build import NATIVE_BUILD_ESTIMATE

    g = parser.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        "--model-path",
        dest="model",
        metavar="DIR",
        default=None,
        help="local Hugging Face model directory (default: the built-in tiny model, created on first use); models "
        "load only from local directories, never from the hub",
    )
    g.add_argument("--dtype", default=ModelConfig.dtype, choices=list(_DTYPES), help="weights and KV cache dtype")
    g.add_argument("--device", default=ModelConfig.device, help=f"torch device (default: {ModelConfig.device})")
    g.add_argument(
        "--kernels",
        default=ModelConfig.kernels,
        choices=list(KERNEL_BACKENDS),
        help="torch ops, or C++ kernels (decode attention over the paged pool, RMSNorm, and a Llama-family "
        f"decode step in one call; built on first use, {NATIVE_BUILD_ESTIMATE}, then cached; CPU float32 or "
        "bfloat16); auto: "
        f"native where they apply and build, else torch (default: {ModelConfig.kernels})",
    )
    g.add_argument(
        "--page-size",
        type=int,
        default=CacheConfig.page_size,
        metavar="N",
        help=f"tokens per KV page (default: {CacheConfig.page_size})",
    )
    g.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"KV pool capacity in tokens (default: max(context length, {DEFAULT_MIN_POOL_TOKENS}))",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=CacheConfig.enable_prefix_caching,
        help="reuse the KV of full pages of a prompt prefix computed before, per tenant cache_salt, each page "
        "digest-checked when reused (default here: %(default)s; docs/prefix_cache.md)",
    )
    g.add_argument(
        "--context-length",
        "--max-model-len",
        dest="context_length",
        type=int,
        default=None,
        metavar="N",
        help="serve at most N tokens per request, prompt + output (default: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=SchedulerConfig.chunked_prefill_size,
        metavar="N",
        help=f"longest prefill chunk in tokens; 0 turns chunking off (default: {SchedulerConfig.chunked_prefill_size})",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        metavar="N",
        help=f"requests per step (default: {SchedulerConfig.max_num_seqs})",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        metavar="N",
        help=f"tokens per step (default: {SchedulerConfig.max_num_batched_tokens})",
    )
    g.add_argument(
        "--max-decode-steps",
        type=int,
        default=SchedulerConfig.max_decode_steps,
        metavar="N",
        help="greedy decode steps one native call may run for a batch that needs nothing per token from Python "
        f"(no logprobs, stop strings, penalties or response_format); 1: one step per call (default: "
        f"{SchedulerConfig.max_decode_steps})",
    )
    g.add_argument(
        "--decode-steps-ms",
        type=float,
        default=SchedulerConfig.decode_steps_ms,
        metavar="MS",
        help="model time one such call may take, from the batch size's previous steps: the longest a new "
        f"request waits for it (default: {SchedulerConfig.decode_steps_ms})",
    )


def engine_config_from_args(args: Any, model_dir: str, seed: int | None = 0) -> EngineConfig:
    """An EngineConfig from the flags of `add_engine_arguments` (model_dir already resolved)."""
    chunk = args.chunked_prefill_size
    return EngineConfig(
        model=ModelConfig(
            model_dir=model_dir,
            dtype=args.dtype,
            device=args.device,
            kernels=getattr(args, "kernels", ModelConfig.kernels),
        ),
        cache=CacheConfig(
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            enable_prefix_caching=bool(getattr(args, "enable_prefix_caching", CacheConfig.enable_prefix_caching)),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            chunked_prefill_size=None if chunk == 0 else chunk,
            max_decode_steps=getattr(args, "max_decode_steps", SchedulerConfig.max_decode_steps),
            decode_steps_ms=getattr(args, "decode_steps_ms", SchedulerConfig.decode_steps_ms),
        ),
        context_length=args.context_length,
        seed=seed,
    )


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")  # org/name, as the hub spells them


def resolve_model_dir(model: str | None, log: Any = None) -> str:
    """--model, or the built-in default model (built on first use, which `log` is told about).

    A --model that is not a path but names a preset of kvfence.models.default (e.g.
    kvfence-llama-100m) is that preset, built in the cache on first use.
    """
    from kvfence.models.default import PRESETS, cache_dir, default_model_dir, ensure_default_model, ensure_preset_model

    if model is not None:
        if model in PRESETS and not Path(model).exists():
            if log is not None and not (cache_dir() / "models" / model / "config.json").is_file():
                log(f"building model preset {model} in {cache_dir() / 'models' / model} (first use only)")
            return str(ensure_preset_model(model))
        if not Path(model).exists() and _HUB_ID.fullmatch(model):
            local = f"/models/{model.split('/')[1]}"
            raise ConfigError(
                f"{model} is not a local directory; it looks like a Hugging Face hub id, and kvfence loads models only "
                f"from local directories (it never downloads). On a machine with network access run "
                f"`hf download {model} --local-dir {local}` (or `huggingface-cli download ...`), make that directory "
                f"available here, and pass it: kvfence serve {local}"
            )
        return model

    if log is not None and not (default_model_dir() / "config.json").is_file():
        log(f"building the built-in default model in {default_model_dir()} (first use only)")
    return str(ensure_default_model())
