"""POST /tokenize and /detokenize, as vLLM serves them.

What it knows: vLLM's request and response shapes (tokenize a `prompt`, or `messages` rendered by the chat
template with `add_generation_prompt` and `tools`; `add_special_tokens`, defaulting to true for a prompt and
false for messages, whose template writes its own; `return_token_strs` for the tokens' vocabulary strings;
the answer `{count, max_model_len, tokens, token_strs}`; detokenize `{tokens}` -> `{prompt}`, special tokens
kept), that `model` is optional but must be the served name when given, and that token ids outside the
vocabulary are a 400. Both work in every mode: they need only the front end's tokenizer and the engine's
capacity. What it does not know: generation.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from kvfence.server import openai_schema as p
from kvfence.server.context import ServerContext
from kvfence.server.http import ApiError, parse_body

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TokenizePromptRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    messages: Annotated[list[p.ChatMessage], Field(min_length=1, max_length=4096)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: Annotated[list[p.ToolDefinition], Field(max_length=p.MAX_TOOLS)] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: Annotated[list[p.TokenId], Field(max_length=1_000_000)]


class DetokenizeResponse(BaseModel):
    prompt: str


class Tokenization:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def _check_model(self, model: str | None) -> None:
        if model is not None:
            self.ctx.check_model(model)

    def _token_str(self, token_id: int) -> str:
        lookup = getattr(self.ctx.prompts.tokenizer, "id_to_token", None)
        text = lookup(token_id) if lookup is not None else None
        return text if text is not None else self.ctx.prompts.token_text(token_id)

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        if "messages" in body:
            chat: TokenizeChatRequest = parse_body(TokenizeChatRequest, body)
            self._check_model(chat.model)
            if chat.continue_final_message:
                raise ApiError(
                    400,
                    "continue_final_message: is not supported by kvfence",
                    param="continue_final_message",
                    code="unsupported_value",
                )
            tools = [t.model_dump(mode="json", exclude_none=True) for t in chat.tools] if chat.tools else None
            ids = await self.ctx.prompts.chat(chat.messages, tools, chat.add_generation_prompt, chat.add_special_tokens)
            token_strs = chat.return_token_strs
        else:
            req: TokenizePromptRequest = parse_body(TokenizePromptRequest, body)
            self._check_model(req.model)
            ids = await self.ctx.prompts.encode(req.prompt, req.add_special_tokens)
            token_strs = req.return_token_strs
        response = TokenizeResponse(
            count=len(ids),
            max_model_len=self.ctx.engine.capacity().context_length,
            tokens=ids,
            token_strs=[self._token_str(t) for t in ids] if token_strs else None,
        )
        return response.model_dump()

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        req: DetokenizeRequest = parse_body(DetokenizeRequest, body)
        self._check_model(req.model)
        self.ctx.prompts.check_token_ids(req.tokens, param="tokens")
        return DetokenizeResponse(
            prompt=self.ctx.prompts.decode(list(req.tokens), skip_special_tokens=False)
        ).model_dump()
