"""Operator tools: audit SGLang and vLLM P/D deployments and SGLang logs, probe endpoints for leakage.

SGLang: sglang (rules), sglang_server, sglang_cli, sglang_flags, sglang_releases, logs/, metrics. vLLM: vllm (rules),
vllm_server (launch commands, saved JSON, live URLs), kv_params_probe (fabricated kv_transfer_params, #52234).
Shared: findings, exit_status, live_server (GETs to a running server), probe and probe_verdict (the black-box leak
probe).
"""
