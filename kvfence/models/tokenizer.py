"""The tokenizer of a local model directory: text <-> ids, chat templates, end-of-sequence ids.

What it knows: how to read a Hugging Face `tokenizer.json` (with the `tokenizers`
library), the special tokens and chat template from `tokenizer_config.json` (or
`chat_template.jinja` / `chat_template.json`), and the end-of-sequence ids from
`generation_config.json` (falling back to config.json, then the tokenizer's eos
token). It renders chat templates in a sandboxed Jinja environment with the
helpers templates commonly call (raise_exception, strftime_now, tojson).

What it does not know: models, sampling, or the network (nothing is downloaded).
Only tokenizer.json tokenizers are supported (no sentencepiece .model files).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kvfence.errors import InvalidRequestError, ModelLoadError


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """Special tokens are stored as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_set(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset([value])
    return frozenset(int(v) for v in value)


def read_eos_token_ids(model_dir: Path) -> frozenset[int]:
    """eos ids from generation_config.json, else config.json (empty when neither names any)."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            ids = _as_id_set(_read_json(path).get("eos_token_id"))
            if ids:
                return ids
    return frozenset()


def _read_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None and (model_dir / "chat_template.json").is_file():
        template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


class Tokenizer:
    """A model's tokenizer. encode/decode never add or need network access."""

    def __init__(
        self,
        backend: Any,
        *,
        chat_template: str | None,
        special_tokens: dict[str, str],
        eos_token_ids: frozenset[int],
        source: str = "<memory>",
    ) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)  # e.g. {"bos_token": "<|bos|>", "eos_token": ...}
        self.eos_token_ids = frozenset(eos_token_ids)
        self.source = source
        self._template: Any = None  # a jinja2 Template, compiled lazily

    @classmethod
    def from_dir(cls, model_dir: str | Path, eos_token_ids: frozenset[int] | None = None) -> Tokenizer:
        from tokenizers import Tokenizer as BackendTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"missing tokenizer: {path} not found (kvfence needs a tokenizer.json tokenizer)")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a plain Exception on malformed files
            raise ModelLoadError(f"cannot read tokenizer {path}: {e}") from e
        config_path = model_dir / "tokenizer_config.json"
        tokenizer_config = _read_json(config_path) if config_path.is_file() else {}
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(tokenizer_config.get(key))
            if text is not None:
                special[key] = text
        if eos_token_ids is None:
            eos_token_ids = read_eos_token_ids(model_dir)
        if not eos_token_ids and "eos_token" in special:
            eos_id = backend.token_to_id(special["eos_token"])
            eos_token_ids = frozenset([] if eos_id is None else [eos_id])
        return cls(
            backend,
            chat_template=_read_chat_template(model_dir, tokenizer_config),
            special_tokens=special,
            eos_token_ids=eos_token_ids,
            source=str(path),
        )

    # --- ids ---------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        text = self.special_tokens.get("bos_token")
        return None if text is None else self.backend.token_to_id(text)

    @property
    def pad_token_id(self) -> int | None:
        text = self.special_tokens.get("pad_token")
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`. add_special_tokens applies the tokenizer's own post-processor (e.g. a Llama 3
        BOS), as transformers does by default for a plain prompt; chat templates write their own."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat ----------------------------------------------------------------------------------------------

    def _compiled_template(self) -> Any:
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise InvalidRequestError(f"chat template error: {message}", param="messages")

            def tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
                return json.dumps(value, ensure_ascii=False, indent=indent, **kwargs)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            assert self.chat_template is not None, "render_chat refuses models without one"
            self._template = env.from_string(self.chat_template)
        return self._template

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text the model's chat template makes of `messages`."""
        if self.chat_template is None:
            raise InvalidRequestError(
                f"this model has no chat template ({self.source}); use a completion request instead", param="messages"
            )
        return self._compiled_template().render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra
        )

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes any BOS itself, so none is added)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra), add_special_tokens=False)


class StreamDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 sequences.

    Each `push(id)` returns the text that became final with that token (possibly "").
    Only a small window of recent ids is decoded per token, so the cost stays constant.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] give context for a clean boundary
        self.read_offset = 0  # ids before this are already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. a truncated multi-byte character) at the end of a stream."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]
