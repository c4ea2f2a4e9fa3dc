"""The OpenAI-compatible HTTP server over any `EngineClient` (the aggregated engine or the PD router).

What lives where: `api` (the app and its routes), `completions`/`chat`/`responses` (one endpoint each, sharing
`endpoint`, `generation`, `streaming`, `choice`), `openai_schema`/`responses_schema` (request bodies), `prompts`,
`tokenization`, `sampling`, `logprobs`, `tools`/`tool_parsers`/`tool_output`, `grammar_gate`; `http` (errors as
OpenAI-style JSON), `auth` (the front door's API key), `metrics` (Prometheus), `startup`/`launch` (serving a
socket), `role_engine` (the engine a role loads), `context` (the settings and services every endpoint shares).

What it does not know: scheduling, KV pages, workers; a domain error from below becomes an HTTP status here.
"""
