"""Prompt normalisation: whatever form a request gives its prompt in, the token ids the engine runs.

What it knows: the tokenizer interface the front end needs (`Tokenizer`), tokenizing long texts off the event
loop, the four prompt forms of /v1/completions (a string, token ids, a batch of either), token ids outside the
vocabulary (400 before any worker sees them), and chat messages -> the dicts a Hugging Face chat template reads
(text parts joined; an assistant's `tool_calls` with their `arguments` parsed into objects and a tool result's
`tool_call_id`, as vLLM hands them to templates) -> the rendered ids, with `tools` passed to the template. A
template that refuses the messages is a 400 on `messages`.

What it does not know: sampling, admission, tool-call parsing of the output (tool_parsers.py) or which
endpoint asked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import anyio
from jinja2 import TemplateError

from kvfence.server import openai_schema as p
from kvfence.server.http import ApiError

ENCODE_IN_THREAD_CHARS = 16384  # tokenize longer texts off the event loop


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> Any: ...


class Prompt(NamedTuple):
    ids: list[int]
    text: str | None  # the text the ids came from (None: the request gave ids)


def template_message(m: p.ChatMessage) -> dict[str, Any]:
    """One chat message as templates read it: content as text; tool calls with their arguments as objects."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            try:
                arguments: Any = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments  # templates that print it get the text as sent
            calls.append(
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
            )
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


class Prompts:
    """The prompt side of one served model: its tokenizer and vocabulary size."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > ENCODE_IN_THREAD_CHARS:
            return list(await anyio.to_thread.run_sync(lambda: self.tokenizer.encode(text, add_special_tokens)))
        return list(self.tokenizer.encode(text, add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens kept (how logprobs and /tokenize name tokens)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_token_ids(self, ids: Sequence[int], param: str = "prompt") -> None:
        vocab = self.vocab_size
        if vocab:
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ApiError(
                    400,
                    f"{param}: token id {bad} is outside the vocabulary [0, {vocab})",
                    param=param,
                    code="invalid_value",
                )

    async def completion_prompts(self, prompt: p.CompletionPrompt) -> list[Prompt]:
        """The prompts of a /v1/completions body, each as ids (checked against the vocabulary) and text."""
        if isinstance(prompt, str):
            prompts = [Prompt(await self.encode(prompt), prompt)]
        elif isinstance(prompt[0], int):
            prompts = [Prompt([int(t) for t in prompt], None)]  # type: ignore[arg-type]
        elif isinstance(prompt[0], str):
            prompts = [Prompt(await self.encode(text), text) for text in prompt]  # type: ignore[arg-type]
        else:
            prompts = [Prompt(list(ids), None) for ids in prompt]  # type: ignore[union-attr]
        for one in prompts:
            self.check_token_ids(one.ids)
        return prompts

    async def chat(
        self,
        messages: Sequence[p.ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The ids of `messages` rendered by the chat template (with `tools` when given); the template writes
        its own special tokens, so the tokenizer adds none unless asked."""
        rendered_messages = [template_message(m) for m in messages]
        extra: dict[str, Any] = {} if tools is None else {"tools": tools}
        try:
            rendered = await anyio.to_thread.run_sync(
                lambda: self.tokenizer.apply_chat_template(
                    rendered_messages, add_generation_prompt=add_generation_prompt, **extra
                )
            )
        except (ValueError, TypeError, KeyError, IndexError, TemplateError) as e:
            raise ApiError(400, f"messages: the chat template refused them: {e}", param="messages") from None
        if isinstance(rendered, str):
            return await self.encode(rendered, add_special_tokens=add_special_tokens)
        return list(rendered)
