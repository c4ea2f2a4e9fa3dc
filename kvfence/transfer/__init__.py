"""The data plane: transports that move KV pages between prefill and decode.

What lives where: `frames` (the typed frames and their codec: what a sender and a receiver may say), `base` (what
every transport does: the protocol's sequence, bounded batches, coverage, the sender's and receiver's cores), `tcp`
(sockets, the frames' MACs), `local` (in-process, for tests), `mooncake`/`mooncake_engine` (one-sided writes),
`staging` (pinned host buffers for pools that are not host-visible); torch-free, for the router and the flag tables:
`transfer_id` (the transfer capability), `transfer_config` (the backends and the sender's bounds). What it does not
know: why a request exists or whether its KV is right (`kvfence.integrity` decides)."""
