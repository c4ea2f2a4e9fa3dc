"""The top floor: what a person or a launcher runs. Nothing below imports from here.

What lives where:
- one module per `kvfence` subcommand (`serve`, `generate`, `bench`, `audit`, `probe`, `proxy`, `cluster-key`), each
  exposing `register(subparsers)`; `kvfence.cli` lists them;
- `args`: the flag tables of `kvfence serve` and of the worker processes, defined once, and the run-time values read
  from them (`flag_values`, `grammar_budget`);
- `worker_main`: the entry of one disaggregated process (`python -m kvfence.commands.worker_main --role ...`): it
  builds a router, a prefill or a decode worker from the flags and runs it.

Layers, bottom up (tests/test_import_cycles.py keeps every arrow pointing down): errors, roles, math_utils,
server_process, auth -> kv, integrity -> models -> engine, transfer -> disagg, server, integrations, audit, bench ->
commands, cli.
"""
