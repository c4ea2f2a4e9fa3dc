"""config.json of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) read without transformers.

What it knows: the fields of transformers' LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config (5.x) with
their defaults, what those classes derive when they are made (head_dim and the key/value heads from the attention
heads, Qwen's sliding window only when `use_sliding_window`, its per-layer `layer_types`) and how transformers
standardizes a single RoPE dict of the default type (`rope_scaling` or `rope_parameters`, `rope_theta` folded
in, `rope_type` from a legacy `type`). Importing transformers' config classes loads its model zoo and torch's
distributed and symbolic-shape modules (about 85 MiB of resident memory in every serving process); this reads
the same values in a few dictionaries.

It vouches only for a config it understands in full: every key one it knows, every value of the exact type
transformers' strict dataclasses accept, `model_type` the architecture's, the RoPE dict flat and of the default
type, and nothing transformers' checks would refuse (hidden size not a multiple of the heads for Llama, an odd
head dimension above 4, bad `layer_types`, `initializer_range` outside [0, 1]). Anything else returns None and
the loader asks transformers (`AutoConfig`), as before, which then also reports what is wrong.
tests/test_llama_config.py compares every attribute the models read (`ATTRIBUTES_READ`) with transformers' on
each architecture and on the configs transformers writes, and records what the models read.

What it does not know: DeepSeek/GLM configs (those still go to transformers), other RoPE types (linear, dynamic,
llama3, yarn: transformers), weights or tokenizers.
"""

from __future__ import annotations

import copy
from typing import Any

# Every attribute kvfence's models, loader and engine read from a Llama-family config (tests record the reads and
# compare each with transformers').
ATTRIBUTES_READ = (
    "attention_bias",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "layer_types",
    "max_position_embeddings",
    "mlp_bias",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "sliding_window",
    "tie_word_embeddings",
    "use_sliding_window",
    "vocab_size",
)

_COMMON = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "attention_dropout": 0.0,
}
_QWEN = {
    **_COMMON,
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
    "bos_token_id": None,
    "eos_token_id": None,
}

# architecture -> (model_type, the config class's fields and their defaults)
DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": (
        "llama",
        {
            **_COMMON,
            "intermediate_size": 11008,
            "num_key_value_heads": None,
            "max_position_embeddings": 2048,
            "pretraining_tp": 1,
            "attention_bias": False,
            "mlp_bias": False,
            "head_dim": None,
        },
    ),
    "MistralForCausalLM": (
        "mistral",
        {
            **_COMMON,
            "intermediate_size": 14336,
            "num_key_value_heads": 8,
            "head_dim": None,
            "max_position_embeddings": 131072,
            "sliding_window": 4096,
        },
    ),
    "Qwen2ForCausalLM": ("qwen2", dict(_QWEN)),
    "Qwen3ForCausalLM": ("qwen3", {**_QWEN, "head_dim": 128, "attention_bias": False}),
}

_INT, _FLOAT, _BOOL, _STR = (int,), (float,), (bool,), (str,)
_NONE = (type(None),)
# field -> the Python types a value may have (an int is never a bool here; a float field takes floats only: anything
# looser goes to transformers, which decides)
_TYPES: dict[str, tuple[type, ...]] = {
    "vocab_size": _INT,
    "hidden_size": _INT,
    "intermediate_size": _INT,
    "num_hidden_layers": _INT,
    "num_attention_heads": _INT,
    "num_key_value_heads": _INT + _NONE,
    "head_dim": _INT + _NONE,
    "hidden_act": _STR,
    "max_position_embeddings": _INT,
    "initializer_range": _FLOAT,
    "rms_norm_eps": _FLOAT,
    "use_cache": _BOOL,
    "pad_token_id": _INT + _NONE,
    "bos_token_id": _INT + _NONE,
    "eos_token_id": _INT + (list,) + _NONE,
    "pretraining_tp": _INT + _NONE,
    "tie_word_embeddings": _BOOL,
    "rope_parameters": (dict,) + _NONE,
    "attention_bias": _BOOL,
    "attention_dropout": _FLOAT + _INT,
    "mlp_bias": _BOOL,
    "use_sliding_window": _BOOL,
    "sliding_window": _INT + _NONE,
    "max_window_layers": _INT,
    "layer_types": (list,) + _NONE,
}
# keys of config.json that are not fields but that transformers reads (or ignores) harmlessly
_EXTRA_TYPES: dict[str, tuple[type, ...]] = {
    "architectures": (list,),
    "model_type": _STR,
    "transformers_version": _STR,
    "dtype": _STR + _NONE,
    "torch_dtype": _STR + _NONE,
    "rope_theta": _FLOAT + _INT,
    "rope_scaling": (dict,) + _NONE,
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


class LlamaFamilyConfig:
    """A model's config as attributes, the values transformers' config class would hold for the fields kvfence
    reads (`ATTRIBUTES_READ`); other keys of config.json are kept as they are."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """transformers 5.x's alias of `rope_parameters`."""
        return self.__dict__.get("rope_parameters")

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def __repr__(self) -> str:
        return f"LlamaFamilyConfig({self.__dict__!r})"


def _is(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def read_llama_family_config(raw: dict[str, Any], architecture: str) -> LlamaFamilyConfig | None:
    """The config transformers would make of `raw` (config.json) for `architecture`, or None when this reader
    cannot vouch for it (then ask transformers)."""
    if architecture not in DEFAULTS:
        return None
    model_type, defaults = DEFAULTS[architecture]
    if raw.get("model_type") != model_type:  # AutoConfig picks the class by model_type, not by architecture
        return None
    for key, value in raw.items():
        types = _TYPES.get(key) if key in defaults else _EXTRA_TYPES.get(key)
        if types is None or not _is(value, types):
            return None
    if not all(isinstance(a, str) for a in raw["architectures"]):
        return None
    eos = raw.get("eos_token_id")
    if isinstance(eos, list) and not all(_is(t, _INT) for t in eos):
        return None
    values = copy.deepcopy(defaults)
    values.update(copy.deepcopy({k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")}))
    if not 0.0 <= values.get("initializer_range", 0.0) <= 1.0:
        return None

    # what each class derives in its __post_init__
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        values["sliding_window"] = values["sliding_window"] if values["use_sliding_window"] else None
    if architecture in ("LlamaForCausalLM", "MistralForCausalLM") and values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]  # Qwen2 has no head_dim field
    if "head_dim" in values and values["head_dim"] is None:  # Qwen3's is an int field: transformers refuses null
        return None
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and values["layer_types"] is None:
        values["layer_types"] = [
            "sliding_attention" if values["sliding_window"] is not None and i >= values["max_window_layers"] else
            "full_attention"
            for i in range(values["num_hidden_layers"])
        ]  # fmt: skip
    if architecture == "MistralForCausalLM" and "layer_types" in raw:
        return None
    layer_types = values.get("layer_types")
    if layer_types is not None and (
        len(layer_types) != values["num_hidden_layers"] or any(t not in _LAYER_TYPES for t in layer_types)
    ):
        return None
    if architecture == "LlamaForCausalLM" and values["hidden_size"] % values["num_attention_heads"] != 0:
        return None

    # RoPE as transformers standardizes it: rope_scaling (legacy) or rope_parameters, rope_theta folded in
    rope = copy.deepcopy(raw.get("rope_scaling") or values["rope_parameters"]) or {}
    if not all(isinstance(k, str) for k in rope) or any(k in _LAYER_TYPES for k in rope):
        return None  # nested per layer type: transformers
    rope.setdefault("rope_theta", raw.get("rope_theta", 10_000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] != "default" or not set(rope) <= {"rope_type", "type", "rope_theta"}:
        return None  # scaled RoPE (its parameters are checked by transformers), partial rotary, extra keys
    if not _is(rope["rope_theta"], _FLOAT + _INT):
        return None
    head_dim = values.get("head_dim")
    if head_dim is not None and head_dim > 4 and head_dim % 2:
        return None  # transformers: RoPE needs an even rotary dimension
    values["rope_parameters"] = rope
    return LlamaFamilyConfig(values)
