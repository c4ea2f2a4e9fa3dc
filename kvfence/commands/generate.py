"""`kvfence generate`: load a model, run one prompt, print the completion as it is produced.

What it knows: the flags of one offline generation (prompt, sampling, engine sizes),
that the completion goes to stdout (streamed) and everything else (loading progress,
a one-line summary) to stderr, and that bad input is a one-line error. What it does
not know: serving, routing or disaggregation.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvfence.config import add_engine_arguments, engine_config_from_args, resolve_model_dir
from kvfence.errors import InvalidRequestError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate a completion for one prompt (offline, no server)",
        description="Generate a completion for one prompt with the kvfence engine and print it. "
        "Without --model, the built-in tiny random model is used (created locally on first use; "
        "its output is gibberish, but deterministic).",
        epilog='example: kvfence generate --prompt "the cache page" --max-tokens 32 --temperature 0.8 --seed 1',
    )
    g = p.add_argument_group("prompt and sampling")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn with the chat template")
    g.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default: 64)")
    g.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default); higher is more random"
    )
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default: 1.0, off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest (default: 0, off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same output)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"kvfence: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sampling_params import SamplingParams

    if not args.prompt:
        raise InvalidRequestError("--prompt is empty", param="prompt")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    model_dir = resolve_model_dir(args.model, _log)
    config = engine_config_from_args(args, model_dir)
    engine = LLMEngine(config, progress=sys.stderr.isatty())
    if args.chat:
        prompt_ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        engine.add_request("cli-0", sampling_params=params, prompt_token_ids=prompt_ids)
    else:
        engine.add_request("cli-0", args.prompt, params)

    t0 = time.perf_counter()
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            last = out
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    if last is not None:
        _log(
            f"{last.num_prompt_tokens} prompt + {last.num_output_tokens} output tokens in {dt:.2f} s "
            f"({last.num_output_tokens / max(dt, 1e-9):.1f} tok/s), finish_reason={last.finish_reason}"
        )
    return 0
