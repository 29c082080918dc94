"""Token log-probabilities from the final hidden states, a chunk of tokens at a time.

The training forward needs, per completion token, ``log softmax(h W^T / T)[target]`` and the
entropy of that distribution. Computing it from the model's ``(B, C, V)`` logits holds the bf16
logits, a float32 copy, the float32 ``log_softmax`` saved for backward and their gradients: at
16,384 tokens and Qwen2's 151,936 entries each float32 copy is 10 GB. `chunked_token_logprobs`
applies the LM head itself, ``chunk_tokens`` rows at a time, and saves only the hidden states,
the weight, the targets and one logsumexp per token; its backward recomputes each chunk's logits
(the trade of Liger-Kernel's fused linear cross-entropy and Cut Cross-Entropy, Wijmans et al.
2024, arXiv 2411.09009: the gradient of ``log softmax(z)[y]`` is ``onehot(y) - softmax(z)``).

`plain_lm_head` says when a model's logits are exactly its output embedding applied to its
decoder's last hidden state, so the head can be applied here instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

PLAIN_HEAD_ARCHS: frozenset[str] = frozenset(
    {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}
)
"""transformers classes whose forward is ``logits = lm_head(model(...).last_hidden_state)``, nothing else
(checked against transformers 5.25's modeling files)."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
"""Config fields by which other architectures change the logits after the head (Gemma 2, Cohere, Granite...)."""


def _logit_transforms(model: nn.Module) -> list[str]:
    """The settings of ``model``'s config that change its logits after the head (a soft-cap, a scale)."""
    config = getattr(model, "config", None)
    return [name for name in _LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 0, 1, 1.0)]


def _is_plain_head_class(cls: type) -> bool:
    """Whether ``cls`` is one of transformers' own `PLAIN_HEAD_ARCHS` classes (not a subclass of one)."""
    return cls.__name__ in PLAIN_HEAD_ARCHS and cls.__module__.startswith("transformers.models.")


def sharded_plain_lm_head(model: nn.Module) -> str | None:
    """``None`` when ``model`` is an FSDP2-sharded known plain-head architecture (`plain_lm_head`'s classes,
    wrapped by ``fully_shard``), else why not. Its head can be applied outside its forward only after that
    forward (FSDP2 keeps the root module's parameters gathered from its forward to its backward)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return "not sharded by FSDP2"
    if not any(_is_plain_head_class(base) for base in type(model).__bases__):
        return f"{type(model).__name__} wraps none of the known plain-head architectures {sorted(PLAIN_HEAD_ARCHS)}"
    transforms = _logit_transforms(model)
    if transforms:
        return f"its config transforms the logits ({', '.join(transforms)})"
    if type(model.get_output_embeddings()) is not nn.Linear:  # type: ignore[operator]
        return "its output embedding is not a plain nn.Linear"
    return None


def plain_lm_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | str:
    """``(decoder, head)`` when ``model(...).logits == head(decoder(...).last_hidden_state)``, else why not.

    Only the exact transformers classes of `PLAIN_HEAD_ARCHS` qualify: a subclass, a model with
    hooks on it or its head (FSDP's unsharding, PEFT), a head that is not a plain ``nn.Linear``
    or a config that transforms the logits could apply the head differently than ``F.linear``.
    """
    cls = type(model)
    if not _is_plain_head_class(cls):
        return f"{cls.__module__}.{cls.__name__} is not one of the known plain-head architectures {sorted(PLAIN_HEAD_ARCHS)}"
    transforms = _logit_transforms(model)
    if transforms:
        return f"its config transforms the logits ({', '.join(transforms)})"
    head = model.get_output_embeddings()  # type: ignore[operator]
    decoder = model.get_decoder()  # type: ignore[operator]
    if type(head) is not nn.Linear or not isinstance(decoder, nn.Module):
        return f"its output embedding is a {type(head).__name__}, not a plain nn.Linear"
    hooked = [m for m in (model, head) if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        return "it or its output embedding has forward hooks (a sharding or adapter wrapper)"
    if type(head.weight.data) is not Tensor:  # a DTensor or another subclass: sharded or quantised
        return f"its output embedding's weight is a {type(head.weight.data).__name__}"
    return decoder, head


def check_chunk_tokens(value: object, name: str = "chunk_tokens", *, off_allowed: bool = False) -> None:
    """Refuse a chunk size that is not an int >= 1 (>= 0 when ``off_allowed``: 0 is the full logits).

    Raises:
        ValueError: quoting ``name``, the value and the allowed range.
    """
    low = 0 if off_allowed else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        off = " (0: the full logits)" if off_allowed else ""
        raise ValueError(f"{name} must be an int >= {low}{off}, got {value!r}")


def head_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` returns here: the ambient autocast's, else the inputs'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, dtype: torch.dtype) -> Tensor:
    """``(n, V)`` float32 logits of one chunk divided by the temperature, with ``weight`` and ``bias`` already in ``dtype``."""
    return F.linear(h.to(dtype), weight, bias).float().div_(temperature)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """``(logps, entropies)`` of ``F.linear(hidden, weight, bias) / temperature`` at ``targets``; see the module."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
        temperature: float, chunk: int, dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logps = torch.empty(n, device=hidden.device, dtype=torch.float32)
        entropies = torch.empty_like(logps)
        lse = torch.empty_like(logps)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtype is explicit; backward runs without autocast too
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                logits = _chunk_logits(hidden[start:end], w, b, temperature, dtype)  # (n, V)
                lse[start:end] = torch.logsumexp(logits, dim=-1)
                logp = logits.sub_(lse[start:end, None])  # in place: one float32 chunk at a time
                logps[start:end] = logp.gather(-1, targets[start:end, None]).squeeze(-1)
                entropies[start:end] = -(logp.exp().mul_(logp)).sum(-1)
                del logits, logp
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx: Any, grad_logps: Tensor, _grad_entropies: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros(weight.shape[0], device=weight.device, dtype=torch.float32) if need_b else None
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end].to(dtype)
            p = _chunk_logits(h, w, b, temperature, dtype).sub_(lse[start:end, None]).exp_()  # (n, V) softmax
            # d logp[y] / d raw = (onehot(y) - p) / T; scaled by the incoming gradient
            scale = (grad_logps[start:end].float() / temperature)[:, None]  # (n, 1)
            d = p.mul_(-scale).scatter_add_(-1, targets[start:end, None], scale)  # (n, V) float32
            if grad_b is not None:
                grad_b += d.sum(0)
            d_low = d.to(dtype)  # the head's backward runs in its forward's dtype, as autograd's would
            del p, d
            if grad_h is not None:
                grad_h[start:end] = (d_low @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (d_low.t() @ h).float()  # (V, H), summed over chunks in float32
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None, None, None, None,
        )


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities and entropies of ``softmax(F.linear(hidden, weight, bias) / temperature)``, chunked.

    Equal to ``log_softmax(logits.float() / T).gather(-1, targets)`` and its entropy, with the logits
    computed in the dtype the head would produce under the ambient autocast; no more than
    ``chunk_tokens`` rows of ``(tokens, V)`` logits exist at any time, forward or backward.

    Args:
        hidden: ``(N, H)`` final (normed) hidden states of the positions that predict ``targets``.
        weight: ``(V, H)`` output embedding (tied to the input embedding or not).
        targets: ``(N,)`` token ids.
        temperature: the logits are divided by it (> 0).
        chunk_tokens: rows of logits per chunk (>= 1).
        bias: ``(V,)`` the head's bias, if it has one.

    Returns:
        ``(N,)`` float32 log-probabilities (differentiable in ``hidden``, ``weight`` and ``bias``) and
        ``(N,)`` float32 entropies (not differentiable).

    Raises:
        ValueError: on a ``chunk_tokens`` below 1, a temperature not > 0, or mismatched shapes.
    """
    check_chunk_tokens(chunk_tokens)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden (N, H), weight (V, H) and targets (N,), got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)} and {tuple(targets.shape)}"
        )
    dtype = head_dtype(hidden, weight)
    out = _ChunkedTokenLogprobs.apply(hidden.contiguous(), weight, bias, targets.contiguous(), float(temperature),
                                      chunk_tokens, dtype)
    return out[0], out[1]
