"""Train an EAGLE drafter outside RL: on given sequences, with the policy's features computed here.

TLT's released drafters start trained (arXiv 2511.16665): a drafter trained before RL speculates
well from the first rollout, and co-training in the stalls then only has to follow the policy as
it moves. `train_drafter` is that warm start: the policy's last hidden states over the sequences
(one no-grad forward per batch), a `FeatureReplayBuffer` with a held-out share, ``steps`` updates of
the same step the co-training callback replays (`lightning_tlt.drafters.trainer.DrafterTrainer`),
and the held-out acceptance before and after. Where the sequences come from (rollouts of the
policy, or a task's worked solutions) is the caller's choice: ``lightning-tlt train-drafter``
(`lightning_tlt.data.drafter_data`) makes them from a task.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_tlt.core.runner import unwrap_model
from lightning_tlt.drafters.buffer import FeatureReplayBuffer
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.trainer import DrafterTrainConfig, DrafterTrainer


@dataclass
class OfflineTrainResult:
    """What `train_drafter` returns."""

    drafter: EagleDrafter
    """The trained drafter (float32 master weights; `EagleDrafter.save_pretrained` writes vLLM's layout)."""
    steps: int
    """Updates run."""
    heldout_before: float | None
    """Held-out acceptance rate ``Σ min(p, q)`` before training (``None`` without held-out rows)."""
    heldout_after: float | None
    """The same after training."""
    sequences: int
    """Sequences in the buffer (training and held-out)."""


@torch.no_grad()
def add_policy_features(
    buffer: FeatureReplayBuffer,
    policy: nn.Module,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    *,
    step: int = -1,
    batch_size: int = 16,
) -> int:
    """Run ``policy`` over ``sequences`` (prompt then completion) and add its last hidden states to ``buffer``.

    Args:
        buffer: where the features go.
        policy: an HF causal LM.
        sequences: token ids, prompt first.
        prompt_lengths: the prompt's length in each sequence (the rest is the completion).
        step: the RL step to tag them with.
        batch_size: sequences per forward.

    Returns:
        Sequences added.
    """
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"got {len(sequences)} sequences and {len(prompt_lengths)} prompt lengths")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    model = unwrap_model(policy)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    added = 0
    for start in range(0, len(sequences), batch_size):
        chunk = [list(s) for s in sequences[start : start + batch_size]]
        prompts = prompt_lengths[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in chunk], device=device)  # right-padded
        cols = torch.arange(width, device=device)[None]
        lengths = torch.tensor([len(s) for s in chunk], device=device)[:, None]
        real = cols < lengths
        completion = real & (cols >= torch.tensor(list(prompts), device=device)[:, None])
        with torch.no_grad():
            hidden = _last_hidden(model, ids, real.long())
        added += buffer.add(hidden, ids, real, completion, step)
    model.train(was_training)
    return added


def _last_hidden(model: nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The final-norm hidden states, through the base model where there is one: the LM head's logits
    are never formed (at 151,936 rows, 16 sequences of 4,096 tokens would be 20 GB of them in bf16)."""
    base = getattr(model, "model", None)
    if isinstance(base, nn.Module) and hasattr(model, "lm_head"):
        return base(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    return model(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states[-1]


def train_drafter(
    policy: nn.Module,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    *,
    steps: int,
    config: DrafterTrainConfig | None = None,
    drafter: EagleDrafter | None = None,
    heldout_fraction: float = 0.1,
    buffer_tokens: int = 1 << 20,
    eval_max_sequences: int = 64,
    seed: int = 0,
) -> OfflineTrainResult:
    """Train an EAGLE-1 drafter for ``policy`` on ``sequences`` for ``steps`` updates.

    Args:
        policy: an HF Llama / Qwen2 / Qwen3 causal LM (its embedding and head are shared, not trained).
        sequences: prompt + completion token ids (rollouts of the policy train the drafter best).
        prompt_lengths: the prompt's length in each sequence.
        steps: drafter updates.
        config: batch shape and optimizer (`DrafterTrainConfig`); ``None``: the defaults.
        drafter: a drafter to continue training; ``None``: a cold one seeded with ``seed``.
        heldout_fraction: share of sequences measured, never trained on.
        buffer_tokens: the buffer's size in tokens (sequences beyond it push out the oldest).
        eval_max_sequences: newest held-out sequences the acceptance is measured on.
        seed: the drafter's init and the buffer's draws.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps!r}")
    config = config or DrafterTrainConfig()
    if drafter is None:
        drafter = EagleDrafter.from_target(unwrap_model(policy), generator=torch.Generator().manual_seed(seed))
    buffer = FeatureReplayBuffer(buffer_tokens, heldout_fraction, seed=seed, device=drafter.fc.weight.device)
    add_policy_features(buffer, policy, sequences, prompt_lengths)
    if buffer.num_train == 0:
        raise ValueError("no sequence with a completion to train on (need prompt + at least one completion token)")
    trainer = DrafterTrainer(drafter, buffer, config)
    plans = buffer.heldout_plans(config.batch_size, config.max_len, config.pack_segments, eval_max_sequences)

    def heldout() -> float | None:
        trainer.evaluate(None, plans)
        rates = trainer.take_evaluation()
        return None if rates is None else rates[0]

    before = heldout()
    trainer.enqueue(steps, block=True)
    trainer.wait()
    after = heldout()
    return OfflineTrainResult(drafter, trainer.steps_enqueued, before, after, len(buffer))
