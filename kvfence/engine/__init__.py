"""The aggregated engine and the interface every front end talks to.

What lives where: `request` (a request's integer counters), `scheduler` (continuous batching), `runner` (one forward
and the sampling after it), `sampler`/`sampling_params`/`structured_output` (how tokens are chosen),
`token_logprobs` (one position's scores), `llm_engine` (the step loop), `async_engine` (the in-process
`EngineClient`); `engine_client` (the narrow async interface the HTTP layer uses, implemented here and by the
disaggregated router) and `admission` (what may enter, decided before any worker sees it) live here so that both the
server and disagg can import them downward.

What it does not know: HTTP, workers, transports.
"""
