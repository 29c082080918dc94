"""A functional, static-shape forward over the weights of an HF Llama / Qwen2 / Qwen3 causal LM.

The runner owns no weights: every call reads them from the HF module's parameters (so an
optimizer step or an in-place edit of the policy is seen by the next call, with no copy and no
weight sync). Its state is a preallocated per-slot KV cache (`lightning_tlt.core.kv_cache`)
with per-row positions in tensors, which is what lets a decode step be compiled and captured as
one CUDA graph per batch bucket (the gpt-fast recipe).

Conventions:

- Row ``i`` of a decode / verify batch is slot ``i`` of the KV cache (the scheduler keeps active
  rows packed at the front), so a batch of ``B`` rows works on each layer's cache view ``[:B]``.
- ``positions[i, j]`` is the absolute position of token ``j`` of row ``i``; its key/value is
  written at that position and the query attends to every key at a position ``<=`` it.
- The decoder-layer function `decoder_layer` runs any HF-named decoder layer (``self_attn.{q,k,v,
  o}_proj``, optional ``q_norm``/``k_norm``, optional ``input_layernorm``, ``post_attention_
  layernorm``, ``mlp.{gate,up,down}_proj``) against its own cache: an EAGLE drafter is exactly
  one such layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HFModule",
    "unwrap_model",
    "is_supported",
    "ModelSpec",
    "rms_norm",
    "rope_cos_sin",
    "attention_mask",
    "decoder_layer",
    "ForwardOutput",
    "ModelRunner",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
HFModule = Any
"""An HF submodule read by attribute name (``q_proj``, ``weight``, ...): duck-typed, as HF's own are."""
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unwrap_model(model: nn.Module) -> Any:
    """Strip wrappers that keep the real model under ``.module`` (DDP, DataParallel, Fabric)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def is_supported(model: nn.Module) -> bool:
    """Whether `ModelRunner` can run ``model`` (else the engine uses the generic HF fallback)."""
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return False
    inner = getattr(model, "model", None)
    return all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm")) and hasattr(model, "lm_head")


def _rope_type(config: object) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")) or "default")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a supported model, read from its HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: object) -> ModelSpec:
        num_heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
        hidden = int(config.hidden_size)  # type: ignore[attr-defined]
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        return cls(
            model_type=str(config.model_type),  # type: ignore[attr-defined]
            num_layers=int(config.num_hidden_layers),  # type: ignore[attr-defined]
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(config.vocab_size),  # type: ignore[attr-defined]
        )


def rms_norm(x: Tensor, norm: HFModule) -> Tensor:
    """HF's RMSNorm (float32 statistics, weight applied in the input dtype), over ``norm``'s weight."""
    eps: float = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-6
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return norm.weight * h.to(dtype)


def _linear(x: Tensor, layer: HFModule) -> Tensor:
    return F.linear(x, layer.weight, layer.bias)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """RoPE tables for ``positions`` ``(B, q)``, as HF computes them; returns two ``(B, q, hd)``."""
    freqs = positions[..., None].float() * inv_freq.float()  # (B, q, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, q, hd)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x (B, q, n, hd); cos/sin (B, q, hd)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


def attention_mask(positions: Tensor, cache_len: int) -> Tensor:
    """Boolean ``(B, q, T)`` mask: query at position p sees the keys at positions ``<= p``."""
    keys = torch.arange(cache_len, device=positions.device)
    return keys[None, None, :] <= positions[:, :, None]


def decoder_layer(
    layer: HFModule,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    mask: Tensor | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> Tensor:
    """One HF-named pre-norm decoder layer over a slot-indexed KV cache.

    Args:
        layer: an HF decoder layer (Llama/Qwen2/Qwen3 names); a missing ``input_layernorm`` is the
            identity (EAGLE's first drafter layer).
        x: ``(B, q, H)`` input hidden states of rows ``0..B-1`` (= cache slots ``0..B-1``).
        cos, sin: ``(B, q, hd)`` RoPE tables of ``positions``.
        positions: ``(B, q)`` absolute positions; the new K/V are written there.
        k_cache, v_cache: ``(S, T, n_kv, hd)`` with ``S >= B``; written in place.
        mask: ``(B, q, T)`` boolean attention mask, or ``None`` for a prefill from position 0, which
            attends causally over the new keys only (``T`` then is ``q``).

    Returns:
        ``(B, q, H)`` output hidden states.
    """
    bsz, q_len, _ = x.shape
    attn = layer.self_attn
    norm_in = getattr(layer, "input_layernorm", None)
    h = rms_norm(x, norm_in) if isinstance(norm_in, nn.Module) else x
    q = _linear(h, attn.q_proj).view(bsz, q_len, num_heads, head_dim)
    k = _linear(h, attn.k_proj).view(bsz, q_len, num_kv_heads, head_dim)
    v = _linear(h, attn.v_proj).view(bsz, q_len, num_kv_heads, head_dim)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before RoPE
        q = rms_norm(q, attn.q_norm)
        k = rms_norm(k, attn.k_norm)
    q = _apply_rope(q, cos, sin)
    k = _apply_rope(k, cos, sin)
    rows = torch.arange(bsz, device=x.device)[:, None].expand(bsz, q_len)
    k_cache.index_put_((rows, positions), k.to(k_cache.dtype))
    v_cache.index_put_((rows, positions), v.to(v_cache.dtype))
    group = num_heads // num_kv_heads
    if mask is None:
        # prefill from position 0: causal over the new keys; right padding never leaks into real rows
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=group > 1
        )  # (B, nh, q, hd)
        out = out.transpose(1, 2)
    else:
        keys = k_cache[:bsz].transpose(1, 2)  # (B, n_kv, T, hd)
        vals = v_cache[:bsz].transpose(1, 2)
        # GQA as extra query rows: (B, q, n_kv, g, hd) -> (B, n_kv, q*g, hd), so any SDPA kernel with a mask works
        qg = q.view(bsz, q_len, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        qg = qg.reshape(bsz, num_kv_heads, q_len * group, head_dim)
        m = mask[:, None, :, None, :].expand(bsz, 1, q_len, group, mask.shape[-1])
        m = m.reshape(bsz, 1, q_len * group, mask.shape[-1])
        out = F.scaled_dot_product_attention(qg, keys.to(qg.dtype), vals.to(qg.dtype), attn_mask=m)
        out = out.view(bsz, num_kv_heads, q_len, group, head_dim).permute(0, 2, 1, 3, 4)
    out = out.reshape(bsz, q_len, num_heads * head_dim)
    x = x + _linear(out, attn.o_proj)
    h = rms_norm(x, layer.post_attention_layernorm)
    mlp = layer.mlp
    return x + _linear(F.silu(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)


@dataclass
class ForwardOutput:
    """What one runner forward returns."""

    logits: Tensor | None
    """``(B, q, V)`` logits (``None`` when not asked for, e.g. a prefill)."""
    hidden: Tensor
    """``(B, q, H)`` final hidden states after the final norm (what EAGLE drafters read)."""
    layer_hidden: dict[int, Tensor]
    """HF ``hidden_states[i]`` for each requested ``i`` (0 = embeddings, i = output of layer i-1)."""


class ModelRunner:
    """Static-shape forward over a supported HF causal LM's own parameters.

    Args:
        model: an HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` (possibly
            wrapped by DDP: ``.module`` is unwrapped).
    """

    def __init__(self, model: nn.Module) -> None:
        # an HF causal LM, whose submodules (model.layers, lm_head, ...) are reached by name
        self.model: Any = unwrap_model(model)
        config = self.model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported by the runner; allowed: {SUPPORTED_MODEL_TYPES}"
            )
        rope_type = _rope_type(config)
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (position-dependent scaling); allowed: {_STATIC_ROPE_TYPES}"
            )
        if not is_supported(self.model):
            raise ValueError(
                f"{type(self.model).__name__} has features the runner does not support "
                "(non-silu activation or sliding-window layers); use the engine's generic fallback"
            )
        self.spec = ModelSpec.from_config(config)
        rotary = self.model.model.rotary_emb
        self._rotary: Any = rotary
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def inv_freq(self) -> Tensor:
        return self._rotary.inv_freq

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    def embed(self, tokens: Tensor) -> Tensor:
        """``(B, q)`` token ids -> ``(B, q, H)`` embeddings (the policy's own table)."""
        return F.embedding(tokens, self.model.model.embed_tokens.weight)

    def lm_head(self, hidden: Tensor) -> Tensor:
        """``(..., H)`` final hidden states -> ``(..., V)`` logits."""
        return F.linear(hidden, self.model.lm_head.weight, getattr(self.model.lm_head, "bias", None))

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        k_cache: Sequence[Tensor],
        v_cache: Sequence[Tensor],
        *,
        prefill: bool = False,
        logits: bool = True,
        capture_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run ``q`` tokens per row through the model, reading and writing the KV cache.

        Args:
            tokens: ``(B, q)`` token ids; row ``i`` uses cache slot ``i``.
            positions: ``(B, q)`` absolute positions (decode: the row's cache length).
            k_cache, v_cache: per layer ``(S, T, n_kv, hd)`` with ``S >= B`` (separate tensors,
                see `lightning_tlt.core.kv_cache`).
            prefill: the rows start at position 0 (``positions == arange(q)``): attention is causal
                over the new keys only, which is cheaper than attending over the whole cache.
            logits: also compute the LM head.
            capture_layers: HF ``hidden_states`` indices to return (EAGLE-3 features).

        Returns:
            `ForwardOutput` with ``logits`` ``(B, q, V)``, ``hidden`` ``(B, q, H)``.
        """
        spec = self.spec
        x = self.embed(tokens)  # (B, q, H)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scaling, x.dtype)
        mask = None if prefill else attention_mask(positions, k_cache[0].shape[1])
        layer_hidden: dict[int, Tensor] = {}
        if 0 in capture_layers:
            layer_hidden[0] = x
        for i, layer in enumerate(self.layers):
            x = decoder_layer(
                layer, x, cos, sin, positions, k_cache[i], v_cache[i], mask,
                num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            )
            if i + 1 in capture_layers and i + 1 < spec.num_layers:
                layer_hidden[i + 1] = x
        hidden = rms_norm(x, self.model.model.norm)
        if spec.num_layers in capture_layers:
            layer_hidden[spec.num_layers] = hidden  # HF's last hidden_states entry is after the norm
        return ForwardOutput(self.lm_head(hidden) if logits else None, hidden, layer_hidden)
