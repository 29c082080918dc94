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
- Attention over the cache is `lightning_tlt.core.attention.cached_attention`: one path for decode
  (one query row a slot) and verify (``k + 1`` rows, causal inside the block), reading each row's
  own length (the Triton flash-decoding kernel on CUDA) or a masked SDPA over the first ``kv_len``
  positions (the CPU path and the fallback).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tlt.core.attention import ATTENTION_BACKENDS, cached_attention
from lightning_tlt.core.stored_compile import FrozenViewCache

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HFModule",
    "unwrap_model",
    "is_supported",
    "ModelSpec",
    "rms_norm",
    "rope_cos_sin",
    "apply_rope",
    "decoder_layer",
    "FusedProjections",
    "eos_token_ids",
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


def eos_token_ids(model: nn.Module) -> list[int]:
    """The model's eos id(s): ``generation_config.eos_token_id``, else ``config.eos_token_id`` (the
    one resolver every engine uses)."""
    model = unwrap_model(model)
    for holder in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(holder, "eos_token_id", None)
        if eos is not None:
            return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return []


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


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotate-half RoPE: ``x`` ``(B, q, n, hd)``, ``cos``/``sin`` ``(B, q, hd)``."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decoder_layer(
    layer: HFModule, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor | None,
    v_cache: Tensor | None, **options: Any,
) -> Tensor:
    """One HF-named pre-norm decoder layer over a slot-indexed KV cache: `decoder_layer_split` (whose keyword
    options ``options`` are) without a residual to add first, its two outputs summed."""
    x, mlp_out = decoder_layer_split(layer, x, None, cos, sin, positions, k_cache, v_cache, **options)
    return x + mlp_out


def decoder_layer_split(
    layer: HFModule,
    x: Tensor,
    delta: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor | None,
    v_cache: Tensor | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    prefill: bool = False,
    attention: str = "auto",
    kv_len: int | None = None,
    hole: Tensor | None = None,
    mask: Tensor | None = None,
    fused: FusedProjections | None = None,
) -> tuple[Tensor, Tensor]:
    """One HF-named pre-norm decoder layer over a slot-indexed KV cache, its residual stream split in two.

    The layer's input is ``x + delta`` (``delta`` ``None``: ``x``) and its output the sum of the two
    tensors returned: the stream after attention, and the MLP's output. A layer compiled on its own
    (the engine's regional compile, `lightning_tlt.rollout.steps.PolicyRegions`) thus adds the
    previous layer's MLP output inside the same kernel as its own input norm, as one graph over every
    layer would.

    Args:
        layer: an HF decoder layer (Llama/Qwen2/Qwen3 names); a missing ``input_layernorm`` is the
            identity (EAGLE's first drafter layer).
        x: ``(B, q, H)`` input hidden states of rows ``0..B-1`` (= cache slots ``0..B-1``).
        delta: ``(B, q, H)`` added to ``x`` first (the previous layer's MLP output), or ``None``.
        cos, sin: ``(B, q, hd)`` RoPE tables of ``positions``.
        positions: ``(B, q)`` absolute positions; the new K/V are written there.
        k_cache, v_cache: ``(S, T, n_kv, hd)`` with ``S >= B``; written in place. ``None`` with
            ``prefill``: no cache (a training forward, e.g. the EAGLE drafter's).
        prefill: attend causally over the new keys only (rows starting at position 0, or a
            training window: right padding never leaks into real rows).
        attention: the `lightning_tlt.core.attention` backend of the cached path.
        kv_len: an upper bound on every row's length (the SDPA path reads only that many positions).
        hole: ``(B, 2)`` ``[lo, hi)`` of cached positions each row does not see (EAGLE history), or ``None``.
        mask: with ``prefill``, a ``(B, q, q)`` bool (query, key) mask replacing the causal one
            (rows packing several sequences), or ``None``.

    Returns:
        two ``(B, q, H)``: the stream after attention and the MLP's output (their sum: the layer's output).
    """
    if delta is not None:
        x = x + delta
    bsz, q_len, _ = x.shape
    attn = layer.self_attn
    norm_in = getattr(layer, "input_layernorm", None)
    h = rms_norm(x, norm_in) if isinstance(norm_in, nn.Module) else x
    if fused is not None:  # one GEMM for q, k and v (the weights' copy `FusedProjections` keeps)
        # split, then each part reshaped. With this form and RoPE's positions cast after the new axis, an H100
        # compiled one version of each region for a decode's one-token query and a verify's k + 1 (cold_start
        # at a252ad3); with the heads split after one view and the positions cast first, two of each, and two
        # of the drafter's catch-up (at 9806f03). Which of the two changes did it was not isolated.
        qkv = F.linear(h, fused.qkv_weight, fused.qkv_bias)
        q_, k_, v_ = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), -1)
        q = q_.reshape(bsz, q_len, num_heads, head_dim)
        k = k_.reshape(bsz, q_len, num_kv_heads, head_dim)
        v = v_.reshape(bsz, q_len, num_kv_heads, head_dim)
    else:
        q = _linear(h, attn.q_proj).view(bsz, q_len, num_heads, head_dim)
        k = _linear(h, attn.k_proj).view(bsz, q_len, num_kv_heads, head_dim)
        v = _linear(h, attn.v_proj).view(bsz, q_len, num_kv_heads, head_dim)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before RoPE
        q = rms_norm(q, attn.q_norm)
        k = rms_norm(k, attn.k_norm)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    if k_cache is not None and v_cache is not None:
        rows = torch.arange(bsz, device=x.device)[:, None].expand(bsz, q_len)
        k_cache.index_put_((rows, positions), k.to(k_cache.dtype))
        v_cache.index_put_((rows, positions), v.to(v_cache.dtype))
    if prefill:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=mask is None,
            attn_mask=None if mask is None else mask[:, None], enable_gqa=num_heads != num_kv_heads,
        ).transpose(1, 2)  # (B, q, nh, hd)
    else:
        assert k_cache is not None and v_cache is not None, "decode and verify attend over a cache"
        out = cached_attention(q, k_cache, v_cache, positions, backend=attention, kv_len=kv_len, hole=hole)
    out = out.reshape(bsz, q_len, num_heads * head_dim)
    x = x + _linear(out, attn.o_proj)
    h = rms_norm(x, layer.post_attention_layernorm)
    mlp = layer.mlp
    if fused is not None:  # one GEMM for gate and up
        gate, up = F.linear(h, fused.gate_up_weight, fused.gate_up_bias).chunk(2, -1)
        return x, _linear(F.silu(gate) * up, mlp.down_proj)
    return x, _linear(F.silu(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)


class FusedProjections:
    """One layer's q|k|v and gate|up weights, concatenated: a copy the engine refreshes every call.

    At batch 1 a decode step's GEMVs are bound by launches, not bytes (H200, 0.4 B: 174 launches of
    about 4.7 us, each under 2 us of bytes; `docs/benchmarks.md`): one GEMM for q, k, v and one for
    gate, up remove 3 of the 7 a layer. The price is a copy of those weights (about half the
    layer's), which `sync` rewrites in place (the fused tensors keep their addresses, so captured
    graphs stay valid). It copies unconditionally: a parameter's version counter is no signal of
    change (the fused AdamW step updates parameters without advancing it), and the copy, once per
    ``generate``, is a fraction of a millisecond on a GPU.
    """

    def __init__(self, layer: HFModule) -> None:
        self._layer = layer
        groups = self._groups()
        for group, names in ((groups[1], "q, k and v"), (groups[3], "gate and up")):
            if any(b is None for b in group) and any(b is not None for b in group):
                raise ValueError(f"{names} projections must all have biases or none to be fused")
        with torch.no_grad():  # biases: None where the layer has none (Llama's mlp_bias, Qwen2's q/k/v)
            fused = [torch.cat(cast(list[Tensor], g)) if g[0] is not None else None for g in groups]
        self.qkv_weight: Tensor = cast(Tensor, fused[0])
        self.qkv_bias: Tensor | None = fused[1]
        self.gate_up_weight: Tensor = cast(Tensor, fused[2])
        self.gate_up_bias: Tensor | None = fused[3]

    def _groups(self) -> list[list[Tensor | None]]:
        """The layer's current tensors, in the order of the fused ones: q|k|v weights, their
        biases, gate|up weights, their biases."""
        attn, mlp = self._layer.self_attn, self._layer.mlp
        return [
            [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
            [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias],
            [mlp.gate_proj.weight, mlp.up_proj.weight],
            [getattr(mlp.gate_proj, "bias", None), getattr(mlp.up_proj, "bias", None)],
        ]

    def _fused(self) -> list[Tensor | None]:
        return [self.qkv_weight, self.qkv_bias, self.gate_up_weight, self.gate_up_bias]

    def matches(self, layer: HFModule) -> bool:
        """Whether these are ``layer``'s, and its weights still have their device, dtype and shapes."""
        if layer is not self._layer:
            return False
        qkv, _, gate_up, _ = self._groups()
        w = cast(Tensor, qkv[0])
        rows = sum(cast(Tensor, t).shape[0] for t in qkv), sum(cast(Tensor, t).shape[0] for t in gate_up)
        return (w.device == self.qkv_weight.device and w.dtype == self.qkv_weight.dtype
                and (self.qkv_weight.shape[0], self.gate_up_weight.shape[0]) == rows)  # fmt: skip

    def sync(self) -> None:
        """Copy the layer's current weights into the fused tensors, in place (its parameters may
        have been updated in place or replaced since)."""
        with torch.no_grad():
            for fused, group in zip(self._fused(), self._groups()):
                if fused is not None:
                    torch.cat(cast(list[Tensor], group), out=fused)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._fused() if t is not None)


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
        attention: the cached-attention backend (`lightning_tlt.core.attention.ATTENTION_BACKENDS`);
            ``"auto"``: the Triton kernel on CUDA, masked SDPA on the CPU.
        fuse_projections: no-grad forwards run q|k|v and gate|up as one GEMM each over copies of
            those weights (`FusedProjections`), built at the first such forward. The copies change
            only in `sync_fused`: the engine calls it at every ``generate``; any other caller calls
            it after the policy's weights change.
    """

    def __init__(self, model: nn.Module, attention: str = "auto", fuse_projections: bool = False) -> None:
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        self.attention = attention
        self.fuse_projections = fuse_projections
        self._fused: list[FusedProjections] | None = None
        self._origin: ModelRunner | None = None  # a `frozen` view's runner (which holds the fused copies)
        self._views = FrozenViewCache()  # the policy's frozen view, which `frozen`'s runner reads
        self._view: ModelRunner | None = None  # `frozen`'s
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

    def frozen(self) -> ModelRunner:
        """This runner over a `lightning_tlt.core.stored_compile.frozen_view` of its policy: what the engine's
        compiled steps take, so that the policy's autograd state (``requires_grad``, a ``.grad`` after an
        optimizer step) neither gives them versions of their own (a policy decoded as it trains against a copy
        of it: three regions compiled again) nor keeps those versions from being stored. The same view while
        the policy's storage is the same (an optimizer's in-place steps show through it); the fused weight
        copies stay this runner's."""
        if self._origin is not None:
            return self
        model: Any = self._views(self.model)
        if self._view is None or self._view.model is not model:
            view = copy.copy(self)
            view.model, view._rotary = model, model.model.rotary_emb
            view._origin, view._view = self, None
            self._view = view
        return self._view

    def sync_fused(self) -> None:
        """With ``fuse_projections``: build the fused weights, or copy the policy's current ones into them.

        Run on the host before a forward, never inside a captured graph or a compiled region: the
        engine calls it at the start of every ``generate`` (the policy may have trained since); an
        eager `forward` builds them on first use.
        """
        if self._origin is not None:  # a view: the copies are its runner's, of its runner's layers
            self._origin.sync_fused()
            return
        if not self.fuse_projections:
            return
        layers = list(self.layers)
        if self._fused is None or len(self._fused) != len(layers) or not all(
            f.matches(layer) for f, layer in zip(self._fused, layers)
        ):  # first use, or the policy moved (``.to()``, new layers): new tensors (graphs of the old ones are void)
            self._fused = [FusedProjections(layer) for layer in layers]
        else:
            for fused in self._fused:
                fused.sync()

    def layer_fusions(self) -> Sequence[FusedProjections | None]:
        """What a forward's layers run on: the fused weight copies (`fuse_projections`, no-grad forwards: a
        training forward keeps autograd's path through the policy's own weights), else ``None`` per layer.

        Built here on a first eager use; a compiled or captured forward raises instead (the engine builds
        them before its steps, at every ``generate``).
        """
        if not self.fuse_projections or torch.is_grad_enabled():
            return [None] * self.spec.num_layers
        owner = self._origin or self
        if owner._fused is None:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if torch.compiler.is_compiling() or capturing:
                raise RuntimeError("ModelRunner.sync_fused() must run before a compiled or captured forward")
            owner.sync_fused()
        assert owner._fused is not None
        return owner._fused

    @property
    def fused(self) -> tuple[FusedProjections, ...] | None:
        """The fused weight copies, one per layer (``None`` before `sync_fused` built them, or without
        ``fuse_projections``)."""
        fused = (self._origin or self)._fused
        return None if fused is None else tuple(fused)

    @property
    def fused_bytes(self) -> int:
        """Bytes of the fused weight copies (0 without ``fuse_projections``)."""
        return sum(f.nbytes for f in (self._origin or self)._fused or [])

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
        kv_len: int | None = None,
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
            kv_len: an upper bound on every row's length after this call (the SDPA attention
                path reads only that many cached positions); ``None``: the whole cache.

        Returns:
            `ForwardOutput` with ``logits`` ``(B, q, V)``, ``hidden`` ``(B, q, H)``.
        """
        spec = self.spec
        fused = self.layer_fusions()
        x = self.embed(tokens)  # (B, q, H)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scaling, x.dtype)
        layer_hidden: dict[int, Tensor] = {}
        if 0 in capture_layers:
            layer_hidden[0] = x
        for i, layer in enumerate(self.layers):
            x = decoder_layer(
                layer, x, cos, sin, positions, k_cache[i], v_cache[i],
                num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                prefill=prefill, attention=self.attention, kv_len=kv_len, fused=fused[i],
            )
            if i + 1 in capture_layers and i + 1 < spec.num_layers:
                layer_hidden[i + 1] = x
        hidden = rms_norm(x, self.model.model.norm)
        if spec.num_layers in capture_layers:
            layer_hidden[spec.num_layers] = hidden  # HF's last hidden_states entry is after the norm
        return ForwardOutput(self.lm_head(hidden) if logits else None, hidden, layer_hidden)
