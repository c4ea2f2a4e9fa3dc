"""Load a local Hugging Face model directory into one of our model classes.

What it knows: the files of a model directory (config.json, model.safetensors or
model.safetensors.index.json + shards, tokenizer files, generation_config.json),
how to check them before trusting them (architecture served, every tensor present
with the right shape) and how to stream tensors into the model, casting to the
requested dtype. A Llama-family config.json is read by `llama_config` when it vouches for
it (without importing transformers), otherwise by transformers' AutoConfig. Every failure
is a ModelLoadError / UnsupportedArchitectureError whose message names the file at fault.

What it does not know: serving. It never touches the network: configs are read
from the directory with local_files_only, weights with safetensors.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvfence.errors import ModelLoadError, UnsupportedArchitectureError
from kvfence.kv.layout import KVLayout
from kvfence.models.heap import release_freed_heap
from kvfence.models.llama_config import read_llama_family_config
from kvfence.models.registry import resolve_architecture
from kvfence.models.tokenizer import Tokenizer, read_eos_token_ids

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, and what the engine needs to know about it."""

    model: nn.Module  # follows the registry contract (forward(fb, pool) -> logits)
    hf_config: Any  # transformers PretrainedConfig, or for the Llama family `llama_config.LlamaFamilyConfig`
    architecture: str  # e.g. "LlamaForCausalLM"
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    context_length: int  # longest sequence (prompt + output) the model serves
    model_dir: Path
    dtype: torch.dtype

    @property
    def name(self) -> str:
        """The directory name, used as the served model name by default."""
        return self.model_dir.name

    def kv_layout(self, page_size: int, dtype: torch.dtype | None = None) -> KVLayout:
        """This model's KV layout at `page_size` (KV dtype defaults to the weights' dtype)."""
        model_class: Any = type(self.model)  # a registry class: kv_layout is a classmethod of each
        return model_class.kv_layout(self.hf_config, page_size, dtype or self.dtype)


def _read_config(model_dir: Path) -> tuple[str, Any]:
    """(architecture name, transformers config), after checking the architecture is one we serve."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"missing {path}: not a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"corrupt {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"corrupt {path}: expected a JSON object")
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelLoadError(f"{path} has no 'architectures' entry naming the model class")
    architecture = archs[0]
    try:
        resolve_architecture(architecture)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{path}: {e}") from e

    light = read_llama_family_config(raw, architecture)  # the Llama family without importing transformers
    if light is not None:
        return architecture, light
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for bad configs
        raise ModelLoadError(f"cannot parse {path}: {e}") from e
    return architecture, hf_config


def _weight_files(model_dir: Path) -> tuple[dict[Path, list[str]] | None, Path]:
    """({shard: [tensor names]} from the index, index path) or (None, single file path)."""
    index_path = model_dir / WEIGHTS_INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
            raise ModelLoadError(f"corrupt {index_path}: expected a JSON object with a 'weight_map'") from e
        shards: dict[Path, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(model_dir / shard, []).append(name)
        for shard in shards:
            if not shard.is_file():
                raise ModelLoadError(f"{index_path} names shard {shard.name}, which is missing ({shard})")
        return shards, index_path
    single = model_dir / WEIGHTS_FILE
    if single.is_file():
        return None, single
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pth")):
        raise ModelLoadError(f"{model_dir} has no {WEIGHTS_FILE}; only safetensors weights are supported")
    raise ModelLoadError(f"missing weights: neither {single} nor {index_path} exists")


def _open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError
        raise ModelLoadError(f"corrupt safetensors file {path}: {e}") from e


def _check_and_plan(model: Any, files: list[Path]) -> list[tuple[Path, list[str]]]:
    """Check every tensor the model needs is present once with the right shape; plan (file, names) reads."""
    expected: dict[str, tuple[int, ...]] = model.weight_shapes()
    found: dict[str, Path] = {}
    plan: list[tuple[Path, list[str]]] = []
    for path in files:
        names: list[str] = []
        with _open(path) as f:
            for name in f.keys():
                if name not in expected:
                    if model.is_ignored_weight(name):
                        continue
                    raise ModelLoadError(f"{path} holds tensor {name!r}, which {type(model).__name__} does not use")
                try:
                    shape = tuple(f.get_slice(name).get_shape())
                except Exception as e:
                    raise ModelLoadError(f"corrupt safetensors file {path}: tensor {name!r}: {e}") from e
                if shape != expected[name]:
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} has shape {shape}, the config implies {expected[name]}"
                    )
                found[name] = path
                names.append(name)
        plan.append((path, names))
    missing = sorted(set(expected) - set(found))
    if missing:
        where = files[0] if len(files) == 1 else files[0].parent
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"{where} lacks {len(missing)} tensor(s): {', '.join(missing[:5])}{more}")
    return plan


def _stream(plan: list[tuple[Path, list[str]]], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from tqdm import tqdm

    total = sum(len(names) for _, names in plan)
    with tqdm(total=total, desc="loading weights", unit="tensor", file=sys.stderr, disable=not progress) as bar:
        for path, names in plan:
            for name in names:  # the file mapped for one tensor at a time: its pages do not stay resident
                with _open(path) as f:
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as e:
                        raise ModelLoadError(f"corrupt safetensors file {path}: tensor {name!r}: {e}") from e
                yield name, tensor
                bar.update(1)


def context_length_of(hf_config: Any) -> int:
    """max_position_embeddings, capped at the sliding window if any layer uses one (we attend fully)."""
    from kvfence.models.llama import sliding_window_of

    n = int(hf_config.max_position_embeddings)
    window = sliding_window_of(hf_config)
    return min(n, window) if window else n


def context_length_source(hf_config: Any) -> str:
    """Which config.json field sets `context_length_of`, for messages that refuse a longer context."""
    from kvfence.models.llama import sliding_window_of

    window = sliding_window_of(hf_config)
    if window and window < int(hf_config.max_position_embeddings):
        return (
            f"sliding_window {window} in config.json: kvfence attends over the whole context, so it serves at most "
            "one window (max_position_embeddings is larger)"
        )
    return "max_position_embeddings in config.json"


PANELS_FORMAT = 1  # bump when native_kernels.pack_panels' layout changes: shared panel files are keyed by it


def _panels_file_name(files: list[Path], dtype: torch.dtype) -> str:
    """The shared panel file's name for these weight files (path, size, mtime) in `dtype`."""
    import hashlib

    parts = [f"v{PANELS_FORMAT}", str(dtype)]
    for f in files:
        st = f.stat()
        parts += [str(f.resolve()), str(st.st_size), str(st.st_mtime_ns)]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"{files[0].parent.name}-{key}.{str(dtype).removeprefix('torch.')}.panels"


def _panel_file_family(path: Path) -> tuple[str, str]:
    """(model directory name, dtype) of a `_panels_file_name` name."""
    stem, dtype = path.name.removesuffix(".panels").rsplit(".", 1)
    return stem.rsplit("-", 1)[0], dtype


def _drop_older_panel_files(path: Path) -> None:
    """Remove the panel files of earlier versions of the same model directory and dtype beside `path` (one file
    per model and dtype stays; a process still mapping a removed file keeps its mapping)."""
    import glob

    family = _panel_file_family(path)
    for old in path.parent.glob(f"{glob.escape(family[0])}-*.panels"):
        if old != path and _panel_file_family(old) == family:
            old.unlink(missing_ok=True)


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
    panels: bool = False,
    shared_panels_dir: Path | None = None,
) -> LoadedModel:
    """Read, check and load the model in `model_dir` (see module docstring).

    `panels`: for the native kernels (the engine's kernels "native"), a model that can (Llama family, CPU)
    holds its weights as native panels only, made right after loading (`hold_panels`); otherwise a CPU
    Llama-family model gets oneDNN-blocked copies of its projections for torch's kernels. `shared_panels_dir`:
    the panels then live in a file there, named after the weight files and dtype, that every process loading
    the same model maps (one copy in the page cache for a host's workers)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    architecture, hf_config = _read_config(model_dir)
    cls = resolve_architecture(architecture)
    eos_token_ids = read_eos_token_ids(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir, eos_token_ids=eos_token_ids or None)
    eos_token_ids = tokenizer.eos_token_ids
    if tokenizer.vocab_size > int(hf_config.vocab_size):
        raise ModelLoadError(
            f"{tokenizer.source} has {tokenizer.vocab_size} tokens but {model_dir / 'config.json'} "
            f"declares vocab_size {hf_config.vocab_size}"
        )
    try:
        model = cls(hf_config, dtype)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{model_dir / 'config.json'}: {e}") from e
    except (AttributeError, TypeError, ValueError, AssertionError) as e:
        raise ModelLoadError(f"{model_dir / 'config.json'} does not describe a valid {architecture}: {e}") from e

    shards, weights_path = _weight_files(model_dir)
    files = [weights_path] if shards is None else sorted(shards)
    plan = _check_and_plan(model, files)
    loaded = model.load_weights(_stream(plan, progress))
    assert loaded == set(model.weight_shapes()), "checked plan and loaded tensors disagree"
    model = model.to(device).eval()
    on_cpu = torch.device(device).type == "cpu"
    if hasattr(model, "hold_panels"):
        if panels and on_cpu:
            shared = None if shared_panels_dir is None else Path(shared_panels_dir) / _panels_file_name(files, dtype)
            if shared is not None and not shared.exists():
                _drop_older_panel_files(shared)
            model.hold_panels(True, shared)  # one copy of the weights, as the native kernels read them
        else:
            model.pack_weights(on_cpu)  # oneDNN copies serve CPU products only
    elif not on_cpu and hasattr(model, "pack_weights"):
        model.pack_weights(False)  # oneDNN copies serve CPU products only: free the host memory
    release_freed_heap()
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        architecture=architecture,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        context_length=context_length_of(hf_config),
        model_dir=model_dir,
        dtype=dtype,
    )
