"""The engine of one serving role (aggregated, prefill or decode), built from the parsed flags.

What it knows: loading the model the flags name, with the tokenizer they name (--tokenizer,
--chat-template), and the start-up capacity rule every role obeys: a context length the
role's KV pool cannot hold refuses to start, naming both numbers and the flags, unless
--allow-context-above-pool turns the pool into a hard per-request limit. What it does not
know: what the role does with its engine, or HTTP.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, NamedTuple

from kvfence.config import engine_config_from_args
from kvfence.errors import KvfenceError
from kvfence.models.tokenizer import Tokenizer, read_eos_token_ids
from kvfence.roles import DECODE, WORKER_ROLES


def chat_template_from(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself (it holds Jinja tags); checked for syntax."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        template = value
    else:
        path = Path(value)
        if not path.is_file():
            raise KvfenceError(f"--chat-template: {value} is not a file (nor a template: it has no {{{{ or {{% tag)")
        template = path.read_text(encoding="utf-8")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError as e:
        raise KvfenceError(f"--chat-template: not a valid Jinja template: {e}") from None
    return template


def load_tokenizer(args: argparse.Namespace, model_dir: str) -> Tokenizer:
    """The tokenizer the server uses: --tokenizer's directory or the model's, the model's eos ids, and
    --chat-template's template when given."""
    eos = read_eos_token_ids(Path(model_dir))
    tokenizer = Tokenizer.from_dir(getattr(args, "tokenizer", None) or model_dir, eos_token_ids=eos or None)
    template = chat_template_from(getattr(args, "chat_template", None))
    if template is None:
        return tokenizer
    return Tokenizer(
        tokenizer.backend,
        chat_template=template,
        special_tokens=tokenizer.special_tokens,
        eos_token_ids=tokenizer.eos_token_ids,
        source=tokenizer.source,
    )


class RoleEngine(NamedTuple):
    """A role's engine after the start-up capacity check, and the numbers the check found."""

    engine: Any  # kvfence.engine.llm_engine.LLMEngine
    context_length: int  # the deployment's context length (flag or model), which may exceed the pool
    pool_tokens: int


def build_role_engine(args: argparse.Namespace, model_dir: str, role: str) -> RoleEngine:
    """The engine of one role (aggregated, prefill or decode), with the same start-up rule for every role.

    A context length the role's KV pool cannot hold refuses to start, naming both numbers and the flags.
    With --allow-context-above-pool the role starts with a warning and its engine runs with the pool as
    its context length; the front end (the API, or the router in PD mode) refuses anything above the
    pool with HTTP 400 naming it, before any engine sees the request.
    """
    import torch

    from kvfence.engine.admission import role_capacity
    from kvfence.engine.llm_engine import LLMEngine, resolve_kernels
    from kvfence.models.loader import load_model

    config = engine_config_from_args(args, model_dir, seed=args.seed)
    if role == DECODE:  # its prompts' KV arrives by handoff, never from a cache of its own (started by hand too)
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False))
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[config.model.dtype]
    native = resolve_kernels(config) == "native"  # then the model holds the native panels only, from load
    shared = None
    if role in WORKER_ROLES:  # a host's workers map one file of panels: one copy of the weights between them
        from kvfence.models.default import cache_dir

        shared = cache_dir() / "panels"
    loaded = load_model(
        model_dir,
        dtype=dtype,
        device=config.model.device,
        progress=sys.stderr.isatty(),
        panels=native,
        shared_panels_dir=shared,
    )
    if getattr(args, "tokenizer", None) or getattr(args, "chat_template", None):
        tokenizer = load_tokenizer(args, model_dir)
        if tokenizer.vocab_size > int(loaded.hf_config.vocab_size):
            raise KvfenceError(
                f"--tokenizer: {tokenizer.source} has {tokenizer.vocab_size} tokens, more than the model's vocabulary "
                f"({loaded.hf_config.vocab_size})"
            )
        loaded = dataclasses.replace(loaded, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids)
    context_length = config.context_length or int(loaded.context_length)
    page_size = config.cache.page_size
    num_pages = config.cache.num_pages_for(context_length)
    pool_tokens = role_capacity(role, context_length, num_pages, page_size, args.allow_context_above_pool)
    config = dataclasses.replace(config, context_length=min(context_length, pool_tokens))
    return RoleEngine(LLMEngine(config, loaded=loaded), context_length, pool_tokens)
