"""/metrics read by prometheus_client's own parser, and the vLLM-meaning metrics it carries: a model_name
label, no `*_created` series, request length histograms, inter-token latency, and (aggregated engine) queue,
prefill, decode and inference time; plus `stream_options.continuous_usage_stats` as guidellm sends it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.api_fakes import MODEL, FakeEngine, serve
from tests.helpers.prom import families, value


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = serve(FakeEngine(delay=0.002))
    try:
        yield server.url
    finally:
        server.stop()


def test_the_page_parses_with_one_family_per_name_and_no_created_series(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model=MODEL, prompt="abc", max_tokens=4)
    text = httpx.get(base_url + "/metrics").text
    parsed = families(text)
    names = [f.name for f in parsed]
    assert len(names) == len(set(names))
    samples = [s for f in parsed for s in f.samples]
    assert samples and not [s.name for s in samples if s.name.endswith("_created")]
    model = {"model_name": MODEL}
    for name in (
        "kvfence_time_to_first_token_seconds_count",
        "kvfence_inter_token_latency_seconds_count",
        "kvfence_e2e_request_latency_seconds_count",
        "kvfence_request_prompt_tokens_count",
        "kvfence_request_generation_tokens_count",
    ):
        assert value(text, name, **model) >= 1, name
    assert value(text, "kvfence_request_generation_tokens_sum", **model) >= 4
    assert value(text, "kvfence_num_running_requests", **model) == 0
    assert value(text, "kvfence_requests_finished_total", reason="length", **model) >= 1
    # the fake engine keeps no timings: the engine-time families exist, empty
    assert value(text, "kvfence_request_queue_time_seconds_count", **model) == 0


def _stream_usage(base_url: str, path: str, body: dict) -> list[dict | None]:
    with httpx.stream("POST", base_url + path, json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return [e.get("usage") for e in events]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(base_url: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}),
        ("/v1/chat/completions", chat),
    ):
        usages = _stream_usage(base_url, path, {**body, "stream_options": options})
        assert all(u is not None for u in usages), (path, usages)
        completion = [u["completion_tokens"] for u in usages]
        assert completion == sorted(completion) and completion[-1] == 5
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
        plain = _stream_usage(base_url, path, {**body, "stream_options": {"include_usage": True}})
        assert plain[-1] is not None and all(u is None for u in plain[:-1])  # without it: only the last event


@pytest.mark.slow  # builds the tiny model's engine (~5 s)
def test_aggregated_engine_reports_queue_prefill_and_decode_time(tiny_llama_dir: Path) -> None:
    from kvfence.cli import build_parser
    from kvfence.commands.serve import build_aggregated
    from kvfence.server.launch import ServerThread

    argv = ["serve", "--role", "aggregated", "--model", str(tiny_llama_dir), "--served-model-name", "tiny"]
    app, engine = build_aggregated(
        build_parser().parse_args([*argv, "--page-size", "4", "--max-total-tokens", "512", "--max-model-len", "256"])
    )
    engine.start()
    try:
        with ServerThread(app) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            for _ in range(2):
                client.completions.create(
                    model="tiny", prompt="the cache", max_tokens=6, extra_body={"ignore_eos": True}
                )
            text = httpx.get(server.url + "/metrics").text
    finally:
        engine.shutdown()
    model = {"model_name": "tiny"}
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert value(text, f"kvfence_request_{name}_seconds_count", **model) == 2, name
    decode = value(text, "kvfence_request_decode_time_seconds_sum", **model)
    inference = value(text, "kvfence_request_inference_time_seconds_sum", **model)
    assert 0 < decode < inference <= value(text, "kvfence_e2e_request_latency_seconds_sum", **model)
    assert value(text, "kvfence_preemptions_total", **model) == 0
    assert value(text, "kvfence_request_generation_tokens_sum", **model) == 12
