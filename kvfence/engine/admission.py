"""Admission control: what may enter the system, decided before any worker sees it.

What it knows: two kinds of check. Per request (at the front end, the router in PD
mode): prompt + max_tokens must fit the context length, the prefill role's KV pool
must hold the prompt and every other role's pool must hold prompt + max_tokens;
otherwise the request is refused with `ContextLengthExceededError` naming the numbers.
A refusal is an error, never a shortened or substitute prompt. At start-up: a role
whose context length exceeds its KV pool refuses to start (unless the operator
explicitly allows it, which turns the pool size into a hard per-request limit).
Whether a prefill and a decode worker may be paired is not admission: the router checks
it when a worker registers (`disagg.registration.check_pair`, `disagg.workers.check_match`).

What it does not know: tokenization, HTTP, or how pools are allocated at run time
(a request that fits the pool may still wait for pages; that is the scheduler's job).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvfence.config import check_capacity
from kvfence.engine.engine_client import Capacity
from kvfence.errors import CapacityConfigError, ContextLengthExceededError, InvalidRequestError
from kvfence.roles import PREFILL

logger = logging.getLogger(__name__)


def _refuse(message: str, param: str) -> ContextLengthExceededError:
    err = ContextLengthExceededError(message)
    err.param = param
    return err


def admit(num_prompt_tokens: int, max_tokens: int | None, capacity: Capacity, param: str = "prompt") -> int:
    """Check one request against the limits; return the max_tokens it will run with.

    `max_tokens=None` means "as many as fit": the context length (and every decoding
    pool) minus the prompt. Raises `ContextLengthExceededError` (HTTP 400) when the
    request can never be served, `InvalidRequestError` for an empty prompt.
    """
    if num_prompt_tokens <= 0:
        raise InvalidRequestError("the prompt is empty (0 tokens); send at least one token", param=param)
    if max_tokens is not None and max_tokens <= 0:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")

    # limits on prompt + output: the context length and every pool that holds the output
    output_limits: list[tuple[int, str]] = [(capacity.context_length, "the context length")]
    for role, pool_tokens in capacity.max_total_tokens.items():
        if role == PREFILL:  # holds only the prompt's KV; every other role holds prompt + output
            if num_prompt_tokens > pool_tokens:
                raise _refuse(
                    f"The prompt has {num_prompt_tokens} tokens, more than the {role} KV pool holds "
                    f"({pool_tokens} tokens); it can never be prefilled. Use a shorter prompt.",
                    param,
                )
        else:
            output_limits.append((pool_tokens, f"the {role} KV pool"))

    if max_tokens is None:
        limit, what = min(output_limits)
        if num_prompt_tokens >= limit:
            raise _refuse(
                f"The prompt has {num_prompt_tokens} tokens, which leaves no room for output within "
                f"{what} ({limit} tokens). Use a shorter prompt.",
                param,
            )
        return limit - num_prompt_tokens

    need = num_prompt_tokens + max_tokens
    for limit, what in sorted(output_limits):
        if need > limit:
            raise _refuse(
                f"This request needs {need} tokens ({num_prompt_tokens} in the prompt + {max_tokens} max_tokens), "
                f"more than {what} ({limit} tokens). Use a shorter prompt or a smaller max_tokens.",
                param,
            )
    return max_tokens


# ---- start-up -----------------------------------------------------------------------------------------------------


def role_capacity(
    role: str, context_length: int, num_pages: int, page_size: int, allow_context_above_pool: bool = False
) -> int:
    """Validate one role's context length against its pool; return its pool size in tokens.

    Refuses (CapacityConfigError naming both numbers and the flags) when one full
    context cannot fit, unless `allow_context_above_pool`: then it logs a loud warning
    and the pool size becomes the role's hard per-request limit (through Capacity).
    """
    pool_tokens = num_pages * page_size
    try:
        check_capacity(context_length, num_pages, page_size, role=role)
    except CapacityConfigError as e:
        if not allow_context_above_pool:
            raise CapacityConfigError(f"{e} (or pass --allow-context-above-pool to cap requests at the pool)") from None
        logger.warning(
            "%s: --allow-context-above-pool: context length %d tokens exceeds the KV pool of %d tokens; "
            "requests needing more than %d tokens (prompt + max_tokens) will be refused with HTTP 400",
            role,
            context_length,
            pool_tokens,
            pool_tokens,
        )
    return pool_tokens


def build_capacity(
    context_length: int,
    pools: Mapping[str, tuple[int, int]],
    allow_context_above_pool: bool = False,
) -> Capacity:
    """Capacity for the front end from each role's (num_pages, page_size), validated per role."""
    if not pools:
        raise CapacityConfigError("no KV pool to serve from: at least one role is needed")
    page_sizes = {page_size for _, page_size in pools.values()}
    if len(page_sizes) != 1:
        raise CapacityConfigError(f"roles disagree on --page-size: {dict(pools)}")
    totals = {
        role: role_capacity(role, context_length, num_pages, page_size, allow_context_above_pool)
        for role, (num_pages, page_size) in pools.items()
    }
    return Capacity(context_length=context_length, max_total_tokens=totals, page_size=page_sizes.pop())
