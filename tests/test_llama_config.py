"""The Llama-family config reader (`kvfence.models.llama_config`) against transformers' own config classes.

Every attribute kvfence reads must have the value transformers gives it, on the configs transformers writes and
on hub-style ones; what the reader cannot vouch for goes to transformers; the models read nothing else; and
loading a Llama-family model does not import transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

from kvfence.models import loader
from kvfence.models.llama_config import ATTRIBUTES_READ, DEFAULTS, LlamaFamilyConfig, read_llama_family_config

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURES = sorted(DEFAULTS)
_MISSING = object()
_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def _config_class(architecture: str) -> Any:
    return getattr(transformers, architecture.replace("ForCausalLM", "Config"))


def _transformers_config(d: Path) -> Any:
    return transformers.AutoConfig.from_pretrained(d, local_files_only=True)


def _write(d: Path, raw: dict[str, Any]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw))
    return d


def _assert_same(ours: Any, theirs: Any) -> None:
    for name in ATTRIBUTES_READ:
        a, b = getattr(ours, name, _MISSING), getattr(theirs, name, _MISSING)
        assert a == b and type(a) is type(b), f"{name}: ours {a!r}, transformers {b!r}"


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fields_and_defaults_are_transformers(architecture: str) -> None:
    cls = _config_class(architecture)
    base = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in base}
    model_type, defaults = DEFAULTS[architecture]
    assert model_type == cls.model_type
    assert set(defaults) == set(fields)
    for name, f in fields.items():
        assert f.default is not dataclasses.MISSING, name
        assert defaults[name] == f.default and type(defaults[name]) is type(f.default), name


_VARIANTS: list[dict[str, Any]] = [
    {},
    {"tie_word_embeddings": True, "num_key_value_heads": 2},
    {"head_dim": 32, "num_key_value_heads": 1},
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 512, "vocab_size": 300},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
]
_ARCH_VARIANTS: dict[str, list[dict[str, Any]]] = {
    "LlamaForCausalLM": [{"attention_bias": True, "mlp_bias": True}],
    "Qwen2ForCausalLM": [{"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}],
    "Qwen3ForCausalLM": [{"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}],
    "MistralForCausalLM": [{"sliding_window": None}, {"sliding_window": 64}],
}


@pytest.mark.parametrize(
    "architecture,overrides",
    [
        (a, v)
        for a in ARCHITECTURES
        for v in _VARIANTS + _ARCH_VARIANTS[a]
        if a != "Qwen2ForCausalLM" or "head_dim" not in v
    ],
)
def test_configs_transformers_writes_read_the_same(tmp_path: Path, architecture: str, overrides: dict) -> None:
    config = _config_class(architecture)(**{**_SMALL, **overrides})
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    ours = read_llama_family_config(raw, architecture)
    assert ours is not None, raw
    _assert_same(ours, _transformers_config(tmp_path))


_HUB_STYLE = {  # the 4.x layout most hub checkpoints carry: rope_theta at the top, torch_dtype, few fields
    "LlamaForCausalLM": {
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
    },
    "MistralForCausalLM": {"model_type": "mistral", "rope_theta": 1000000.0, "sliding_window": None},
    "Qwen2ForCausalLM": {"model_type": "qwen2", "rope_theta": 1000000.0, "use_sliding_window": False},
    "Qwen3ForCausalLM": {
        "model_type": "qwen3",
        "rope_theta": 1000000,
        "head_dim": 16,
        "rope_scaling": {"type": "default"},
    },
}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_hub_style_configs_read_the_same(tmp_path: Path, architecture: str) -> None:
    raw = {"architectures": [architecture], **_SMALL, "num_key_value_heads": 2, **_HUB_STYLE[architecture]}
    ours = read_llama_family_config(raw, architecture)
    assert ours is not None
    _assert_same(ours, _transformers_config(_write(tmp_path, raw)))


@pytest.mark.parametrize(
    "change",
    [
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {"partial_rotary_factor": 0.5},
        {"some_new_field": 1},
        {"hidden_size": 64.0},
        {"num_hidden_layers": True},
        {"rms_norm_eps": 1},
        {"model_type": "mistral"},
        {"num_attention_heads": 3},
        {"initializer_range": 2.0},
        {"max_length": 20},
    ],
)
def test_what_it_cannot_vouch_for_goes_to_transformers(tmp_path: Path, change: dict) -> None:
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_SMALL, **change}
    assert read_llama_family_config(raw, "LlamaForCausalLM") is None
    _write(tmp_path, raw)
    try:
        theirs = _transformers_config(tmp_path)
    except Exception:  # noqa: BLE001 (whatever transformers raises, the loader reports it as before)
        with pytest.raises(loader.ModelLoadError):
            loader._read_config(tmp_path)
        return
    architecture, config = loader._read_config(tmp_path)
    assert not isinstance(config, LlamaFamilyConfig)
    assert type(config) is type(theirs)


def test_qwen3_null_head_dim_and_mistral_layer_types_go_to_transformers() -> None:
    small = {**_SMALL, "architectures": ["X"]}
    assert read_llama_family_config({**small, "model_type": "qwen3", "head_dim": None}, "Qwen3ForCausalLM") is None
    mistral = {**small, "model_type": "mistral", "layer_types": ["full_attention"] * 2}
    assert read_llama_family_config(mistral, "MistralForCausalLM") is None
    qwen = {**small, "model_type": "qwen2", "layer_types": ["full_attention"]}  # one entry for two layers
    assert read_llama_family_config(qwen, "Qwen2ForCausalLM") is None
    assert read_llama_family_config({**small, "model_type": "deepseek_v3"}, "DeepseekV3ForCausalLM") is None
    # Qwen2Config has no head_dim field (transformers keeps one given as a plain attribute)
    assert read_llama_family_config({**small, "model_type": "qwen2", "head_dim": 32}, "Qwen2ForCausalLM") is None


class _Recorder:
    """transformers' config, recording the name of every attribute read from it."""

    def __init__(self, config: Any, seen: set[str]) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name: str) -> Any:
        self._seen.add(name)
        return getattr(self._config, name)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_the_engine_reads_only_vouched_attributes(
    make_model: Any, monkeypatch: pytest.MonkeyPatch, architecture: str, kernels: str
) -> None:
    from kvfence.config import CacheConfig, EngineConfig, ModelConfig
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sampling_params import SamplingParams

    d = make_model(architecture)
    seen: set[str] = set()

    def recording(model_dir: Path) -> tuple[str, Any]:
        return architecture, _Recorder(_transformers_config(model_dir), seen)

    monkeypatch.setattr(loader, "_read_config", recording)
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model_dir=str(d), kernels=kernels), cache=CacheConfig(max_total_tokens=4096))
    )
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.generate([[5, 6, 7, 8, 9]], params)
    assert seen, "nothing was read: the recorder is not in the path"
    assert seen <= set(ATTRIBUTES_READ), sorted(seen - set(ATTRIBUTES_READ))


def test_loading_a_llama_model_does_not_import_transformers(tiny_llama_dir: Path) -> None:
    code = (
        "import sys\nfrom kvfence.models.loader import load_model\n"
        f"lm = load_model({str(tiny_llama_dir)!r}, progress=False)\n"
        "print(type(lm.hf_config).__name__, 'transformers' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["LlamaFamilyConfig", "False"]
