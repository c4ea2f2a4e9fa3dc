"""kvfence for vLLM: a verifying KV connector and the front end that plays kvfence's router for it.

What it knows, module by module:

  params.py     the `kv_transfer_params` kvfence exchanges with vLLM instances (no vLLM import)
  control.py    the small authenticated request/reply channel: decode asks prefill to push a transfer (`pull`),
                decode hands the integrity record to the front end (`record`) (no vLLM import)
  control_messages.py  that channel's typed messages (Hello, Pull, Record, Ok, Refused) and their codec
  handoff.py    every use of kvfence's manifest, verification and TCP transport for vLLM's KV blocks: a
                `KVPool` view of vLLM's registered cache tensors, the producer's held transfers (digests after
                the forward, deferred release bounded by a lease) and the consumer's verified loads (no vLLM
                import)
  connector.py  `KvfenceConnector`, vLLM's `KVConnectorBase_V1` (imports vLLM; load it with
                `kv_connector_module_path="kvfence.integrations.vllm.connector"`)
  stats.py      the connector's stats and Prometheus metrics through vLLM's connector stats API (imports vLLM)
  proxy.py      `kvfence proxy`: kvfence's OpenAI front end over a vLLM prefill and a vLLM decode instance
  launch.py     starting vLLM instances with the connector (for `kvfence proxy --launch` and tests; waiting for and
                stopping them is `kvfence.server_process`)

What it does not know: kvfence's own engine. Importing this package imports nothing of vLLM.
"""
