"""load_model: what it loads, and that every broken model directory fails with a message naming the file."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvfence.errors import InvalidRequestError, ModelLoadError, UnsupportedArchitectureError
from kvfence.kv.pool import KVPool
from kvfence.models.forward_batch import SeqChunk, build_forward_batch
from kvfence.models.loader import LoadedModel, load_model
from kvfence.models.tokenizer import StreamDecoder, Tokenizer


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def prefill_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    pool = KVPool(lm.kv_layout(4), 16)
    fb = build_forward_batch([SeqChunk(ids, 0, list(range(-(-len(ids) // 4))), "all")], 4)
    return lm.model(fb, pool)


IDS = [1, 5, 9, 200, 17, 300, 44, 2000, 3]


# --- what a good directory gives -----------------------------------------------------------------------


def test_loaded_model_fields(tiny_llama_dir: Path) -> None:
    lm = load_model(tiny_llama_dir, progress=False)
    assert lm.architecture == "LlamaForCausalLM"
    assert lm.hf_config.num_hidden_layers == 2
    assert lm.context_length == 2048
    assert lm.eos_token_ids == frozenset({2, 3})  # <|eos|> and <|end|> from generation_config.json
    assert lm.name == tiny_llama_dir.name
    assert lm.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in lm.model.parameters())
    assert lm.kv_layout(8).fingerprint == lm.kv_layout(8).fingerprint != lm.kv_layout(16).fingerprint


def test_sharded_checkpoint_loads_like_single_file(make_model) -> None:
    single = make_model(seed=1)
    sharded = make_model(seed=1, max_shard_size="60KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    a = prefill_logits(load_model(single, progress=False), IDS)
    b = prefill_logits(load_model(sharded, progress=False), IDS)
    assert torch.equal(a, b)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_load_into_fp32(make_model, weight_dtype: torch.dtype) -> None:
    d = make_model(torch_dtype=weight_dtype)
    lm = load_model(d, dtype=torch.float32, progress=False)
    assert lm.model.embed.dtype == torch.float32
    ref = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert ref.model.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        theirs = ref(torch.tensor([IDS])).logits[0]
    ours = prefill_logits(lm, IDS)
    assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-4


def test_bf16_model_runs_and_returns_fp32_logits(tiny_llama_dir: Path) -> None:
    lm = load_model(tiny_llama_dir, dtype=torch.bfloat16, progress=False)
    assert lm.model.layers[0].qkv_w.dtype == torch.bfloat16
    assert lm.kv_layout(4).dtype == torch.bfloat16
    logits = prefill_logits(lm, IDS)
    fp32 = prefill_logits(load_model(tiny_llama_dir, progress=False), IDS)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert float((logits - fp32).abs().max() / fp32.abs().max()) < 0.1  # bf16 is close, not exact


def test_progress_bar_goes_to_stderr_only_when_asked(tiny_llama_dir: Path, capsys) -> None:
    load_model(tiny_llama_dir, progress=False)
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""
    load_model(tiny_llama_dir, progress=True)
    out = capsys.readouterr()
    assert "loading weights" in out.err and out.out == ""


def test_loading_never_opens_a_network_connection(tiny_llama_dir: Path, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("network access during load_model")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    lm = load_model(tiny_llama_dir, progress=False)
    assert lm.architecture == "LlamaForCausalLM"


def test_eos_ids_fall_back_to_config_then_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "generation_config.json").unlink()
    edit_json(d / "config.json", eos_token_id=3)
    assert load_model(d, progress=False).eos_token_ids == frozenset({3})
    edit_json(d / "config.json", eos_token_id=None)
    assert load_model(d, progress=False).eos_token_ids == frozenset({2})  # tokenizer_config's eos_token


def test_context_length_is_capped_by_sliding_window(make_model) -> None:
    d = make_model("MistralForCausalLM", sliding_window=64, max_position_embeddings=256)
    assert load_model(d, progress=False).context_length == 64


def test_a_context_above_the_sliding_window_is_refused_naming_sliding_window(make_model) -> None:
    from kvfence.config import CacheConfig, EngineConfig, ModelConfig
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.errors import KvfenceError

    d = make_model("MistralForCausalLM", sliding_window=64, max_position_embeddings=256)
    with pytest.raises(KvfenceError, match=r"context length 64 \(sliding_window 64 in config.json") as info:
        LLMEngine(EngineConfig(ModelConfig(str(d)), CacheConfig(16, 512), context_length=128))
    assert "max_position_embeddings is larger" in str(info.value)


# --- errors, each naming the file at fault -------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        load_model(tmp_path / "does-not-exist")


def test_missing_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(d, progress=False)


def test_corrupt_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ModelLoadError, match=r"corrupt .*config\.json"):
        load_model(d, progress=False)


def test_config_without_architectures(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    edit_json(d / "config.json", architectures=None)
    with pytest.raises(ModelLoadError, match=r"config\.json has no 'architectures'"):
        load_model(d, progress=False)


def test_unsupported_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    edit_json(d / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match=r"config\.json.*GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(d, progress=False)


def test_unsupported_rope_type(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    edit_json(d / "config.json", rope_parameters=dict(rope, original_max_position_embeddings=64))
    with pytest.raises(UnsupportedArchitectureError, match=r"config\.json.*longrope"):
        load_model(d, progress=False)


def test_missing_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing weights.*model\.safetensors"):
        load_model(d, progress=False)


def test_corrupt_safetensors_header(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:40] = b"#" * 32  # the JSON header starts after an 8-byte length
    (d / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_model(d, progress=False)


def test_truncated_safetensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(d, progress=False)


def test_index_naming_a_missing_shard(make_model) -> None:
    d = make_model(max_shard_size="60KB")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=rf"index\.json names shard {shard.name}"):
        load_model(d, progress=False)


def test_corrupt_index(make_model) -> None:
    d = make_model(max_shard_size="60KB")
    (d / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json"):
        load_model(d, progress=False)


def test_missing_tensor(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.safetensors lacks 1 tensor.*layers\.1\.mlp\.up_proj\.weight"):
        load_model(d, progress=False)


def test_shape_mismatch(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    edit_json(d / "config.json", intermediate_size=100)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight'"):
        load_model(d, progress=False)


def test_unexpected_tensor(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A bias the config does not declare would be silently dropped; refuse it instead."""
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"q_proj\.bias"):
        load_model(d, progress=False)


def test_missing_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing tokenizer.*tokenizer\.json"):
        load_model(d, progress=False)


def test_corrupt_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load_model(d, progress=False)


def test_tokenizer_larger_than_model_vocab(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    edit_json(d / "config.json", vocab_size=1000)
    with pytest.raises(ModelLoadError, match=r"vocab_size 1000"):
        load_model(d, progress=False)


# --- tokenizer wrapper ---------------------------------------------------------------------------------


def test_tokenizer_matches_transformers(tiny_llama_dir: Path) -> None:
    ours = Tokenizer.from_dir(tiny_llama_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)
    text = "Step 42: verify the digest (99%) of every page — naïve café ✓."
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "How are the pages?"},
    ]
    their_ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.apply_chat_template(messages) == list(their_ids)
    their_text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == their_text
    assert ours.bos_token_id == 1 and ours.pad_token_id == 0
    assert ours.decode(ours.apply_chat_template(messages), skip_special_tokens=False).startswith("<|bos|><|system|>")


def test_chat_template_jinja_file_wins(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] | upper }}]{% endfor %}")
    assert Tokenizer.from_dir(d).render_chat([{"role": "user", "content": "hi"}]) == "[HI]"


def test_no_chat_template_is_a_request_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    edit_json(d / "tokenizer_config.json", chat_template=None)
    tok = Tokenizer.from_dir(d)
    assert tok.encode("hello") != []
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_is_a_request_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        Tokenizer.from_dir(d).render_chat([{"role": "user", "content": "hi"}])


def test_stream_decoder_reassembles_multibyte_text(tiny_llama_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_llama_dir)
    text = "naïve café ✓ 漢字 and emoji 🙂 end"
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some multi-byte characters span several byte tokens


def test_post_processor_bos_on_plain_prompts_not_on_chat(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A tokenizer whose post-processor adds BOS (as Llama 3's does): plain encode gets one, chat gets one."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    d = copy_model(tiny_llama_dir, tmp_path / "m")
    backend = Backend.from_file(str(d / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    backend.save(str(d / "tokenizer.json"))
    ours = Tokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert ours.encode("hello world") == theirs.encode("hello world") == [1, *ours.encode("hello world", False)]
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[0] == 1 and chat[1] != 1  # the template's BOS only
    assert chat == list(
        theirs.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    )
