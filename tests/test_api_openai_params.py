"""logprobs, echo, penalties, logit_bias, min_tokens, stop_token_ids, response_format and seeds through HTTP,
with the official `openai` client, against the real engine in both modes: aggregated (`kvfence serve --role
aggregated` in-process) and disaggregated (router + prefill + decode in-process, local transport).

Oracles: transformers' log_softmax on the same tiny random Llama for every logprob; the aggregated engine
(LLMEngine.generate) for the tokens a processed request must produce; jsonschema for structured outputs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from kvfence.cli import build_parser
from kvfence.commands.serve import build_aggregated
from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.disagg.router import RouterConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.server.api import ApiSettings, build_app
from kvfence.server.launch import ServerThread
from tests.helpers.inprocess import InProcessDeployment
from tests.helpers.schemas import SCHEMA
from tests.helpers.serve import kvfence_serve

FLAGS = ["--page-size", "4", "--max-total-tokens", "1024", "--context-length", "256", "--served-model-name", "tiny"]
MODES = ["aggregated", "disaggregated"]
PROMPT = "the cache page of the decode engine"


def parse(model_dir: Path, *extra: str) -> Any:
    return build_parser().parse_args(["serve", "--role", "aggregated", "--model", str(model_dir), *FLAGS, *extra])


@pytest.fixture(scope="module")
def aggregated(tiny_llama_dir: Path) -> Iterator[tuple[str, Any]]:
    app, client = build_aggregated(parse(tiny_llama_dir))
    client.start()
    server = ServerThread(app).start()
    try:
        yield server.url, client.engine
    finally:
        server.stop()
        client.shutdown()


@pytest.fixture(scope="module")
def disaggregated(aggregated: tuple[str, Any]) -> Iterator[tuple[str, Any]]:
    engine = aggregated[1]
    cfg = EngineConfig(
        ModelConfig(engine.config.model.model_dir), CacheConfig(page_size=4, max_total_tokens=1024), context_length=256
    )
    with InProcessDeployment(
        cfg,
        cfg,
        RouterConfig(handoff_deadline_s=30, request_timeout_s=60),
        loaded=engine.loaded,
        model_fingerprint="t",
    ) as dep:
        dep.router.wait_for_workers(30)
        dep.router.start()
        settings = ApiSettings(served_model_name="tiny", vocab_size=engine.vocab_size)
        server = ServerThread(build_app(dep.router, engine.tokenizer, settings)).start()
        try:
            yield server.url, dep
        finally:
            server.stop()


@pytest.fixture(params=MODES)
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param)[0]


@pytest.fixture
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(aggregated: tuple[str, Any]) -> LLMEngine:
    """An oracle engine on the server's weights (its own pool: the server's engine belongs to its thread)."""
    served = aggregated[1]
    return LLMEngine(served.config, loaded=served.loaded)


def hf_logprobs(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is transformers' log_softmax for the token after ids[: i + 1]."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def text_of(engine: LLMEngine, t: int) -> str:
    return engine.tokenizer.decode([t], skip_special_tokens=False)


# -- logprobs and echo ----------------------------------------------------------------------------------------


def test_completion_logprobs_equal_transformers(oai: openai.OpenAI, engine: LLMEngine, hf_model: Any) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    resp = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = resp.choices[0].logprobs
    want = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert lp.tokens == [text_of(engine, t) for t in want.token_ids]
    oracle = hf_logprobs(hf_model, prompt + want.token_ids)
    for j, t in enumerate(want.token_ids):
        row = oracle[len(prompt) - 1 + j]
        assert lp.token_logprobs[j] == pytest.approx(row[t].item(), abs=1e-4)
        best = row.topk(3)
        top = lp.top_logprobs[j]  # the 3 most likely and the chosen token (here one of them: greedy)
        assert list(top) == [text_of(engine, t)] + [text_of(engine, i) for i in best.indices.tolist() if i != t]
        assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-4)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:j]) for j in range(5)]


def test_echo_with_max_tokens_zero_scores_the_prompt_only(oai: openai.OpenAI, engine: LLMEngine, hf_model: Any) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    resp = oai.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = resp.choices[0]
    assert c.text == engine.tokenizer.decode(prompt) and c.finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt), 0)
    lp = c.logprobs
    assert len(lp.tokens) == len(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    oracle = hf_logprobs(hf_model, prompt)
    assert lp.token_logprobs[1:] == pytest.approx(
        [oracle[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4
    )
    # lm-evaluation-harness's loglikelihood request: echo, max_tokens 1, logprobs 1, a batch of token prompts
    ctx, cont = prompt[:4], prompt[4:]
    batch = [ctx + cont, ctx + cont[:2]]
    r = httpx.post(
        oai.base_url.join("completions").__str__(),
        json={"model": "tiny", "prompt": batch, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True},
        timeout=120,
    ).json()
    for choice, ids in zip(sorted(r["choices"], key=lambda c: c["index"]), batch, strict=True):
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1  # the prompt, then the one generated token
        want = sum(oracle[i - 1, prompt[i]].item() for i in range(4, len(ids)))
        assert sum(lps[4:-1]) == pytest.approx(want, abs=1e-3)


def test_streamed_echo_and_logprobs_equal_the_whole_response(oai: openai.OpenAI, engine: LLMEngine) -> None:
    kw: dict[str, Any] = dict(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True, extra_body={"ignore_eos": True}
    )
    whole = oai.completions.create(**kw).choices[0]
    text, tokens, lps, tops, offsets = "", [], [], [], []
    for chunk in oai.completions.create(**kw, stream=True):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            lps += c.logprobs.token_logprobs
            tops += c.logprobs.top_logprobs
            offsets += c.logprobs.text_offset
    assert text == whole.text and text.startswith(PROMPT)
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert lps[0] is None and lps[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)
    assert [None if t is None else sorted(t) for t in tops] == [
        None if t is None else sorted(t) for t in whole.logprobs.top_logprobs
    ]


def test_chat_logprobs_and_top_logprobs(oai: openai.OpenAI, engine: LLMEngine, hf_model: Any) -> None:
    messages = [{"role": "user", "content": "say something about pages"}]
    kw: dict[str, Any] = dict(
        model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    whole = oai.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    prompt = engine.tokenizer.apply_chat_template(messages)
    want = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    assert [c.token for c in content] == [text_of(engine, t) for t in want]
    oracle = hf_logprobs(hf_model, prompt + want)
    for j, (entry, t) in enumerate(zip(content, want, strict=True)):
        row = oracle[len(prompt) - 1 + j]
        assert entry.logprob == pytest.approx(row[t].item(), abs=1e-4)
        assert [x.token for x in entry.top_logprobs] == [text_of(engine, i) for i in row.topk(2).indices.tolist()]
        assert entry.bytes == list(entry.token.encode())
    streamed = [
        c
        for ch in oai.chat.completions.create(**kw, stream=True)
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]


# -- processors -----------------------------------------------------------------------------------------------


def test_penalties_bias_min_tokens_and_stop_ids_give_the_engines_tokens(oai: openai.OpenAI, engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    plain = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    cases = [
        dict(repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.4, logit_bias={str(plain[1]): -100}),
        dict(stop_token_ids=[plain[2]]),
        dict(stop_token_ids=[plain[2]], min_tokens=4),
    ]
    for extra in cases:
        bias = {int(k): v for k, v in extra.get("logit_bias", {}).items()}
        sp = SamplingParams(max_tokens=10, temperature=0, **{**extra, "logit_bias": bias})
        want = engine.generate([prompt], sp)[0]
        body = {k: v for k, v in extra.items() if k not in ("presence_penalty", "frequency_penalty", "logit_bias")}
        resp = oai.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body=body,
            presence_penalty=extra.get("presence_penalty", 0),
            frequency_penalty=extra.get("frequency_penalty", 0),
            logit_bias=extra.get("logit_bias"),
        )
        assert resp.choices[0].text == want.text, extra
        assert resp.usage.completion_tokens == len(want.token_ids)
    assert len(want.token_ids) >= 4  # min_tokens held the stop id back


def test_response_format_json_schema_and_refusal(oai: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "page", "schema": SCHEMA, "strict": True}}
    resp = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a page as JSON"}],
        max_tokens=150,
        temperature=0.7,
        seed=3,
        n=2,
        response_format=fmt,
    )
    for c in resp.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}},
    }
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], response_format=bad)
    assert e.value.body["param"] == "response_format"


# -- integrity record and seeds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_every_choice_carries_its_integrity_record(
    mode: str, request: pytest.FixtureRequest, engine: LLMEngine
) -> None:
    base = request.getfixturevalue(mode)[0]
    status = "local" if mode == "aggregated" else "verified"
    body = {"model": "tiny", "prompt": ["one", "two words"], "n": 2, "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    records = [c["kvfence"]["integrity"] for c in r.json()["choices"]]
    assert len(records) == 4 and {rec["status"] for rec in records} == {status}
    assert r.headers["x-kvfence-integrity"] == ",".join([status] * 4)
    assert set(records[0]) == {
        "status",
        "reason",
        "detail",
        "tokens_expected",
        "tokens_covered",
        "pages",
        "digest_algorithm",
        "layout_fingerprint",
        "transfer_ref",
        "authenticated",
        "tokens_before_verdict",
        "retried_after",
    }
    assert all(rec["retried_after"] is None for rec in records)  # nothing was lost: no attempt was retried
    # the record names its transfer by a hash, never by the capability itself; disaggregated manifests are sealed
    assert all(rec["authenticated"] is (None if mode == "aggregated" else True) for rec in records)
    # disaggregated: each choice's first token (prefill's own KV) was released before decode's verdict
    assert [rec["tokens_before_verdict"] for rec in records] == [0 if mode == "aggregated" else 1] * 4
    one, two = (len(engine.tokenizer.encode(t)) for t in ("one", "two words"))
    assert [rec["tokens_expected"] for rec in records] == [one, one, two, two]
    assert all(rec["reason"] is None for rec in records)
    if mode == "aggregated":
        assert records[0]["tokens_covered"] is None and records[0]["pages"] is None and records[0]["layout_fingerprint"]
    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "n": 2,
            "max_tokens": 3,
            "stream": True,
        },
    ) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    finals = [c for e in events for c in e["choices"] if c.get("finish_reason")]
    assert sorted(c["index"] for c in finals) == [0, 1] and all(
        c["kvfence"]["integrity"]["status"] == status for c in finals
    )


def test_unseeded_sampling_differs_across_restarts_and_seed_fixes_it(tiny_llama_dir: Path) -> None:
    body = {"model": "tiny", "prompt": "go", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}

    def one_run(*flags: str) -> str:
        app, client = build_aggregated(parse(tiny_llama_dir, *flags))
        with client, ServerThread(app) as server:
            return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    assert one_run() != one_run()
    assert one_run("--seed", "5") == one_run("--seed", "5")


def test_processed_logprobs_mode_reports_the_distribution_sampled_from(tiny_llama_dir: Path, hf_model: Any) -> None:
    app, client = build_aggregated(parse(tiny_llama_dir, "--logprobs-mode", "processed_logprobs"))
    prompt = [5, 17, 99, 3]
    with client, ServerThread(app) as server:
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0.5,
                "top_k": 3,
                "seed": 1,
                "logprobs": 4,
            },
        ).json()
        assert r["choices"][0]["logprobs"] is not None
    lp = r["choices"][0]["logprobs"]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1].float() / 0.5
    keep = logits.topk(3).indices
    want = logits[keep].log_softmax(-1)
    chosen = keep.tolist().index(client.engine.tokenizer.token_to_id(lp["tokens"][0]))
    assert lp["token_logprobs"][0] == pytest.approx(want[chosen].item(), abs=1e-4)
    assert sorted(lp["top_logprobs"][0].values()) == pytest.approx(sorted([*want.tolist(), -9999.0]), abs=1e-4)


# -- a real `kvfence serve` process -----------------------------------------------------------------------------


@pytest.mark.slow  # ~30 s per mode: fresh interpreters import torch and load the model
@pytest.mark.parametrize("flags", [("--role", "aggregated"), ()], ids=["aggregated", "disaggregated"])
def test_openai_client_against_a_kvfence_serve_process(
    flags: tuple[str, ...], tiny_llama_dir: Path, tmp_path: Path, hf_model: Any
) -> None:
    with kvfence_serve(tiny_llama_dir, tmp_path / "serve.log", *flags) as url:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = [5, 60, 700, 33, 12]
        echo = oai.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
        lps = echo.choices[0].logprobs.token_logprobs
        oracle = hf_logprobs(hf_model, prompt)
        assert lps[0] is None and lps[1:] == pytest.approx(
            [oracle[i - 1, prompt[i]].item() for i in range(1, 5)], abs=1e-4
        )
        assert echo.usage.completion_tokens == 0 and echo.choices[0].finish_reason == "length"
        chat = oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a page as JSON"}],
            max_tokens=150,
            temperature=0.8,
            seed=1,
            n=2,
            logprobs=True,
            top_logprobs=3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            extra_body={"repetition_penalty": 1.1, "min_tokens": 2},
            response_format={"type": "json_schema", "json_schema": {"name": "page", "schema": SCHEMA}},
        )
        status = "local" if flags else "verified"
        for c in chat.choices:
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
            assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
            assert c.model_extra["kvfence"]["integrity"]["status"] == status
        with pytest.raises(openai.BadRequestError) as e:  # both modes: the router knows the vocabulary too
            oai.completions.create(model="tiny", prompt="x", logit_bias={"99999999": 1})
        assert e.value.body["param"] == "logit_bias"
