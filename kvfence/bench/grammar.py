"""`python -m kvfence.bench.grammar`: the grammar engines kvfence could use for response_format, on our tokenizer.

What it knows: how to drive xgrammar, llguidance and outlines-core through the same
loop on one model's tokenizer and one bounded JSON schema: compile the schema (caches
off, median of several compiles), then per generated token fill the next-token bitmask,
apply it to a float32 logits row and accept the token argmax picks from random logits
(the same logits for every engine), until the grammar is complete. It prints compile
time, per-token time, tokens generated, whether each engine can express OpenAI's
`json_object` (any JSON object), and — the baseline, measured in the same run — the
engine's decode step (batch 1) on that model, so the per-token cost reads as a ratio.

What it does not know: the engine's sampler; `structured_output.py` uses the winner.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    },
    "required": ["id", "name", "ok", "color", "tags"],
    "additionalProperties": False,
}


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (printable Latin-1 stays itself)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class _Engine:
    """One grammar engine: `compile()` a fresh matcher, then `step(logits)` -> (token, finished)."""

    name = ""

    def __init__(self, hf: Any, vocab: int, eos: list[int], schema: str) -> None:
        raise NotImplementedError

    def compile(self) -> None:
        raise NotImplementedError

    def step(self, logits: torch.Tensor) -> tuple[int, bool]:
        raise NotImplementedError

    @staticmethod
    def json_object() -> bool:
        """Whether the engine takes a bare `{"type": "object"}` (what `response_format: json_object` asks)."""
        raise NotImplementedError


class _XGrammar(_Engine):
    name = "xgrammar"

    def __init__(self, hf: Any, vocab: int, eos: list[int], schema: str) -> None:
        import xgrammar as xgr

        self.xgr, self.schema = xgr, schema
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self) -> None:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.matcher = self.xgr.GrammarMatcher(compiler.compile_json_schema(self.schema, any_whitespace=False))

    def step(self, logits: torch.Tensor) -> tuple[int, bool]:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(logits, self.bitmask)
        tok = int(logits.argmax())
        assert self.matcher.accept_token(tok)
        return tok, self.matcher.is_terminated()

    @staticmethod
    def json_object() -> bool:
        return True  # compile_json_schema('{"type": "object"}', strict_mode=False)


class _LLGuidance(_Engine):
    name = "llguidance"

    def __init__(self, hf: Any, vocab: int, eos: list[int], schema: str) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt, self.schema = llguidance, llguidance.torch, schema
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos[0])
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        import xgrammar

        self.apply = xgrammar.apply_token_bitmask_inplace  # the same bitmask layout; its CPU kernel is faster

    def compile(self) -> None:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(self.schema, defaults={"whitespace_flexible": False})
        self.matcher = self.ll.LLMatcher(self.tokenizer, grammar)

    def step(self, logits: torch.Tensor) -> tuple[int, bool]:
        self.llt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        self.apply(logits, self.bitmask)
        tok = int(logits.argmax())
        assert self.matcher.consume_token(tok)
        return tok, self.matcher.is_stopped()

    @staticmethod
    def json_object() -> bool:
        return True  # a JSON schema {"type": "object"} or a Lark grammar


class _OutlinesCore(_Engine):
    name = "outlines-core"

    def __init__(self, hf: Any, vocab: int, eos: list[int], schema: str) -> None:
        from outlines_core import Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        special = set(hf.all_special_ids) | set(eos)
        to_byte = _byte_of_char()
        tokens: dict[bytes, list[int]] = {}
        for text, i in hf.get_vocab().items():
            if i in special or i >= vocab or any(c not in to_byte for c in text):
                continue
            tokens.setdefault(bytes(to_byte[c] for c in text), []).append(i)
        self.vocabulary = Vocabulary(eos[0], tokens)
        self.regex = build_regex_from_schema(schema, r"")
        self.vocab, self.eos = vocab, eos[0]

    def compile(self) -> None:
        from outlines_core import Guide, Index

        self.guide = Guide(Index(self.regex, self.vocabulary))

    def step(self, logits: torch.Tensor) -> tuple[int, bool]:
        mask = torch.full((1, self.vocab), float("-inf"))
        mask[0, torch.tensor(self.guide.get_tokens())] = 0.0
        logits += mask
        tok = int(logits.argmax())
        self.guide.advance(tok)
        return tok, tok == self.eos or self.guide.is_finished()

    @staticmethod
    def json_object() -> bool:
        return False  # a regex cannot describe arbitrarily nested JSON


def _decode_step_ms(model_dir: str, steps: int) -> float:
    """The baseline: one batch-1 decode step of kvfence's engine on this model (median over `steps`)."""
    from kvfence.config import CacheConfig, EngineConfig, ModelConfig
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(ModelConfig(model_dir), CacheConfig(max_total_tokens=4096)))
    engine.add_request(
        "b",
        sampling_params=SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True),
        prompt_token_ids=[5, 6, 7, 8],
    )
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _run(engine: _Engine, vocab: int, seeds: int, compiles: int) -> tuple[float, float, int]:
    """(compile ms median, per-token us median over all tokens, tokens per seed mean)."""
    compile_s = []
    for _ in range(compiles):
        t0 = time.perf_counter()
        engine.compile()
        compile_s.append(time.perf_counter() - t0)
    per_token, counts = [], []
    for seed in range(seeds):
        engine.compile()
        g = torch.Generator().manual_seed(seed)
        done, n = False, 0
        while not done and n < 400:
            logits = torch.randn(1, vocab, generator=g)
            t0 = time.perf_counter()
            _, done = engine.step(logits)
            per_token.append(time.perf_counter() - t0)
            n += 1
        counts.append(n)
    return statistics.median(compile_s) * 1e3, statistics.median(per_token) * 1e6, round(statistics.mean(counts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfence.bench.grammar", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the built-in default model)")
    p.add_argument("--seeds", type=int, default=20, help="generations per engine (default 20)")
    p.add_argument("--compiles", type=int, default=5, help="timed compiles per engine (default 5)")
    p.add_argument("--decode-steps", type=int, default=64, help="baseline decode steps (default 64)")
    args = p.parse_args(argv)
    import transformers

    from kvfence.config import resolve_model_dir
    from kvfence.models.tokenizer import Tokenizer

    model_dir = resolve_model_dir(args.model)
    tok = Tokenizer.from_dir(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    vocab = int(json.load(open(f"{model_dir}/config.json"))["vocab_size"])
    eos = sorted(tok.eos_token_ids)
    schema = json.dumps(SCHEMA)
    step_ms = _decode_step_ms(model_dir, args.decode_steps)
    print(f"model {model_dir}: vocab {vocab}, decode step (batch 1, the baseline) {step_ms:.2f} ms")
    print(f"{'engine':<14} {'compile ms':>10} {'per token us':>12} {'tokens':>6} {'vs decode step':>14}  json_object")
    engines: list[type[_Engine]] = [_XGrammar, _LLGuidance, _OutlinesCore]
    for make in engines:
        try:
            engine = make(hf, vocab, eos, schema)
        except ImportError as e:
            print(f"{make.name:<14} not installed ({e.name})")
            continue
        compile_ms, token_us, tokens = _run(engine, vocab, args.seeds, args.compiles)
        ratio = token_us / 1e3 / step_ms
        print(f"{make.name:<14} {compile_ms:>10.2f} {token_us:>12.1f} {tokens:>6} {ratio:>13.1%}  {make.json_object()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
