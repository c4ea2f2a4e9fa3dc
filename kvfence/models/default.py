"""Tiny random models in Hugging Face format, and the built-in default model.

What it knows: how to write a complete local model directory (config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json)
for the GQA architectures we serve, using transformers' own config and model
classes so the files are exactly what a real checkpoint of that architecture looks
like. The tokenizer is a small byte-level BPE trained here on a corpus we write
ourselves, so nothing is downloaded. `ensure_default_model` builds the default model
("kvfence-tiny-llama", ~5M parameters) once in the cache directory, atomically;
`ensure_preset_model("kvfence-llama-100m")` does the same for a ~100M-parameter Llama
(hidden 768, 12 layers, GQA 12/4 heads, tied embeddings, a 32000-token tokenizer), the
size llama.cpp comparisons use (`kvfence bench offline --model kvfence-llama-100m`).

What it does not know: anything about serving. Weights are random: outputs are
gibberish, but deterministic for a given seed, which is all tests and demos need.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "kvfence-tiny-llama"
TOKENIZER_VOCAB_SIZE = 2048

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
END_TOKEN = "<|end|>"  # closes one chat turn; also an eos for generation
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, END_TOKEN, "<|system|>", "<|user|>", "<|assistant|>"]

# One turn: <|role|>\ncontent<|end|>\n ; a generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Per-architecture defaults for the tiny models; callers override any of them.
_TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}

_DEFAULT_MODEL_CONFIG: dict[str, Any] = {  # 4.98M parameters with the 2048-token tokenizer, untied head
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.05,
}


# Named presets `ensure_preset_model` builds; the default model is one of them.
LLAMA_100M_NAME = "kvfence-llama-100m"
_LLAMA_100M_CONFIG: dict[str, Any] = {  # 100.2M parameters: 24.6M tied embedding + 12 x 6.3M layers
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "vocab_size": 32000,
}
LLAMA_05B_NAME = "kvfence-llama-0.5b"
_LLAMA_05B_CONFIG: dict[str, Any] = {  # 452M parameters: 2 x 49.2M embedding and head + 16 x 25.2M layers
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",  # the weights as stored (0.9 GB); not a config field (make_tiny_model's torch_dtype)
}
PRESETS: dict[str, tuple[dict[str, Any], int]] = {  # name -> (config overrides, tokenizer vocabulary size)
    DEFAULT_MODEL_NAME: (_DEFAULT_MODEL_CONFIG, TOKENIZER_VOCAB_SIZE),
    LLAMA_100M_NAME: (_LLAMA_100M_CONFIG, 32000),
    LLAMA_05B_NAME: (_LLAMA_05B_CONFIG, TOKENIZER_VOCAB_SIZE),  # the bf16 benchmarks' larger model (issue 26)
}


def _config_class(architecture: str) -> type:
    import transformers

    classes = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }
    if architecture not in classes:
        raise ValueError(f"make_tiny_model cannot build {architecture!r}; it builds {sorted(classes)}")
    return classes[architecture]


# --- tokenizer -----------------------------------------------------------------------------------------

_WORDS = """
the a an of to in on at by for with from into over under after before between through about against
cache page pages token tokens prefill decode request requests batch batches layer layers head heads key keys
value values query queries model models engine engines server servers router routers memory bytes digest
digests canary canaries manifest fingerprint layout transfer verify verified verifies check checks checked
hash hashes stream streams sequence sequences prompt prompts answer answers reply replies word words text
time times fast slow small large tiny big first last next previous every each some many few all none
is are was were be been being has have had do does did can could will would should may might must
write writes wrote read reads send sends sent receive receives received store stores stored load loads
open close start stop run runs running wait waits done ready busy free used full empty new old good bad
red green blue yellow black white north south east west river mountain forest ocean city village road
bridge tower garden window door table chair book letter paper pencil music song story night morning
evening day week month year spring summer autumn winter rain snow wind sun moon star cloud light dark
one two three four five six seven eight nine ten hundred thousand million zero half quarter double
cat dog bird fish horse mouse lion tiger bear wolf fox rabbit owl eagle whale shark frog snake bee
apple bread cheese water coffee tea milk rice soup salt sugar honey lemon orange grape peach plum
think know see look find give take make tell ask use work call try feel leave keep let begin seem help
show hear play move live believe bring happen provide sit stand lose pay meet include continue set learn
change lead understand watch follow create speak allow add spend grow offer remember love consider appear
buy serve die expect build stay fall cut reach kill remain suggest raise pass sell require report decide
pull return explain hope develop carry break thank agree support hit produce eat cover catch draw choose
people world life hand part child eye woman place case point government company number group problem fact
system program question government night home water room mother area money story month lot right study
kernel tensor matrix vector scalar float integer string list tuple dict function class method module
error warning info debug trace log logs metric metrics latency throughput budget capacity quota limit
""".split()

_SENTENCE_FRAMES = [
    "The {a} {b} the {c}.",
    "{A} {b} {c} and {d}.",
    "Why does the {a} {b} before the {c}?",
    "Every {a} has {n} {b}s, not {m}.",
    "{A}, {b}, {c}: {d}!",
    'She said "{a} {b}" at {n}:{m}.',
    "If the {a} is {b}, then {c} the {d}; otherwise {e}.",
    "def {a}_{b}({c}): return {c} + {n}",
    "{A} {b} {c} {d} {e} {f} {g}.",
    "Step {n}: {a} the {b} with {c} ({m}%).",
]


def _pseudo_words(n: int, seed: int = 4321) -> list[str]:
    """`n` distinct deterministic pronounceable non-words (consonant-vowel syllables): room for a large vocabulary."""
    rng = random.Random(seed)
    onsets, vowels = "bcdfghjklmnprstvwz", "aeiou"
    out: dict[str, None] = {}
    while len(out) < n:
        out["".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(2, 5)))] = None
    return list(out)


def _corpus(num_sentences: int = 6000, seed: int = 1234, extra_words: int = 0) -> list[str]:
    """A deterministic pseudo-English corpus (our own words and frames) for BPE training.

    extra_words > 0 appends that many distinct pseudo-words (80 a line), so a trainer
    asked for a vocabulary far beyond what the English part supports can reach it.
    """
    rng = random.Random(seed)
    lines = [" ".join(_WORDS), "0123456789 " * 4, "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"]
    for _ in range(num_sentences):
        frame = rng.choice(_SENTENCE_FRAMES)
        words = {k: rng.choice(_WORDS) for k in "abcdefg"}
        words.update({k.upper(): v.capitalize() for k, v in words.items()})
        lines.append(frame.format(n=rng.randint(0, 2000), m=rng.randint(0, 99), **words))
    if extra_words:
        extra = _pseudo_words(extra_words)
        lines.extend(" ".join(extra[i : i + 80]) for i in range(0, len(extra), 80))
    return lines


@functools.lru_cache(maxsize=1)
def _tokenizer_json(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> str:
    """Train the byte-level BPE once per process; the result is deterministic.

    The default size trains on the English corpus alone (so the default model's tokenizer
    never changes); larger sizes add pseudo-words, one per token beyond the default.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    extra = max(0, vocab_size - TOKENIZER_VOCAB_SIZE)
    tok.train_from_iterator(_corpus(extra_words=extra), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE training reached {tok.get_vocab_size()} tokens, not the {vocab_size} asked for")
    return tok.to_str()


def write_tokenizer(path: Path, model_max_length: int = 2048, vocab_size: int = TOKENIZER_VOCAB_SIZE) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json into `path`; returns the special token ids by name."""
    from tokenizers import Tokenizer

    text = _tokenizer_json(vocab_size)
    tok = Tokenizer.from_str(text)
    (path / "tokenizer.json").write_text(text, encoding="utf-8")
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = tok.token_to_id(t)
        assert token_id is not None, f"special token {t!r} missing from the trained vocabulary"
        ids[t] = token_id
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2),
        encoding="utf-8",
    )
    return {"vocab_size": tok.get_vocab_size(), **ids}


# --- model directories ---------------------------------------------------------------------------------


def make_tiny_model(
    path: str | os.PathLike[str],
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    *,
    max_shard_size: str | int | None = None,
    torch_dtype: Any = None,
    tokenizer_vocab_size: int = TOKENIZER_VOCAB_SIZE,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random `architecture` model directory at `path` (created if needed) and return it.

    config_overrides go to the transformers config class (e.g. num_hidden_layers=2,
    hidden_size=64, rope_parameters={...}, tie_word_embeddings=True, attention_bias=True).
    max_shard_size writes a sharded checkpoint (model.safetensors.index.json + shards);
    torch_dtype (e.g. torch.bfloat16) stores the weights in that dtype;
    tokenizer_vocab_size trains the BPE tokenizer to that many tokens.
    """
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_cls = _config_class(architecture)
    max_len = int(config_overrides.get("max_position_embeddings", 2048))
    special = write_tokenizer(path, model_max_length=max_len, vocab_size=tokenizer_vocab_size)
    kwargs: dict[str, Any] = dict(_TINY_DEFAULTS)
    kwargs.update(
        vocab_size=special["vocab_size"],
        bos_token_id=special[BOS_TOKEN],
        eos_token_id=[special[EOS_TOKEN], special[END_TOKEN]],
        pad_token_id=special[PAD_TOKEN],
    )
    if architecture == "MistralForCausalLM":
        kwargs["sliding_window"] = None  # we serve full attention only
    if architecture == "Qwen3ForCausalLM":
        kwargs["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads; exercise that
    kwargs.update(config_overrides)
    if kwargs["vocab_size"] < special["vocab_size"]:
        raise ValueError(f"vocab_size {kwargs['vocab_size']} is smaller than the tokenizer's {special['vocab_size']}")
    config = config_cls(**kwargs)
    config.architectures = [architecture]

    model_cls = getattr(transformers, architecture)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.generation_config = generation_config
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    progress_was_on = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a tiny write needs no progress bar
    try:
        model.save_pretrained(path, **save_kwargs)
    finally:
        if progress_was_on:
            transformers.utils.logging.enable_progress_bar()
    return path


def cache_dir() -> Path:
    """$KVFENCE_CACHE_DIR, else $XDG_CACHE_HOME/kvfence, else ~/.cache/kvfence."""
    if os.environ.get("KVFENCE_CACHE_DIR"):
        return Path(os.environ["KVFENCE_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "kvfence"
    return Path.home() / ".cache" / "kvfence"


def default_model_dir() -> Path:
    """Where the built-in default model lives (it may not exist yet; see `ensure_default_model`)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """Return the default model's directory, building it first if it is not there."""
    return ensure_preset_model(DEFAULT_MODEL_NAME)


def ensure_preset_model(name: str) -> Path:
    """Return preset `name`'s directory (see PRESETS) under the cache, building it first if it is not there.

    Built in a temporary sibling directory and renamed into place, so a reader never
    sees a half-written model and two racing processes both end up with a valid one.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    overrides, tokenizer_vocab = PRESETS[name]
    target = cache_dir() / "models" / name
    stale = (target / "config.json").is_file() and not _is_current(target, overrides)
    if (target / "config.json").is_file() and not stale:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    old = tmp.with_name(tmp.name.replace(".tmp-", ".old-"))  # where a stale copy is moved aside
    try:
        import torch

        config = {k: v for k, v in overrides.items() if k != "torch_dtype"}
        dtype = getattr(torch, overrides["torch_dtype"]) if "torch_dtype" in overrides else None
        make_tiny_model(
            tmp, "LlamaForCausalLM", seed=0, tokenizer_vocab_size=tokenizer_vocab, torch_dtype=dtype, **config
        )
        if stale:  # built by an older kvfence with another shape: move it aside, then put ours in
            try:
                os.rename(target, old)
            except OSError:
                pass  # another process moved it first
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        for leftover in (tmp, old):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return target


def _is_current(path: Path, overrides: dict[str, Any]) -> bool:
    """True if the config.json at `path` has the shape `overrides` asks for."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return all(config.get(k) == v for k, v in overrides.items() if k not in ("initializer_range", "torch_dtype"))
