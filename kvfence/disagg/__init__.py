"""Disaggregated prefill/decode: the router, the prefill and decode workers, and the handoff between them.

What lives where:
- `messages`: the control plane (router <-> workers): four per-request messages (`Order`, `Tokens`, `RequestFailed`,
  `Abort`) and the worker-level ones, typed msgspec structs over MessagePack on authenticated ZeroMQ;
- `router`: the front end's `EngineClient` in PD mode (admit -> order -> one handler per message);
  `flight`: one request's flight (its pair of workers, its first token); `workers`/`registration`: who may join,
  who is up, the pick;
- `prefill`, `decode`: the two workers' step loops; `handoff`/`lifecycle`: one state enum per side
  (`PrefillState`, `DecodeState`) and its checked transition table; `worker`, `worker_engine`: the loop and the
  engine verbs both workers share;
- `launcher`, `core_board`: the child processes `kvfence serve` starts on one host and the cores they share;
  `grammars`, `config_checks`: small services of the above; `router_config`, `decode_config`: their settings, in
  modules the flag tables import without torch.

What it does not know: HTTP (the server maps its domain errors), argument parsing (`kvfence.commands`), or how page
bytes move (`kvfence.transfer`) and are checked (`kvfence.integrity`).
"""
