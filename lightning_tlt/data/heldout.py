"""A held-out evaluation of the policy as functions: the prompts, one pass of generation and scoring, the figures.

`lightning_tlt.callbacks.heldout_eval.EvalCallback` runs a pass every N steps; the parts are here so
that they can be tested, and used without a Trainer:

- `HeldOutSet`: a fixed set of prompts never trained on (`RolloutDataModule.heldout_dataset`: a zoo
  task's test split, disjoint from its train split by construction, checked against the training
  prompts), with a digest that a resumed run compares.
- `evaluate_prompts`: greedy (one completion a prompt) and sampled (``k`` a prompt at a temperature)
  completions from the training engine (`RolloutDataModule.generate_aside`: it leaves training's
  RNG, data position, speculation state and listeners as they were), scored by one reward function.
- `heldout_metrics`: correctness with 95 % intervals, and completion lengths.

The intervals. Greedy: one completion a prompt, so the prompts are independent Bernoulli trials and
the interval is Wilson's score interval (`wilson_interval`; Wilson 1927, which Brown, Cai and
DasGupta, Statistical Science 2001, recommend over the Wald interval, which fails near 0 and 1).
Sampled: the ``k`` completions of a prompt are correlated (an easy prompt is right in all of them),
so treating the ``P * k`` completions as independent would make the interval too narrow. The
interval is the mean ± 1.96 cluster-robust standard errors with the prompts as clusters
(`cluster_interval`): with equal cluster sizes the CR1 standard error of the pooled mean is the
standard deviation of the per-prompt means over sqrt(P) (Cameron and Miller, "A Practitioner's Guide
to Cluster-Robust Inference", 2015, eq. 12 with the G/(G-1) factor); where every prompt has the same
mean (all wrong at step 0, say) there is no spread to estimate it from, and the interval is Wilson's
with each prompt one trial.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.data.rewards import reward_func_name

if TYPE_CHECKING:
    from lightning_tlt.data.datamodule import RolloutDataModule

Z95 = 1.959963984540054
"""The standard normal's 97.5 % quantile: a two-sided 95 % interval is ± this many standard errors."""


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a binomial proportion: ``successes`` of ``n`` independent trials.

    Raises:
        ValueError: ``n`` < 1 or ``successes`` outside [0, n].
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need n >= 1 and 0 <= successes <= n, got successes={successes!r}, n={n!r}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact ends (rounding leaves 1e-17 there)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def cluster_interval(values: Tensor, z: float = Z95) -> tuple[float, float, float]:
    """The mean of ``values`` ``(P, k)`` (``k`` correlated draws for each of ``P`` independent prompts) and its
    interval: ± ``z`` cluster-robust (CR1) standard errors, the prompts as clusters, clipped to [0, 1].

    Returns:
        ``(mean, low, high)``. With one prompt the interval is [0, 1]; where every prompt has the same mean (all
        wrong, say) there is no spread to estimate a standard error from, and the interval is Wilson's with each
        prompt one trial (as if its samples were copies of one: the widest the clustering can make it).
    """
    if values.dim() != 2 or values.numel() == 0:
        raise ValueError(f"values must be (prompts, samples) and not empty, got shape {tuple(values.shape)}")
    means = values.double().mean(dim=1)  # (P,)
    mean = float(means.mean())
    if len(means) < 2:
        return mean, 0.0, 1.0
    sd = float(means.std(unbiased=True))
    if sd == 0.0:
        return (mean, *wilson_interval(mean * len(means), len(means), z))
    se = sd / math.sqrt(len(means))
    return mean, max(0.0, mean - z * se), min(1.0, mean + z * se)


@dataclass
class HeldOutSet:
    """A fixed set of held-out prompts (TRL's prompt-only rows: ``prompt`` and the columns the rewards read)."""

    records: list[dict[str, Any]]
    """The rows, in order."""
    prompt_ids: list[list[int]]
    """Each row's prompt, tokenized as the training prompts are."""

    @property
    def digest(self) -> str:
        """A hash of the prompts: equal exactly when two sets hold the same prompts in the same order."""
        text = json.dumps([r["prompt"] for r in self.records], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.records)

    @classmethod
    def from_datamodule(cls, dm: RolloutDataModule, size: int) -> HeldOutSet:
        """``size`` prompts of ``dm``'s held-out source (`RolloutDataModule.heldout_dataset`)."""
        from lightning_tlt.models.tokenizer import encode_prompt

        records = dm.heldout_dataset(size).to_list()
        return cls(records, [encode_prompt(dm.tokenizer, r["prompt"]) for r in records])


def reward_index(dm: RolloutDataModule, name: str | None) -> int:
    """The position of the reward function named ``name`` (its full name, or the part after the task's prefix:
    "correctness" finds ``countdown_search_correctness``) among ``dm``'s; ``None``: the first (a zoo task's
    correctness).

    Raises:
        ValueError: naming the reward functions there are.
    """
    names = [reward_func_name(f) for f in dm.reward_funcs]
    if name is None:
        return 0
    for i, full in enumerate(names):
        if full == name or full.endswith("_" + name):
            return i
    raise ValueError(f"reward {name!r} is not among the reward functions {names}")


@dataclass
class HeldOutScores:
    """One pass over (a shard of) a held-out set: per prompt, whether each completion was correct, and lengths."""

    greedy: Tensor
    """``(P,)`` 1.0 where the greedy completion was correct (empty when greedy was not run)."""
    sampled: Tensor
    """``(P, k)`` 1.0 where the sampled completion was correct."""
    lengths: Tensor
    """``(P, k)`` the sampled completions' lengths in tokens."""
    clipped: Tensor
    """``(P, k)`` 1.0 where a sampled completion was cut at the length cap."""


def evaluate_prompts(
    dm: RolloutDataModule,
    held: HeldOutSet,
    rows: list[int],
    *,
    sampling: SamplingConfig,
    num_samples: int,
    greedy: bool,
    reward: int,
    threshold: float,
    seed: int,
) -> HeldOutScores:
    """Generate and score ``rows`` of ``held``: greedily (when ``greedy``) and ``num_samples`` times with
    ``sampling``, through ``dm``'s engine beside training (`RolloutDataModule.generate_aside`; the sampling noise
    is seeded by ``seed`` alone, so two passes differ by the policy only). A completion is correct when reward
    function ``reward`` scores it ``>= threshold`` (a completion it could not score is not)."""
    records = [held.records[i] for i in rows]
    ids = [held.prompt_ids[i] for i in rows]

    def correct(config: SamplingConfig, k: int) -> tuple[Tensor, Any]:
        generator = torch.Generator(device=dm.engine.device).manual_seed(seed)
        out = dm.generate_aside(ids, config, k, generator)
        scores = dm.score(records, out, k)[2].rewards[:, reward]  # (P * k,); NaN: not scored
        return (scores >= threshold).float().view(len(rows), k), out

    if not rows:  # a rank with no prompt of its own (more ranks than prompts)
        empty = torch.zeros(0, num_samples)
        return HeldOutScores(torch.zeros(0), empty, empty, empty)
    greedy_correct = torch.zeros(0)
    if greedy:
        plain = SamplingConfig(temperature=0.0, max_new_tokens=sampling.max_new_tokens,
                               stop_token_ids=sampling.stop_token_ids)  # fmt: skip
        greedy_correct = correct(plain, 1)[0][:, 0]
    sampled, out = correct(sampling, num_samples)
    lengths = torch.tensor([len(c) for c in out.completion_ids], dtype=torch.float32).view(len(rows), num_samples)
    clipped = torch.tensor([r == "length" for r in out.finish_reasons], dtype=torch.float32).view_as(lengths)
    return HeldOutScores(greedy_correct, sampled, lengths, clipped)


def heldout_metrics(scores: HeldOutScores, temperature: float) -> dict[str, float]:
    """The logged figures of a whole pass (``eval/...``): correctness greedy and sampled with their 95 % intervals
    (Wilson; cluster-robust over prompts), and the sampled completions' length: mean, p50, p90, p99, clipped share.
    ``temperature`` names the sampled figures (``eval/correctness_t1`` at 1.0, ``eval/correctness_t0.7`` ...)."""
    tag = f"t{temperature:g}"
    m: dict[str, float] = {}
    if scores.greedy.numel():
        n = int(scores.greedy.numel())
        hits = float(scores.greedy.sum())
        low, high = wilson_interval(hits, n)
        m.update({"eval/correctness_greedy": hits / n, "eval/correctness_greedy_low": low,
                  "eval/correctness_greedy_high": high})  # fmt: skip
    mean, low, high = cluster_interval(scores.sampled)
    m.update({f"eval/correctness_{tag}": mean, f"eval/correctness_{tag}_low": low, f"eval/correctness_{tag}_high": high})
    lengths = scores.lengths.flatten().double()
    quantiles = torch.quantile(lengths, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    m.update({"eval/len_mean": float(lengths.mean()), "eval/len_p50": quantiles[0], "eval/len_p90": quantiles[1],
              "eval/len_p99": quantiles[2], "eval/clipped_ratio": float(scores.clipped.mean()),
              "eval/num_prompts": float(scores.sampled.shape[0]), "eval/num_samples": float(scores.sampled.shape[1])})
    return m
