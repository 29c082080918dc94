"""A one-layer EAGLE drafter over the policy's hidden states (EAGLE-1, with an EAGLE-3 option).

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty")
drafts at the feature level: one decoder layer maps ``fc([embed(token) ; feature])`` to the next
feature, and the policy's own LM head turns a feature into next-token logits. TLT (arXiv
2511.16665) co-trains such a drafter during RL; this is its module.

Alignment convention (vLLM's, ``v1/spec_decode/eagle.py``; a drafter trained otherwise does not
work in vLLM): for a sequence ``x_0 .. x_{T-1}`` with policy features ``h_t`` (the last hidden
state after the final norm at position t, HF ``hidden_states[-1]``, which predicts ``x_{t+1}``),

    draft row t gets  feature h_t,  the embedding of token x_{t+1},  position t,
    and predicts      the feature h_{t+1};  lm_head(prediction) gives the distribution of x_{t+2}.

So the features are not shifted and the token ids are shifted left by one (`align_for_eagle`
does it). When drafting, the newest row pairs the last verified feature with the token just
sampled from it; each next draft row pairs the drafter's own predicted feature with the token
drafted from it, at the next position.

The drafter shares the policy's ``embed_tokens`` and ``lm_head`` by reference: they are not
registered as its parameters (not in its ``state_dict``, not seen by its optimizer, never copied
into or out of the policy) and are read detached, so the drafter's loss never reaches the policy's
weights while the policy itself keeps training them.

The layer follows HF Llama names, which are vLLM's EAGLE-1 draft names: ``fc``, ``layers.0.
self_attn.{q,k,v,o}_proj`` (with biases when the target has q/k/v biases, as Qwen2: Llama's
``attention_bias`` then also adds one to ``o_proj``), no ``input_layernorm`` (identity, vLLM's
choice for layer 0), ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``, and no final norm.
`EagleDrafter.layer_forward` runs ``layers[0]`` through `lightning_tlt.core.runner.decoder_layer`,
the policy's own layer function: causal over a training window (`EagleDrafter.forward`), or
against the drafter's KV cache in the engine's draft steps.

EAGLE-3 option (Li et al. 2025, "EAGLE-3"): with ``feature_layers=(low, mid, high)`` the features
are the concatenation of those three HF ``hidden_states`` (``3H`` wide), fused by ``fuse: Linear(3H
-> H)`` before ``fc``; the drafter's own predicted features (``H`` wide) skip the fusion.
"""

from __future__ import annotations

import copy as copy_module
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import LlamaConfig

from lightning_tlt.core.runner import decoder_layer, rms_norm, rope_cos_sin, unwrap_model
from lightning_tlt.core.sampling import processed_probs, sample
from lightning_tlt.drafters.eagle_batch import EagleBatch as EagleBatch
from lightning_tlt.drafters.eagle_batch import align_for_eagle as align_for_eagle

SAFETENSORS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's EAGLE-3 auxiliary layers ``(2, L // 2, L - 3)`` as HF ``hidden_states`` indices, clamped to ``[0, L]``."""
    return tuple(min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3))  # type: ignore[return-value]


class _RMSNorm(nn.Module):
    """HF's RMSNorm parameters (``weight``, ``variance_epsilon``), applied by `runner.rms_norm`."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class EagleDecoderLayer(nn.Module):
    """A Llama decoder layer without ``input_layernorm`` (HF/vLLM parameter names)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        heads = int(config.num_attention_heads)
        self.self_attn = _Attention(
            config.hidden_size,
            heads,
            int(config.num_key_value_heads or heads),
            int(config.head_dim or config.hidden_size // heads),
            config.attention_bias,
        )
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config.hidden_size, config.intermediate_size)


def _embedding_and_head(model: nn.Module) -> tuple[Any, Any]:
    """An HF causal LM's input embedding and LM head (wrappers unwrapped): what a drafter shares with it
    (typed loosely, as the drafter holds them)."""
    hf: Any = unwrap_model(model)
    return hf.model.embed_tokens, hf.lm_head


class EagleDrafter(nn.Module):
    """One-layer EAGLE drafter sharing the policy's embedding and LM head (by reference, detached).

    Build with `from_target` (or `from_pretrained` for an exported one); the constructor takes the
    drafter's ``LlamaConfig`` and the shared modules.

    Args:
        config: the drafter's config (``num_hidden_layers = 1``, the target's sizes).
        embed_tokens: the policy's input embedding module (read, never registered or trained).
        lm_head: the policy's output head module (read, never registered or trained).
        rotary_inv_freq: the target's RoPE inverse frequencies ``(head_dim / 2,)``.
        rope_scaling: the target's RoPE ``attention_scaling``.
        feature_layers: EAGLE-3's three HF ``hidden_states`` indices, or ``None`` for EAGLE-1.
        generator: initialisation randomness (``None``: torch's default generator, like ``nn.Linear``).
        dtype: of the drafter's own weights; ``None``: the shared embedding's.
    """

    name: str = "eagle"
    needs_features: bool = True
    runs_on_device: bool = True  # the engine runs its layer inside the step's graph (`DrafterBase`)
    inv_freq: Tensor
    _embed_tokens: Any  # the policy's modules (shared, not registered)
    _lm_head: Any

    def __init__(
        self,
        config: LlamaConfig,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        rotary_inv_freq: Tensor,
        rope_scaling: float = 1.0,
        feature_layers: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(
                f"an EAGLE drafter has one decoder layer, got num_hidden_layers={config.num_hidden_layers}"
            )
        if feature_layers is not None and len(feature_layers) != 3:
            raise ValueError(
                f"feature_layers must be three hidden_states indices (low, mid, high), got {feature_layers!r}"
            )
        self.config = config
        hidden = config.hidden_size
        self.feature_layers: tuple[int, ...] | None = (
            None if feature_layers is None else tuple(feature_layers)
        )
        self.fuse = nn.Linear(3 * hidden, hidden, bias=False) if self.feature_layers else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([EagleDecoderLayer(config)])
        # shared with the policy by reference; object.__setattr__ keeps them out of the module tree
        object.__setattr__(self, "_embed_tokens", embed_tokens)
        object.__setattr__(self, "_lm_head", lm_head)
        self.register_buffer("inv_freq", rotary_inv_freq.detach().clone().float(), persistent=False)
        self.rope_scaling = float(rope_scaling)
        self._init_weights(generator)
        weight: Tensor = embed_tokens.weight  # type: ignore[assignment]
        self.to(device=weight.device, dtype=dtype or weight.dtype)
        self.inv_freq = self.inv_freq.float()

    def _init_weights(self, generator: torch.Generator | None) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.normal_(0.0, std, generator=generator)
                    if module.bias is not None:
                        module.bias.zero_()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(
        cls,
        model: nn.Module,
        *,
        feature_layers: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
    ) -> EagleDrafter:
        """A cold drafter for an HF Llama / Qwen2 / Qwen3 policy, sharing its embedding and LM head.

        Args:
            model: the policy (DDP-style ``.module`` wrappers are unwrapped), or the whole copy of a
                sharded one whose embedding and head the drafter reads (the engine's inference copy).
            feature_layers: EAGLE-3's three HF ``hidden_states`` indices (e.g.
                `default_eagle3_layers`), or ``None`` for EAGLE-1 (the last hidden state).
            generator: initialisation randomness.
            dtype: of the drafter's own weights; ``None``: the policy's.
        """
        hf: Any = unwrap_model(model)  # an HF causal LM: attributes typed loosely on purpose
        target = hf.config
        num_layers = int(target.num_hidden_layers)
        if feature_layers is not None and any(not 0 <= i <= num_layers for i in feature_layers):
            raise ValueError(
                f"feature_layers must be hidden_states indices in [0, {num_layers}], got {feature_layers!r}"
            )
        config = drafter_config(target)
        rotary = hf.model.rotary_emb
        return cls(
            config,
            *_embedding_and_head(hf),
            rotary.inv_freq,
            float(getattr(rotary, "attention_scaling", 1.0)),
            feature_layers,
            generator,
            dtype,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, target_model: nn.Module) -> EagleDrafter:
        """Load a directory written by `save_pretrained`, sharing ``target_model``'s embedding and head."""
        path = Path(path)
        saved = json.loads((path / CONFIG_NAME).read_text())
        model = unwrap_model(target_model)
        drafter = cls.from_target(model, feature_layers=saved.get("eagle_feature_layers"))
        for key in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
        ):
            if saved.get(key) != getattr(drafter.config, key):
                raise ValueError(
                    f"drafter at {str(path)!r} has {key}={saved.get(key)!r}, the target needs {getattr(drafter.config, key)!r}"
                )
        state = load_file(str(path / SAFETENSORS_NAME), device=str(drafter.fc.weight.device))
        drafter.load_state_dict({k: v.to(drafter.fc.weight.dtype) for k, v in state.items()}, strict=True)
        return drafter

    def save_pretrained(self, path: str | Path) -> Path:
        """Write vLLM's EAGLE-1 draft layout: ``config.json`` (a ``LlamaForCausalLM`` config of one
        layer, the target's sizes) and ``model.safetensors`` (``fc.weight`` and ``layers.0.*``; no
        ``input_layernorm``, no embedding, no LM head). Load it with ``speculative_config={"method":
        "eagle", "model": path, ...}`` or `from_pretrained`. An EAGLE-3 drafter also writes
        ``fuse.weight`` and ``eagle_feature_layers`` (for this kit; vLLM's EAGLE-1 loader does not
        read them)."""
        return write_eagle_dir(path, self.config.to_dict(), self.state_dict(), self.feature_layers)

    def same_layout(self, other: EagleDrafter) -> bool:
        """Whether ``other`` has this drafter's weight names and shapes (`copy_weights_from` takes it)."""
        mine, theirs = self.state_dict(), other.state_dict()
        return mine.keys() == theirs.keys() and all(mine[k].shape == theirs[k].shape for k in mine)

    @torch.no_grad()
    def copy_weights_from(self, other: EagleDrafter) -> None:
        """``other``'s weights into this drafter's tensors, in place (CUDA graphs captured with them stay valid)."""
        weights = other.state_dict()
        for name, tensor in self.state_dict().items():
            tensor.copy_(weights[name])

    def inference_copy(self, dtype: torch.dtype | None = None, target: nn.Module | None = None) -> EagleDrafter:
        """A frozen (no grad, eval) copy of the drafter's own weights, sharing the same embedding and head.

        What an engine drafts with while this one trains (`lightning_tlt.callbacks.drafter_cotrain`).
        ``dtype``: of the copy; ``None`` takes the policy's (the shared embedding's), so a drafter
        trained with float32 master weights drafts in the policy's bf16. ``target``: the model whose
        embedding and head the copy shares instead (an engine's: the policy's copy it decodes with), of the
        same vocabulary and width.
        """
        embed, head = self._embed_tokens, self._lm_head
        if target is not None:
            embed, head = _embedding_and_head(target)
            if embed.weight.shape != self._embed_tokens.weight.shape:
                raise ValueError(f"target's embedding is {tuple(embed.weight.shape)}, the drafter's policy's "
                                 f"{tuple(self._embed_tokens.weight.shape)}: a copy shares a model of the same "
                                 "vocabulary and width")
        copy = EagleDrafter(
            self.config,
            embed,
            head,
            self.inv_freq,
            self.rope_scaling,
            self.feature_layers,
        )
        copy.load_state_dict(self.state_dict())
        copy.to(device=self.fc.weight.device, dtype=dtype or self.embed_weight.dtype)
        copy.inv_freq = copy.inv_freq.float()
        copy.requires_grad_(False)
        return copy.eval()

    def shares(self, target: nn.Module) -> bool:
        """Whether this drafter reads ``target``'s own embedding and head (the modules, not equal copies)."""
        embed, head = _embedding_and_head(target)
        return self._embed_tokens is embed and self._lm_head is head

    def __deepcopy__(self, memo: dict[int, object]) -> EagleDrafter:
        # a deep copy must not copy the policy's embedding and head (they are shared, not owned)
        memo[id(self._embed_tokens)] = self._embed_tokens
        memo[id(self._lm_head)] = self._lm_head
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy_module.deepcopy(value, memo)
        return new

    # ------------------------------------------------------------------ shared weights
    @property
    def embed_weight(self) -> Tensor:
        """The policy's embedding matrix ``(V, H)``, detached (same storage, no gradient)."""
        return self._embed_tokens.weight.detach()

    @property
    def lm_head_weight(self) -> Tensor:
        """The policy's LM head matrix ``(V, H)``, detached (same storage, no gradient)."""
        return self._lm_head.weight.detach()

    @property
    def num_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.num_key_value_heads or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.config.head_dim or self.config.hidden_size // self.num_heads)

    @property
    def layer(self) -> EagleDecoderLayer:
        """The decoder layer, ``layers[0]`` (what `lightning_tlt.core.runner.decoder_layer` runs)."""
        return cast(EagleDecoderLayer, self.layers[0])

    # ------------------------------------------------------------------ forward
    def input_hidden(self, features: Tensor, input_ids: Tensor) -> Tensor:
        """The layer's input ``fc([embed(input_ids) ; features])``: ``(B, T, F)``, ``(B, T)`` -> ``(B, T, H)``.

        EAGLE-3 features (``3H`` wide) are fused first; ``H``-wide features (EAGLE-1, or the
        drafter's own predictions when chaining) go in as they are.
        """
        if self.fuse is not None and features.shape[-1] == 3 * self.config.hidden_size:
            features = self.fuse(features)
        emb = F.embedding(input_ids, self.embed_weight).to(features.dtype)  # (B, T, H)
        return self.fc(torch.cat([emb, features], dim=-1))

    def forward(
        self,
        features: Tensor,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Full-sequence causal forward (training, and the reference for the cached path).

        Args:
            features: ``(B, T, F)`` ``h_t`` per row (see the alignment convention).
            input_ids: ``(B, T)`` ``x_{t+1}``: the token after each feature's position.
            position_ids: ``(B, T)`` ``t``, the feature's position (RoPE).
            attention_mask: ``(B, T)`` 1 for real rows, 0 for padding, padding on the right (causal
                attention keeps it out of every real row, so it is not applied: no host sync,
                capturable); or a ``(B, T, T)`` bool keep-mask (query, key) for rows that pack
                several sequences (block-causal; every row also sees itself); ``None``: all real.

        Returns:
            ``(B, T, H)`` predicted next features (no final norm; `logits` maps them to tokens).
        """
        x = self.input_hidden(features, input_ids)  # (B, T, H)
        keep = None
        if attention_mask is not None and attention_mask.dim() == 3:  # packed rows: block-causal
            eye = torch.eye(x.shape[1], dtype=torch.bool, device=x.device)[None]
            keep = attention_mask.bool() | eye  # padding rows see themselves (no empty softmax row)
        return self.layer_forward(x, position_ids, keep=keep)

    def layer_forward(
        self,
        x: Tensor,
        position_ids: Tensor,
        k_cache: Tensor | None = None,
        v_cache: Tensor | None = None,
        *,
        prefill: bool = True,
        attention: str = "auto",
        hole: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        keep: Tensor | None = None,
    ) -> Tensor:
        """The decoder layer over layer inputs ``x`` (``(B, T, H)``, from `input_hidden`).

        The one implementation of the drafter's layer: `lightning_tlt.core.runner.decoder_layer`,
        causal over the rows given (training, and the engine's drafter prefill) or over a KV cache
        (``prefill=False``: the engine's catch-up and chained draft steps, with the history hole).

        Args:
            x: ``(B, T, H)`` layer inputs; ``position_ids``: ``(B, T)`` their positions.
            k_cache, v_cache: the drafter's ``(S, T_max, n_kv, hd)`` cache, written at
                ``position_ids`` (``None``: no cache).
            prefill: causal over the given rows only; else attention over the cache.
            attention: the cached-attention backend.
            hole: ``(B, 2)`` ``[lo, hi)`` cached positions not seen, or ``None``.
            rope: precomputed ``(cos, sin)`` of ``position_ids`` (the engine computes a whole
                draft chain's once), or ``None``.
            keep: ``(B, T, T)`` bool (query, key) mask replacing the causal one (packed rows), or ``None``.
        """
        cos, sin = rope if rope is not None else rope_cos_sin(position_ids, self.inv_freq, self.rope_scaling, x.dtype)
        return decoder_layer(
            self.layer, x, cos, sin, position_ids, k_cache, v_cache,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            prefill=prefill, attention=attention, hole=hole, mask=keep,
        )  # fmt: skip

    def logits(self, features: Tensor, rows: Tensor | None = None) -> Tensor:
        """Next-token logits of predicted features through the policy's LM head: ``(..., H)`` -> ``(..., V)``,
        or through its ``rows`` only (``(Vd,)`` long ids, a draft vocabulary): ``(..., Vd)``, column ``j``
        the logit of token ``rows[j]``."""
        weight, bias = self.lm_head_weight, getattr(self._lm_head, "bias", None)
        bias = None if bias is None else bias.detach()
        if rows is not None:
            weight = weight.index_select(0, rows)
            bias = None if bias is None else bias.index_select(0, rows)
        return F.linear(features, weight.to(features.dtype), None if bias is None else bias.to(features.dtype))

    # ------------------------------------------------------------------ reference drafting
    @torch.no_grad()
    def draft(
        self,
        features: Tensor,
        tokens: Tensor,
        k: int,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Chain-draft k tokens per row without a cache (the reference the engine's cached path matches).

        Args:
            features: ``(B, T, F)`` the policy's features at positions ``0..T-1`` (all real).
            tokens: ``(B, T + 1)`` the tokens ``x_0..x_T``; ``x_T`` was just sampled from ``h_{T-1}``.
            k: tokens to draft.
            temperature, top_k, top_p: the sampling settings (the same as the policy's).
            generator: sampling randomness.

        Returns:
            ``(B, k)`` drafted tokens and ``(B, k, V)`` the processed distributions they were drawn
            from (one-hot at temperature 0), as `lightning_tlt.rollout.verify.verify_chain` takes them.
        """
        bsz, seq = tokens.shape[0], tokens.shape[1] - 1
        if features.shape[:2] != (bsz, seq):
            raise ValueError(
                f"features must be (B, T, F) with tokens (B, T + 1), got {tuple(features.shape)} and {tuple(tokens.shape)}"
            )
        positions = torch.arange(seq + k, device=tokens.device).expand(bsz, seq + k)
        feats = (
            self.fuse(features)
            if self.fuse is not None and features.shape[-1] != self.config.hidden_size
            else features
        )
        inputs = tokens[:, 1:]  # (B, T)
        drafted, probs = [], []
        for j in range(k):
            pred = self.forward(feats, inputs, positions[:, : seq + j])  # (B, T + j, H)
            q = processed_probs(self.logits(pred[:, -1]), temperature, top_k, top_p)  # (B, V)
            d = sample(q, generator)  # (B,)
            drafted.append(d)
            probs.append(q)
            feats = torch.cat([feats, pred[:, -1:]], dim=1)
            inputs = torch.cat([inputs, d[:, None]], dim=1)
        return torch.stack(drafted, 1), torch.stack(probs, 1)


def write_eagle_dir(
    path: str | Path,
    config: dict[str, Any],
    state_dict: Mapping[str, Tensor],
    feature_layers: Sequence[int] | None = None,
) -> Path:
    """Write an EAGLE draft directory from a drafter's config dict and weights (`EagleDrafter.save_pretrained`).

    Used directly by `lightning_tlt.drafters.export` to export from a checkpoint without the policy.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    for key in ("layer_types", "transformers_version", "_name_or_path", "eagle_feature_layers"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["model_type"] = "llama"
    config["num_hidden_layers"] = 1
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    config["dtype"] = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    if feature_layers is not None:
        config["eagle_feature_layers"] = list(feature_layers)
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(path / SAFETENSORS_NAME), metadata={"format": "pt"})
    # safetensors writes 0600; a drafter is meant to be read by others (a vLLM server's user): the mode open()
    # gives (0644 under umask 022)
    (path / SAFETENSORS_NAME).chmod(0o666 & ~process_umask())
    return path


def process_umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    return umask


def drafter_config(target: object) -> LlamaConfig:
    """The EAGLE-1 drafter's ``LlamaConfig`` for an HF Llama / Qwen2 / Qwen3 target config.

    One layer of the target's sizes and RoPE; ``attention_bias`` true when the target has q/k/v
    biases (Qwen2); ``tie_word_embeddings`` false (the head is the target's).
    """
    model_type = getattr(target, "model_type", None)
    if model_type not in ("llama", "qwen2", "qwen3"):
        raise ValueError(
            f"EAGLE drafters support Llama, Qwen2 and Qwen3 targets, got model_type {model_type!r}"
        )
    hidden = int(target.hidden_size)  # type: ignore[attr-defined]
    heads = int(target.num_attention_heads)  # type: ignore[attr-defined]
    head_dim = int(getattr(target, "head_dim", None) or hidden // heads)
    bias = model_type == "qwen2" or bool(getattr(target, "attention_bias", False))
    config = LlamaConfig(
        vocab_size=int(target.vocab_size),  # type: ignore[attr-defined]
        hidden_size=hidden,
        intermediate_size=int(target.intermediate_size),  # type: ignore[attr-defined]
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(target, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(getattr(target, "max_position_embeddings", 4096)),
        rms_norm_eps=float(getattr(target, "rms_norm_eps", 1e-6)),
        rope_parameters=dict(
            getattr(target, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        ),
        attention_bias=bias,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=getattr(target, "bos_token_id", None),
        eos_token_id=getattr(target, "eos_token_id", None),
        pad_token_id=getattr(target, "pad_token_id", None),
    )
    config.architectures = ["LlamaForCausalLM"]
    return config
