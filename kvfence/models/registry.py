"""Which architectures kvfence serves, and where their implementation lives.

What it knows: the `architectures` names found in a Hugging Face config.json that we
implement, mapped to our module and class, imported lazily. Every class here must
describe its KV layout (`kv_layout`), so an architecture is served only if the
verifier knows every buffer it keeps. What it does not know: weights or configs.

The contract every model class follows:
    cls.kv_layout(hf_config, page_size: int, dtype: torch.dtype) -> KVLayout
    cls(hf_config, dtype: torch.dtype)               # an nn.Module, weights uninitialised
    model.load_weights(iterable of (hf_name, tensor)) # names as in the safetensors files
    model.forward(fb: ForwardBatch, pool: KVPool) -> logits [N, vocab] float32
        # N = len(fb.logits_index); writes this forward's KV into `pool` at fb.slot_mapping
"""

from __future__ import annotations

import importlib

from kvfence.errors import UnsupportedArchitectureError

_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("kvfence.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kvfence.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("kvfence.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("kvfence.models.llama", "Qwen3ForCausalLM"),
    "DeepseekV3ForCausalLM": ("kvfence.models.deepseek", "DeepseekV3ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("kvfence.models.deepseek", "GlmMoeDsaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(name: str) -> type:
    if name not in _ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {name!r} is not supported; kvfence serves {', '.join(supported_architectures())}"
        )
    module_name, class_name = _ARCHITECTURES[name]
    try:
        module = importlib.import_module(module_name)
        return getattr(module, class_name)
    except (ImportError, AttributeError) as e:
        raise UnsupportedArchitectureError(f"architecture {name!r} is registered but unavailable: {e}") from e
