"""The proof of a KV handoff: what prefill claims and what decode checks before it admits a request.

What lives where: `digest`/`device_digest` (per-page digests: xxh3_64 on host pools, mlh62 wherever torch runs),
`canary`, `manifest` (the signed claim, with the router's token count and hash), `verify` (decode's check), `record`
(the per-request integrity record in logs, metrics and responses); torch-free, for the router: `algorithms` (the
digest names), `token_hash` (the prompt token hash), `verdict` (reason codes and the result of a check). What it
does not know: transports or workers."""
