"""The zoo: Qwen2-, Llama- and Qwen3-architecture causal LMs built offline at named sizes.

No checkpoint can be downloaded here, so policies start from a seeded random init (then a warm
start, `lightning_tlt.rl.warmstart`). The models are plain HF ``transformers`` models, saved
and loaded as HF directories, so vLLM, TRL and the kit's own runner read them as they would a hub
model. Sizes run from ``tiny`` (CPU tests; head_dim 64 because vLLM's CPU attention needs it) to
``400m`` (the body of Qwen2-0.5B, for GPU benchmarks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from lightning_tlt.models.tokenizer import build_tokenizer

ARCHS: tuple[str, ...] = ("qwen2", "llama", "qwen3")
"""Architectures `build_model` knows."""


@dataclass(frozen=True)
class ZooSize:
    """Shape of one named model size."""

    hidden_size: int
    """Width of the residual stream."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads; ``head_dim = hidden_size // num_attention_heads``."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention when smaller than the query heads)."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    vocab_size: int | None = None
    """Rows of the embedding and LM head; ``None``: the kit tokenizer's vocabulary rounded up to 64."""
    tie_word_embeddings: bool = False
    """Share one matrix between the embedding and the LM head (as Qwen2.5-0.5B does)."""
    max_position_embeddings: int = 4096
    """Longest context the config declares (Qwen2.5-0.5B: 32,768)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


QWEN25_05B_VOCAB = 151_936
"""Rows of Qwen2.5-0.5B's (tied) embedding and LM head."""

ZOO_SIZES: dict[str, ZooSize] = {
    # hidden, layers, heads, KV heads, MLP
    "tiny": ZooSize(128, 2, 2, 1, 256),  # ~0.3 M: CPU unit tests and demos; GQA exercised
    "small": ZooSize(256, 4, 4, 2, 768),  # ~3.2 M: CPU demos
    "100m": ZooSize(768, 12, 12, 4, 3072),  # ~104 M: GPU benchmarks
    "400m": ZooSize(896, 24, 14, 2, 4864),  # ~0.36 B: the body of Qwen2.5-0.5B
    # 494 M, as Qwen2.5-0.5B: the 400m body with its tied 151,936-row embedding and LM head
    "0.5b": ZooSize(
        896, 24, 14, 2, 4864, vocab_size=QWEN25_05B_VOCAB, tie_word_embeddings=True, max_position_embeddings=32768
    ),
}
"""Named sizes of the zoo (parameter counts in docs/zoo_and_tasks.md)."""

_CONFIGS: dict[str, type[PretrainedConfig]] = {
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
    "qwen3": Qwen3Config,
}


def default_vocab_size(multiple: int = 64) -> int:
    """The kit tokenizer's vocabulary size rounded up to a multiple of ``multiple`` (128 for 64)."""
    return int(math.ceil(len(build_tokenizer()) / multiple) * multiple)


def build_config(
    arch: str = "qwen2", size: str = "tiny", *, vocab_size: int | None = None
) -> PretrainedConfig:
    """The HF config of a zoo model (see `build_model`)."""
    if arch not in _CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_CONFIGS)}, got {arch!r}")
    if size not in ZOO_SIZES:
        raise ValueError(f"size must be one of {list(ZOO_SIZES)}, got {size!r}")
    tokenizer = build_tokenizer()
    shape = ZOO_SIZES[size]
    if vocab_size is None:
        vocab_size = shape.vocab_size if shape.vocab_size is not None else default_vocab_size()
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size must be >= the tokenizer's {len(tokenizer)} tokens, got {vocab_size!r}")
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=shape.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rope_theta=10000.0,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = shape.head_dim  # Qwen3 decouples head_dim from hidden_size
    if arch == "llama":
        kwargs["head_dim"] = shape.head_dim
        kwargs["attention_bias"] = False
    # Qwen2 has q/k/v biases built in (no flag); Qwen3 has none and q/k RMSNorms instead.
    config = _CONFIGS[arch](**kwargs)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def build_model(
    arch: str = "qwen2",
    size: str = "tiny",
    *,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Build a randomly initialised zoo model, deterministically, on the CPU.

    The init runs under ``torch.random.fork_rng`` seeded with ``seed``, so the same arguments
    give bit-identical weights and the caller's global RNG is left as it was.

    Args:
        arch: ``"qwen2"`` (q/k/v biases, as Qwen2), ``"llama"`` or ``"qwen3"`` (q/k norms).
        size: a key of `ZOO_SIZES`.
        vocab_size: rows of the embedding and LM head; default: the size's own (151,936 for
            ``0.5b``), else the kit tokenizer's vocabulary rounded up to a multiple of 64. The kit
            tokenizer uses the first ids; the other rows are never a target.
        seed: seed of the init.
        dtype: parameter dtype.

    Returns:
        An ``AutoModelForCausalLM`` in eval mode, with pad/bos/eos ids of the kit tokenizer and
        untied embeddings (tied for ``0.5b``, as Qwen2.5-0.5B).
    """
    config = build_config(arch, size, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model.eval()


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters of ``model`` (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, directory: str | Path
) -> Path:
    """Save ``model`` (safetensors) and ``tokenizer`` into one HF directory; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def load_model(
    directory: str | Path, *, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model and its tokenizer saved by `save_model` (or any HF causal-LM directory).

    Falls back to `build_tokenizer` when the directory holds no tokenizer.
    """
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ValueError(f"directory must hold an HF model (config.json), got {str(directory)!r}")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype if dtype is not None else "auto")
    if (directory / "tokenizer.json").is_file():
        # the generic fast class reads tokenizer.json verbatim (AutoTokenizer may swap in a
        # model-specific class, e.g. Qwen2Tokenizer, that rebuilds the pipeline)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    else:
        tokenizer = build_tokenizer()
    return model.eval(), tokenizer
