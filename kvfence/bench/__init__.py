"""Benchmarks behind `kvfence bench NAME`; each module here exposes `register(subparsers)`.

What it knows: the names of the benchmark modules, in the order `kvfence bench --help`
lists them. A module that is not there (yet) is skipped. What it does not know: what
any benchmark measures.

What lives where: the benchmarks (`offline`, `serve`, `soak`, `handoff`, `logscan`, `llama_cpp`); what they
share (`launch`: starting `kvfence serve`; `client`: one timed OpenAI request; `contention`: a competing CPU
load); the vLLM baseline of `offline` (`vllm_baseline`, and `vllm_worker`, the script vLLM's own python runs);
and measurements run with `python -m` (`kernels`, `grammar`, `mooncake_smoke`, and `handoff_e2e`, which `handoff`
also runs).
"""

BENCHMARKS: list[str] = ["offline", "serve", "soak", "handoff", "logscan", "llama_cpp"]
