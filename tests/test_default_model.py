"""make_tiny_model / ensure_default_model: directories that transformers itself loads and runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from kvfence.models import default
from kvfence.models.default import (
    CHAT_TEMPLATE,
    DEFAULT_MODEL_NAME,
    cache_dir,
    default_model_dir,
    ensure_default_model,
    make_tiny_model,
)

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_model_loads_in_transformers(make_model, arch: str) -> None:
    d = make_model(arch)
    for name in [
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]:
        assert (d / name).is_file(), name
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == [arch]
    model = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
    assert type(model).__name__ == arch
    out = model(torch.tensor([[1, 5, 9, 200]])).logits
    assert out.shape == (1, 4, config["vocab_size"])
    assert torch.isfinite(out).all()


def test_same_seed_same_weights_other_seed_differs(make_model) -> None:
    a, b, c = make_model(seed=3), make_model(seed=3), make_model(seed=4)
    with safe_open(a / "model.safetensors", "pt") as fa, safe_open(b / "model.safetensors", "pt") as fb:
        with safe_open(c / "model.safetensors", "pt") as fc:
            name = "model.layers.0.self_attn.q_proj.weight"
            assert torch.equal(fa.get_tensor(name), fb.get_tensor(name))
            assert not torch.equal(fa.get_tensor(name), fc.get_tensor(name))
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_config_overrides_reach_config(make_model) -> None:
    d = make_model(
        "Qwen2ForCausalLM",
        num_hidden_layers=3,
        hidden_size=32,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    )
    config = transformers.AutoConfig.from_pretrained(d, local_files_only=True)
    assert config.num_hidden_layers == 3
    assert config.hidden_size == 32
    assert config.tie_word_embeddings is True
    assert config.rope_parameters["rope_type"] == "linear"
    with safe_open(d / "model.safetensors", "pt") as f:
        assert "model.layers.0.self_attn.q_proj.bias" in f.keys()  # Qwen2 keeps qkv bias


def test_tokenizer_loads_in_transformers_and_chat_template_renders(tiny_llama_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)
    text = "The cache pages are verified by digest 1234."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|bos|><|user|>\nHello there<|end|>\n<|assistant|>\n"
    assert json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    gen = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|eos|>"), tok.convert_tokens_to_ids("<|end|>")]


def test_sharded_and_bf16_checkpoints(make_model) -> None:
    d = make_model(max_shard_size="100KB", torch_dtype=torch.bfloat16)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    with safe_open(d / shards[0], "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16


def test_cache_dir_precedence(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVFENCE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvfence"
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path / "kv"))
    assert cache_dir() == tmp_path / "kv"
    assert default_model_dir() == tmp_path / "kv" / "models" / DEFAULT_MODEL_NAME
    monkeypatch.delenv("KVFENCE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "kvfence"


def test_ensure_default_model_builds_once(kvfence_cache_dir: Path, monkeypatch) -> None:
    d = ensure_default_model()
    assert d == kvfence_cache_dir / "models" / DEFAULT_MODEL_NAME
    config = json.loads((d / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (256, 4, 4)
    assert config["num_key_value_heads"] == 2
    assert config["max_position_embeddings"] == 2048
    mtime = (d / "model.safetensors").stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("the default model must not be rebuilt when present")

    monkeypatch.setattr(default, "make_tiny_model", boom)
    assert ensure_default_model() == d
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".")], "temporary directories left behind"


def test_default_model_is_deterministic(tmp_path: Path, monkeypatch) -> None:
    dirs = []
    for name in ["a", "b"]:
        monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path / name))
        dirs.append(ensure_default_model())
    assert (dirs[0] / "model.safetensors").read_bytes() == (dirs[1] / "model.safetensors").read_bytes()


def test_ensure_default_model_lost_race_keeps_winner(kvfence_cache_dir: Path, monkeypatch) -> None:
    """Another process finishes first (between our build and our rename): we keep its copy, leave no tmp dir."""
    real_make = default.make_tiny_model
    winner = default_model_dir()

    def build_then_lose(path, *args, **kwargs):
        out = real_make(path, *args, **kwargs)
        real_make(winner, *args, **kwargs)  # the other process renames its finished copy in first
        (winner / "winner.txt").write_text("first")
        return out

    monkeypatch.setattr(default, "make_tiny_model", build_then_lose)
    d = ensure_default_model()
    assert d == winner
    assert (d / "winner.txt").read_text() == "first"
    assert sorted(p.name for p in d.parent.iterdir()) == [DEFAULT_MODEL_NAME]
    model = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
    assert model.config.hidden_size == 256


def test_vocab_override_smaller_than_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_model(tmp_path / "m", vocab_size=100)


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GPT2"):
        make_tiny_model(tmp_path / "m", "GPT2LMHeadModel")


def test_default_model_serves_like_transformers(kvfence_cache_dir: Path) -> None:
    """The built-in model through our loader and paged forward: greedy tokens equal transformers' generate."""
    from kvfence.kv.pool import KVPool
    from kvfence.models.forward_batch import SeqChunk, build_forward_batch
    from kvfence.models.loader import load_model

    d = ensure_default_model()
    lm = load_model(d, progress=False)
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Verify every page."}])
    ref = transformers.LlamaForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt) :].tolist()
    pool = KVPool(lm.kv_layout(16), 4)
    tokens: list[int] = []
    chunk = SeqChunk(prompt, 0, [0, 1, 2, 3])
    for _ in range(8):
        tokens.append(int(lm.model(build_forward_batch([chunk], 16), pool)[0].argmax()))
        chunk = SeqChunk([tokens[-1]], len(prompt) + len(tokens) - 1, [0, 1, 2, 3])
    assert tokens == expected


def test_default_model_has_about_5m_parameters(kvfence_cache_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(ensure_default_model(), local_files_only=True)
    assert 4.5e6 <= sum(p.numel() for p in model.parameters()) <= 5.5e6


def test_stale_default_model_from_an_older_shape_is_rebuilt(kvfence_cache_dir: Path) -> None:
    target = default_model_dir()
    make_tiny_model(target, "LlamaForCausalLM", seed=0, hidden_size=64, intermediate_size=176, num_hidden_layers=2)
    d = ensure_default_model()
    assert d == target
    config = json.loads((d / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert sorted(p.name for p in d.parent.iterdir()) == [DEFAULT_MODEL_NAME]  # old copy and tmp dirs removed


def test_unknown_preset_is_refused_with_the_list() -> None:
    with pytest.raises(ValueError, match="kvfence-llama-100m"):
        default.ensure_preset_model("no-such-model")


def test_a_preset_name_as_model_builds_that_preset_once(kvfence_cache_dir: Path, monkeypatch) -> None:
    from kvfence.config import resolve_model_dir

    overrides = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    monkeypatch.setitem(default.PRESETS, "tiny-preset", ({**overrides, "num_key_value_heads": 1}, 2048))
    said: list[str] = []
    d = Path(resolve_model_dir("tiny-preset", said.append))
    assert d == cache_dir() / "models" / "tiny-preset" and len(said) == 1
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 32
    assert resolve_model_dir("tiny-preset", said.append) == str(d) and len(said) == 1  # built once


def test_a_preset_with_a_weights_dtype_stores_them_so_and_is_not_rebuilt(kvfence_cache_dir: Path, monkeypatch) -> None:
    """kvfence-llama-0.5b keeps its weights in bf16 (torch_dtype, not a config field): built once, not seen as stale."""
    from safetensors import safe_open

    overrides = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    monkeypatch.setitem(default.PRESETS, "bf16-preset", ({**overrides, "torch_dtype": "bfloat16"}, 2048))
    d = default.ensure_preset_model("bf16-preset")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    built = (d / "model.safetensors").stat().st_mtime_ns
    assert default.ensure_preset_model("bf16-preset") == d and (d / "model.safetensors").stat().st_mtime_ns == built
    assert default.PRESETS[default.LLAMA_05B_NAME][0]["hidden_size"] == 1536  # the 0.5B shape is a preset


def test_larger_tokenizer_vocabularies_are_reached_exactly() -> None:
    words = default._pseudo_words(500)
    assert len(set(words)) == 500 and words == default._pseudo_words(500)
    from tokenizers import Tokenizer

    assert Tokenizer.from_str(default._tokenizer_json(4096)).get_vocab_size() == 4096
