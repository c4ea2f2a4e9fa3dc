"""Oracle tests: our paged Llama-family models against transformers' own classes, fp32.

Every comparison is max|ours - theirs| <= 1e-4 * max|theirs| on logits, where "theirs"
is a full no-cache forward of the whole sequence by transformers. Greedy tokens must be
identical to transformers' generate(do_sample=False).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvfence.kv.allocator import PageAllocator
from kvfence.kv.pool import KVPool
from kvfence.models.forward_batch import SeqChunk, build_forward_batch
from kvfence.models.llama import rope_inv_freq
from kvfence.models.loader import LoadedModel, load_model

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]
RTOL = 1e-4
PAGE_SIZE = 4


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    err = rel_err(ours, theirs)
    assert err <= RTOL, f"relative error {err:.2e} > {RTOL:.0e}"


class PagedRunner:
    """Drives a loaded model through the paged path: pages from a PageAllocator, one KVPool."""

    def __init__(self, lm: LoadedModel, num_pages: int = 128, page_size: int = PAGE_SIZE) -> None:
        self.lm = lm
        self.page_size = page_size
        self.pool = KVPool(lm.kv_layout(page_size), num_pages)
        self.alloc = PageAllocator(num_pages)
        self.lens: dict[str, int] = {}

    def forward(self, items: list[tuple[str, list[int], str]]) -> list[torch.Tensor]:
        """items: (seq id, new tokens, logits mode) -> per item logits [rows, vocab] (rows 0 for "none")."""
        chunks = []
        for sid, tokens, mode in items:
            start = self.lens.get(sid, 0)
            have = len(self.alloc.pages_of(sid))
            need = -(-(start + len(tokens)) // self.page_size)
            if need > have:
                self.alloc.allocate(sid, need - have)
            chunks.append(SeqChunk(tokens, start, self.alloc.pages_of(sid), mode))
        fb = build_forward_batch(chunks, self.page_size)
        logits = self.lm.model(fb, self.pool)
        assert logits.shape == (len(fb.logits_index), self.lm.hf_config.vocab_size)
        assert logits.dtype == torch.float32
        out, row = [], 0
        for sid, tokens, mode in items:
            n = {"all": len(tokens), "last": 1, "none": 0}[mode]
            out.append(logits[row : row + n])
            row += n
            self.lens[sid] = self.lens.get(sid, 0) + len(tokens)
        return out


def hf_model(d: Path) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.from_pretrained(d, local_files_only=True)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(d, local_files_only=True, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(ref: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids]), use_cache=False).logits[0].float()  # [S, vocab]


@torch.no_grad()
def hf_greedy(ref: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def prompt_of(n: int, seed: int, vocab: int = 2048) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def check_prefill_then_decode(d: Path, prompt: list[int], steps: int) -> float:
    """Prefill (all rows) then greedy decode one token at a time; returns the max relative error seen."""
    lm = load_model(d, progress=False)
    ref = hf_model(d)
    expected_tokens = hf_greedy(ref, prompt, steps)
    runner = PagedRunner(lm)
    (prefill,) = runner.forward([("s", prompt, "all")])
    step_logits = [prefill[-1]]
    tokens = [int(prefill[-1].argmax())]
    for _ in range(steps - 1):
        (lg,) = runner.forward([("s", [tokens[-1]], "last")])
        step_logits.append(lg[0])
        tokens.append(int(lg[0].argmax()))
    assert tokens == expected_tokens
    full = hf_logits(ref, prompt + tokens[:-1])  # rows for every prompt position and every decode step
    assert_close(prefill, full[: len(prompt)])
    assert_close(torch.stack(step_logits), full[len(prompt) - 1 :])
    return max(rel_err(prefill, full[: len(prompt)]), rel_err(torch.stack(step_logits), full[len(prompt) - 1 :]))


def check_steps_against_full_forward(
    ref: transformers.PreTrainedModel,
    prompts: dict[str, list[int]],
    logits: dict[str, list[torch.Tensor]],
    generated: dict[str, list[int]],
) -> None:
    """Each sequence's logits at every sampled step equal transformers' full forward of prompt + tokens."""
    for sid, prompt in prompts.items():
        full = hf_logits(ref, prompt + generated[sid][:-1])
        assert_close(torch.stack(logits[sid]), full[len(prompt) - 1 :])
        # transformers' greedy choice at every step of this sequence is our token, so its greedy
        # decoding of the prompt is our output (generate itself is checked in the batch-1 tests)
        assert full[len(prompt) - 1 :].argmax(-1).tolist() == generated[sid], sid


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_and_decode_match_transformers(make_model, arch: str) -> None:
    d = make_model(arch)
    check_prefill_then_decode(d, prompt_of(11, seed=1), steps=10)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batch_of_8_with_chunked_prefill_matches_transformers(make_model, arch: str) -> None:
    d = make_model(arch, seed=2)
    lm = load_model(d, progress=False)
    ref = hf_model(d)
    lengths = [3, 7, 12, 5, 9, 1, 16, 10]
    prompts = {f"s{i}": prompt_of(n, seed=10 + i) for i, n in enumerate(lengths)}
    runner = PagedRunner(lm)
    # forward 1: every prompt, except s6 whose 16 tokens are split 9 + 7 over two forwards
    first = [(sid, p, "all") for sid, p in prompts.items() if sid != "s6"] + [("s6", prompts["s6"][:9], "none")]
    got = dict(zip([sid for sid, _, _ in first], runner.forward(first), strict=True))
    assert got["s6"].shape[0] == 0
    logits: dict[str, list[torch.Tensor]] = {sid: [] for sid in prompts}
    generated: dict[str, list[int]] = {sid: [] for sid in prompts}
    for sid in prompts:
        if sid != "s6":
            logits[sid].append(got[sid][-1])
            generated[sid].append(int(got[sid][-1].argmax()))
            assert_close(got[sid], hf_logits(ref, prompts[sid]))
    # forward 2: the rest of s6's prompt alongside seven decode tokens (mixed prefill + decode)
    second = [(sid, [generated[sid][-1]], "last") for sid in prompts if sid != "s6"]
    second.append(("s6", prompts["s6"][9:], "all"))
    for (sid, _, _), lg in zip(second, runner.forward(second), strict=True):
        if sid == "s6":
            assert_close(lg, hf_logits(ref, prompts["s6"])[9:])
        logits[sid].append(lg[-1])
        generated[sid].append(int(lg[-1].argmax()))
    # pure decode steps for all eight
    for _ in range(4):
        step = [(sid, [generated[sid][-1]], "last") for sid in prompts]
        for (sid, _, _), lg in zip(step, runner.forward(step), strict=True):
            logits[sid].append(lg[0])
            generated[sid].append(int(lg[0].argmax()))
    check_steps_against_full_forward(ref, prompts, logits, generated)
    assert runner.alloc.num_used == sum(-(-(len(p) + len(generated[s]) - 1) // PAGE_SIZE) for s, p in prompts.items())
    runner.alloc.check()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_decode_batch_of_20_matches_transformers(make_model, monkeypatch, arch: str) -> None:
    """20 rows per decode step: the projections take the oneDNN kernels (models.linear), not MKL."""
    from kvfence.models import linear

    routed: list[bool] = []
    real = linear._use_packed
    monkeypatch.setattr(linear, "_use_packed", lambda x, p: routed.append(real(x, p)) or routed[-1])
    d = make_model(arch, seed=3)
    lm = load_model(d, progress=False)
    ref = hf_model(d)
    prompts = {f"s{i}": prompt_of(2 + i % 7, seed=40 + i) for i in range(20)}
    runner = PagedRunner(lm)
    first = runner.forward([(sid, p, "last") for sid, p in prompts.items()])
    generated = {sid: [int(lg[0].argmax())] for sid, lg in zip(prompts, first, strict=True)}
    logits = {sid: [lg[0]] for sid, lg in zip(prompts, first, strict=True)}
    for _ in range(3):
        step = runner.forward([(sid, [generated[sid][-1]], "last") for sid in prompts])
        for sid, lg in zip(prompts, step, strict=True):
            logits[sid].append(lg[0])
            generated[sid].append(int(lg[0].argmax()))
    check_steps_against_full_forward(ref, prompts, logits, generated)
    assert any(routed) == linear.onednn_available(torch.float32)


ROPE_VARIANTS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "theta": {"rope_type": "default", "rope_theta": 500000.0},
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_llama_rope_variants_match_transformers(make_model, variant: str) -> None:
    d = make_model("LlamaForCausalLM", rope_parameters=dict(ROPE_VARIANTS[variant]), max_position_embeddings=256)
    check_prefill_then_decode(d, prompt_of(40, seed=3), steps=6)
    # the scaled frequencies really differ from plain RoPE (except dynamic, which is plain below its limit)
    config = transformers.AutoConfig.from_pretrained(d, local_files_only=True)
    inv_freq, scale = rope_inv_freq(config)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain, _ = rope_inv_freq(config)
    assert (variant == "dynamic") == (torch.equal(inv_freq, plain) and scale == 1.0)


def test_rope_frequencies_equal_transformers(make_model) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for variant in ["llama3", "linear", "yarn"]:
        d = make_model("LlamaForCausalLM", rope_parameters=dict(ROPE_VARIANTS[variant]), max_position_embeddings=256)
        config = transformers.AutoConfig.from_pretrained(d, local_files_only=True)
        theirs, their_scale = ROPE_INIT_FUNCTIONS[variant](config, "cpu")
        ours, our_scale = rope_inv_freq(config)
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
        assert our_scale == pytest.approx(their_scale)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_tied_embeddings_match_transformers(make_model, arch: str) -> None:
    d = make_model(arch, tie_word_embeddings=True)
    lm = load_model(d, progress=False)
    assert lm.model.lm_head is lm.model.embed
    check_prefill_then_decode(d, prompt_of(9, seed=4), steps=5)


def test_llama_attention_and_mlp_bias_match_transformers(make_model) -> None:
    d = make_model("LlamaForCausalLM", attention_bias=True, mlp_bias=True)
    check_prefill_then_decode(d, prompt_of(9, seed=5), steps=4)


def test_kv_pages_moved_to_another_pool_decode_identically(make_model) -> None:
    """Prefill on one pool, copy the pages byte-for-byte to other page ids of a second pool, decode there."""
    d = make_model("Qwen3ForCausalLM")
    lm = load_model(d, progress=False)
    ref = hf_model(d)
    prompt = prompt_of(13, seed=6)
    prefill_side = PagedRunner(lm, num_pages=16)
    (lg,) = prefill_side.forward([("s", prompt, "last")])
    first = int(lg[0].argmax())
    src_pages = prefill_side.alloc.pages_of("s")
    decode_side = PagedRunner(lm, num_pages=32)
    decode_side.alloc.allocate("other", 5)  # so destination page ids differ from the source ones
    dst_pages = decode_side.alloc.allocate("s", len(src_pages))
    assert dst_pages != src_pages
    for src, dst in zip(src_pages, dst_pages, strict=True):
        decode_side.pool.write_page(dst, prefill_side.pool.read_page(src))
    decode_side.lens["s"] = len(prompt)
    tokens, step_logits = [first], []
    for _ in range(5):
        (lg,) = decode_side.forward([("s", [tokens[-1]], "last")])
        step_logits.append(lg[0])
        tokens.append(int(lg[0].argmax()))
    full = hf_logits(ref, prompt + tokens[:-1])
    assert_close(torch.stack(step_logits), full[len(prompt) :])
    assert tokens == hf_greedy(ref, prompt, len(tokens))


def test_poisoned_page_shows_in_logits(make_model) -> None:
    """A stale (NaN-poisoned) context page must corrupt the logits, not be silently skipped."""
    lm = load_model(make_model("LlamaForCausalLM"), progress=False)
    runner = PagedRunner(lm, num_pages=8)
    runner.forward([("s", prompt_of(10, seed=7), "last")])
    runner.pool.poison([runner.alloc.pages_of("s")[0]])
    (lg,) = runner.forward([("s", [42], "last")])
    assert torch.isnan(lg).all()


def test_kv_layout_shapes(make_model) -> None:
    lm = load_model(make_model("Qwen3ForCausalLM", num_hidden_layers=3), progress=False)
    layout = lm.kv_layout(16)
    assert layout.architecture == "Qwen3ForCausalLM"
    assert layout.num_layers == 3
    assert [(b.name, b.token_shape) for b in layout.buffers] == [("k", (2, 32)), ("v", (2, 32))]  # head_dim 32
    assert layout.bytes_per_page == 3 * 2 * 2 * 32 * 16 * 4
    assert lm.kv_layout(16, torch.bfloat16).dtype == torch.bfloat16


def test_rope_tables_regrow_and_equal_the_per_token_formula(make_model) -> None:
    model = load_model(make_model("LlamaForCausalLM"), progress=False).model
    small, _ = model._rope_tables(10)
    cos, sin = model._rope_tables(200)  # past the first table: regrown
    assert small.shape[0] == 64 and cos.shape[0] == 256 and sin.shape == cos.shape
    pos = torch.tensor([0, 5, 63, 64, 199])
    freqs = pos[:, None].float() * model.inv_freq[None, :]
    assert torch.equal(cos[pos], torch.cat([freqs.cos(), freqs.cos()], -1) * model.rope_scale)
    assert torch.equal(sin[pos], torch.cat([-freqs.sin(), freqs.sin()], -1) * model.rope_scale)


def test_rope_tables_shared_by_threads_always_come_as_a_matching_pair(make_model) -> None:
    """Engines on threads of one process share a model: a regrowth racing a read still hands each caller a cos and
    sin of one table, long enough for its positions (it once returned a 64-row sin with a 256-row cos)."""
    import threading

    model = load_model(make_model("LlamaForCausalLM"), progress=False).model
    bad: list[object] = []  # mismatched pairs, and any exception a thread raised (a thread's error is not the test's)

    def hammer(seed: int) -> None:
        try:
            for i in range(3000):
                n = 1 + (i * 7919 + seed * 104729) % 500
                if i % 5 == 0:
                    model._rope.clear()  # start over, so regrowths keep racing
                cos, sin = model._rope_tables(n, torch.float32 if i % 2 else None)
                if cos.shape != sin.shape or cos.shape[0] < n:
                    bad.append((n, cos.shape, sin.shape))
        except Exception as e:
            bad.append(e)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:3]


def test_unpacked_projections_match_transformers_too(make_model) -> None:
    """Without the oneDNN copies (pack_weights(False)) every projection takes F.linear: same oracle."""
    d = make_model("LlamaForCausalLM", seed=4)
    lm = load_model(d, progress=False)
    lm.model.pack_weights(False)
    assert all(not layer.packed for layer in lm.model.layers) and lm.model.lm_head_packed is None
    prompt = prompt_of(19, seed=5)
    (logits,) = PagedRunner(lm).forward([("s", prompt, "all")])
    assert_close(logits, hf_logits(hf_model(d), prompt))
