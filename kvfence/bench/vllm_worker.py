"""The vLLM side of `kvfence bench offline --baselines vllm`: a script run by vLLM's own python, not imported.

What it knows: how to load one vLLM `LLM` (CPU, the given dtype, eager) on a model directory, then answer
requests read as JSON lines on stdin -- {"prompts": [[token ids]...], "output_len": N} -- by timing one
`LLM.generate` of those token-id prompts (greedy, ignore_eos, exactly N tokens each) and writing one JSON line
{"seconds": s, "outputs": [[token ids]...]} on stdout, marked with a "KVFENCE-VLLM " prefix so vLLM's own
chatter on stdout is skipped. The process stays up between requests, so interleaved rounds pay vLLM's start
(minutes on a first run: it compiles) once. It imports only the standard library and vLLM: kvfence's venv and
vLLM's conflict, so nothing of kvfence is imported here.

What it does not know: kvfence, or anything about the other systems of the run.
"""

from __future__ import annotations

import json
import sys
import time

MARK = "KVFENCE-VLLM "


def main() -> int:
    spec = json.loads(sys.argv[1])  # {"model", "dtype", "max_model_len", "max_num_seqs", "enable_prefix_caching"}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=spec["enable_prefix_caching"],
        enforce_eager=False,
        seed=0,
    )
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=req["output_len"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        print(MARK + json.dumps({"seconds": dt, "outputs": tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
