"""Benchmarks behind `kvfence bench NAME`; each module here exposes `register(subparsers)`.

What it knows: the names of the benchmark modules, in the order `kvfence bench --help`
lists them. A module that is not there (yet) is skipped. What it does not know: what
any benchmark measures.
"""

BENCHMARKS: list[str] = ["offline", "serve", "soak", "handoff", "logscan", "llama_cpp"]
