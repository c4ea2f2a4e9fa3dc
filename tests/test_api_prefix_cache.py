"""`cache_salt` and the prefix-cache metrics through the HTTP server (prefix caching on by default, as in vLLM and
SGLang) with the official openai client: a salt is
validated (400 with param), the same prompt under the same salt is served from the cache (the hit counter moves,
in tokens, read back with prometheus_client's own parser) and under another salt is not; output is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfence.cli import build_parser
from kvfence.commands.serve import build_aggregated
from kvfence.config import engine_config_from_args
from kvfence.server.launch import ServerThread

FLAGS = ["--page-size", "4", "--max-total-tokens", "512", "--context-length", "256", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def url(tiny_llama_dir: Path) -> Iterator[str]:
    args = build_parser().parse_args(
        ["serve", "--role", "aggregated", "--model", str(tiny_llama_dir), *FLAGS]  # the default: caching on
    )
    app, client = build_aggregated(args)
    client.start()
    server = ServerThread(app).start()
    try:
        yield server.url
    finally:
        server.stop()
        client.shutdown()


def counters(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name.startswith("kvfence_prefix_cache"):
            for s in fam.samples:
                out[s.name] = s.value
    return out


PROMPT = list(range(100, 141))  # 41 tokens: 10 full pages of 4 may hit


def complete(oai: openai.OpenAI, salt: str | None) -> list[str]:
    extra = {"cache_salt": salt} if salt is not None else {}
    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, extra_body=extra)
    return [r.choices[0].text]


def test_same_salt_hits_other_salt_misses_and_metrics_count_tokens(url: str) -> None:
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = counters(url)
    first = complete(oai, "tenant-a")
    after_first = counters(url)
    assert after_first["kvfence_prefix_cache_hits_total"] == before.get("kvfence_prefix_cache_hits_total", 0)
    assert complete(oai, "tenant-b") == first
    assert counters(url)["kvfence_prefix_cache_hits_total"] == after_first["kvfence_prefix_cache_hits_total"]
    assert complete(oai, "tenant-a") == first
    now = counters(url)
    assert now["kvfence_prefix_cache_hits_total"] - after_first["kvfence_prefix_cache_hits_total"] == 40
    assert now["kvfence_prefix_cache_queries_total"] - before.get("kvfence_prefix_cache_queries_total", 0) == 3 * 41


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_empty_cache_salt_is_refused(url: str, path: str) -> None:
    body: dict[str, Any] = {"model": "tiny", "cache_salt": ""}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    elif path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["input"] = "hi"
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "cache_salt" in r.text


def test_serve_caches_prefixes_unless_told_not_to_and_bench_offline_does_not() -> None:
    def caching(*argv: str) -> bool:
        return engine_config_from_args(build_parser().parse_args(argv), "m").cache.enable_prefix_caching

    assert caching("serve") and not caching("serve", "--no-enable-prefix-caching")
    # bench offline runs the same prompts in every repeat: a cache would skip most of the later runs' prefill
    assert not caching("bench", "offline") and caching("bench", "offline", "--enable-prefix-caching")


@pytest.mark.parametrize(("role", "caches"), [("aggregated", True), ("prefill", True), ("decode", False)])
def test_a_decode_worker_started_by_hand_has_no_prefix_cache(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str, caches: bool
) -> None:
    from kvfence.server.role_engine import build_role_engine

    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path))  # the workers' shared panel file goes here
    args = build_parser().parse_args(["serve", "--role", role, "--model", str(tiny_llama_dir), *FLAGS])
    engine = build_role_engine(args, str(tiny_llama_dir), role).engine
    assert (engine.prefix_cache is not None) == caches  # decode's prompts' KV arrives by handoff
