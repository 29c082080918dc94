"""The policy's forward over a rollout batch: per-token log-probabilities and entropies of the completions
(TRL's ``_get_per_token_logps_and_entropies``), through the model's own logits or, where its logits are
its head over the last hidden state, a chunk of tokens at a time (`lightning_tlt.rl.logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_tlt.rl.attention import training_attention
from lightning_tlt.rl.batch import RolloutBatch
from lightning_tlt.rl.config import DEFAULT_LOGPROB_CHUNK_TOKENS
from lightning_tlt.rl.logprobs import (
    check_chunk_tokens,
    chunked_token_logprobs,
    plain_lm_head,
    sharded_plain_lm_head,
)


@dataclass
class PolicyForward:
    """Per-token quantities of the completions from one policy forward."""

    logps: Tensor
    """``(B, C)`` log-probabilities of the completion tokens (logits divided by the temperature)."""
    entropies: Tensor
    """``(B, C)`` detached entropies of those distributions."""
    hidden_states: Tensor | None = None
    """``(B, P + C, H)`` final hidden states, when asked for."""


def completion_forward(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float,
    output_hidden_states: bool = False,
    cudnn_attention: bool = False,
    logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
) -> PolicyForward:
    """Log-probabilities and entropies of the batch's completion tokens under ``model``.

    As TRL's ``_get_per_token_logps_and_entropies``: one forward over prompt + completion, logits
    of the last ``C + 1`` positions, divided by the sampling temperature, the last one dropped.
    Positions skip the left padding, as in the engine. Attention avoids cuDNN's kernels unless
    ``cudnn_attention`` (`training_attention`).

    When ``logprob_chunk_tokens`` > 0 and the model's logits are its output embedding applied to its
    decoder's last hidden state (`plain_lm_head`), the head is applied here, that many tokens at a
    time (`chunked_token_logprobs`): the ``(B, C, V)`` logits never exist, forward or backward.
    Other models, and 0, take the full path (the same numbers, up to float rounding).
    """
    check_chunk_tokens(logprob_chunk_tokens, "logprob_chunk_tokens", off_allowed=True)
    parts = plain_lm_head(model) if logprob_chunk_tokens else None
    sharded = isinstance(parts, str) and sharded_plain_lm_head(model) is None
    if isinstance(parts, str) and not sharded:
        rank_zero_warn(f"logprob_chunk_tokens={logprob_chunk_tokens} ignored for {type(model).__name__}: {parts}")
    with training_attention(cudnn_attention):
        if sharded:
            return _chunked_sharded_forward(model, batch, temperature=temperature,
                                            output_hidden_states=output_hidden_states, chunk_tokens=logprob_chunk_tokens)
        if isinstance(parts, tuple):
            return _chunked_completion_forward(
                *parts, batch, temperature=temperature, output_hidden_states=output_hidden_states,
                chunk_tokens=logprob_chunk_tokens,
            )
        return _full_completion_forward(model, batch, temperature=temperature, output_hidden_states=output_hidden_states)


def _chunked_sharded_forward(
    model: nn.Module, batch: RolloutBatch, *, temperature: float, output_hidden_states: bool, chunk_tokens: int
) -> PolicyForward:
    """`completion_forward` of an FSDP2-sharded plain-head policy through `chunked_token_logprobs`.

    The decoder cannot be called on its own here: FSDP2 gathers the root module's parameters (the
    embedding, the final norm, the head) in the root's forward, and sets up their gradients' reduction
    there. So the whole model runs, its head over one position only (``logits_to_keep=1``), and the
    head is applied to the last hidden state afterwards, chunked: FSDP2 keeps the root's parameters
    gathered from its forward to its backward, and reduces the head's gradient with the rest.
    """
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=1,
        output_hidden_states=True,
        use_cache=False,
    )
    head = model.get_output_embeddings()  # type: ignore[operator]
    if type(head.weight.data) is not Tensor:  # still sharded: FSDP2 resharded the root after its forward
        raise RuntimeError("the sharded policy's head is not gathered after its forward; set logprob_chunk_tokens=0")
    final = out.hidden_states[-1]
    return _head_chunked(final, head, batch, temperature=temperature, chunk_tokens=chunk_tokens,
                         hidden_states=final if output_hidden_states else None)  # fmt: skip


def _head_chunked(
    final: Tensor, head: nn.Linear, batch: RolloutBatch, *, temperature: float, chunk_tokens: int,
    hidden_states: Tensor | None,
) -> PolicyForward:
    """The completion's log-probs and entropies from the last (normed) hidden state ``final`` ``(B, T, H)``, the
    head applied `chunked_token_logprobs`' way; ``hidden_states`` passed through."""
    b, c = batch.completion_ids.shape
    last = final[:, -(c + 1) : -1, :]  # (B, C, H): the positions predicting the completion
    logps, entropies = chunked_token_logprobs(
        last.reshape(b * c, -1), head.weight, batch.completion_ids.reshape(-1),
        temperature=temperature, chunk_tokens=chunk_tokens, bias=head.bias,
    )  # fmt: skip
    return PolicyForward(logps=logps.view(b, c), entropies=entropies.view(b, c), hidden_states=hidden_states)


def _full_completion_forward(
    model: nn.Module, batch: RolloutBatch, *, temperature: float, output_hidden_states: bool
) -> PolicyForward:
    """`completion_forward` through the model's own ``(B, C, V)`` logits."""
    c = batch.completion_ids.shape[1]
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=c + 1,
        output_hidden_states=output_hidden_states,
        use_cache=False,
    )
    hidden = out.hidden_states[-1] if output_hidden_states else None
    raw = out.logits
    del out
    # (B, C, V) float32 copies are the largest tensors of a step (4 rows x 4,096 tokens x 151,936 is
    # 10 GB each): one float copy divided in place, and the entropy a row at a time
    logits = raw[:, :-1, :].float()
    # a float32 model's logits are a view of its output (.float() copies nothing): dividing that in place would
    # drop the pre-backward hook FSDP2 registers on the output of a sharded policy
    logits = logits.div_(temperature) if logits.dtype != raw.dtype else logits / temperature
    del raw
    logp_all = torch.log_softmax(logits, dim=-1)
    del logits
    logps = logp_all.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)  # (B, C)
    with torch.no_grad():
        entropies = torch.cat([-(row.exp() * row).sum(-1) for row in logp_all.detach().split(1)])  # (B, C)
    return PolicyForward(logps=logps, entropies=entropies, hidden_states=hidden)


def _chunked_completion_forward(
    decoder: nn.Module, head: nn.Linear, batch: RolloutBatch, *, temperature: float, output_hidden_states: bool,
    chunk_tokens: int,
) -> PolicyForward:
    """`completion_forward` through the decoder's last hidden state and `chunked_token_logprobs`."""
    out = decoder(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        output_hidden_states=output_hidden_states,
        use_cache=False,
    )
    hidden = out.hidden_states[-1] if output_hidden_states else None  # the same tensor as the full path's
    return _head_chunked(out.last_hidden_state, head, batch, temperature=temperature, chunk_tokens=chunk_tokens,
                         hidden_states=hidden)  # fmt: skip
