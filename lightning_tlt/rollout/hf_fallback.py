"""Generation for models the runner does not know: their own HF forward with ``past_key_values``.

Slower (no static cache, no graphs, no speculation) but the same contract as the native path: the
same sampling (`lightning_tlt.rollout.steps.sample_tokens`, keyed noise by each request's key and
completion position, so the same seed draws the same numbers as there), stop tokens kept in the completion,
``max_new_tokens`` as the cap, logprobs of the processed distribution, step events. Requests run
in waves of ``num_slots`` rows, left-padded.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_tlt.core.types import Phase, SamplingConfig, StepEvent
from lightning_tlt.rollout.scheduler import Request
from lightning_tlt.rollout.steps import SamplingKey, row_noise, sample_tokens

Results = dict[int, tuple[list[int], list[float]]]


def generate_hf(
    model: Any,
    requests: list[Request],
    sampling: SamplingConfig,
    stop_ids: list[int],
    generator: torch.Generator | None = None,
    *,
    slots: int,
    emit: Callable[[StepEvent], None],
    bar: Any = None,
    timers: Any = None,
) -> tuple[Results, int, int]:
    """Generate ``requests`` wave by wave; returns (results by request index, steps, row steps).

    ``generator`` is unused (the noise is keyed by each request's ``key``); kept for callers.
    """
    device = next(model.parameters()).device
    stops = torch.tensor(stop_ids or [-1], device=device)
    key = SamplingKey(sampling.temperature, sampling.top_k, sampling.top_p)
    results: Results = {}
    step = tokens_total = 0
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for w in range(0, len(requests), slots):
        wave = requests[w : w + slots]
        width = max(len(r.prompt) for r in wave)
        ids = torch.zeros(len(wave), width, dtype=torch.long)
        mask = torch.zeros(len(wave), width, dtype=torch.long)
        for row, r in enumerate(wave):  # left padding
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
        finished = torch.zeros(len(wave), dtype=torch.bool, device=device)
        keys = torch.tensor([r.key for r in wave], device=device)
        out_t: list[Tensor] = []
        out_lp: list[Tensor] = []
        past = None
        t0 = time.perf_counter()
        for i in range(sampling.max_new_tokens):
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                        **{cache_kw: past})
            past = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            logits = out.logits[:, -1]
            noise = None if key.greedy else row_noise(keys, torch.full_like(keys, i), logits.shape[-1])
            new, logp, _ = sample_tokens(logits, key, noise)
            new = torch.where(finished, torch.zeros_like(new), new)
            out_t.append(new)
            out_lp.append(logp)
            active = int((~finished).sum())
            tokens_total += active
            if bar is not None:
                bar.update(active)
            finished = finished | (new[:, None] == stops[None]).any(-1)
            dt = time.perf_counter() - t0
            phase: Phase = "prefill" if i == 0 else "decode"
            if timers is not None:
                timers.add(phase, dt)
            step += 1
            remaining = int((~finished).sum())
            emit(StepEvent(step, phase, remaining, len(requests) - w - len(wave), slots, dt, new_tokens=active))
            t0 = time.perf_counter()
            if remaining == 0:
                break
            ids = new[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position_ids = position_ids[:, -1:] + 1
        toks = torch.stack(out_t, 1).tolist()
        lps = torch.stack(out_lp, 1).tolist()
        for r, t, lp in zip(wave, toks, lps):
            n = next((j + 1 for j, tok in enumerate(t) if tok in stop_ids), len(t))
            results[r.index] = (t[:n], lp[:n])
    return results, step, tokens_total
