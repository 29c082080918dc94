"""`VLLMRolloutEngine`: the rollout-engine interface on a colocated ``vllm.LLM``.

The same ``generate(prompts, sampling, num_samples, generator) -> RolloutOutput`` as the native
`lightning_tlt.rollout.engine.RolloutEngine`, served by vLLM (continuous batching, paged KV,
its own CUDA graphs), for users who already serve with vLLM or outgrow one process. TLT's ideas
map onto vLLM's own machinery (Taming the Long-Tail, arXiv 2511.16665, sections 4-5):

- the co-trained EAGLE drafter, exported by ``EagleDrafter.save_pretrained``, is vLLM's EAGLE
  draft (``speculative_config={"method": "eagle", "model": drafter_path}``); the model-free
  "suffix" drafter maps to vLLM's "ngram" prompt lookup;
- TLT's adaptive gate (speculate only while at most ``threshold`` rows run) and its draft-length
  table become vLLM's batch-size schedule ``num_speculative_tokens_per_batch_size`` (K = 0 above
  the threshold); there is no hysteresis and no online tuner inside vLLM;
- policy weights are pushed after each optimizer step, drafter weights when the co-training
  callback publishes them, both through ``collective_rpc`` into vLLM's in-place layerwise reload
  (the path TRL's colocate mode and vLLM's weight-transfer engines end in; the layerwise reload
  re-runs the kernels' weight processing, e.g. the weight prepacking of vLLM's CPU GEMMs, which
  a bare ``model.load_weights`` would bypass).

vLLM is imported lazily (`lightning_tlt.rollout.vllm_support.import_vllm`): ``import lightning_tlt``
works without it. The translation of the configurations and the weights' wire format live in
`lightning_tlt.rollout.vllm_support`.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_tlt.core.prompts import check_stop_ids, policy_positions, validate_prompts
from lightning_tlt.core.sharding import is_sharded
from lightning_tlt.core.types import (
    FinishReason,
    RolloutOutput,
    SamplingConfig,
    SpeculativeConfig,
    StepEvent,
    StepListener,
)

# re-exported: users and vLLM's workers find them here (`lightning_tlt.integrations.vllm`)
from lightning_tlt.rollout.vllm_support import INSTALL_HINT as INSTALL_HINT
from lightning_tlt.rollout.vllm_support import NGRAM_LOOKUP_MAX as NGRAM_LOOKUP_MAX
from lightning_tlt.rollout.vllm_support import NGRAM_LOOKUP_MIN as NGRAM_LOOKUP_MIN
from lightning_tlt.rollout.vllm_support import TLT_BATCH_BUCKETS as TLT_BATCH_BUCKETS
from lightning_tlt.rollout.vllm_support import WORKER_EXTENSION as WORKER_EXTENSION
from lightning_tlt.rollout.vllm_support import decode_weights as decode_weights
from lightning_tlt.rollout.vllm_support import draft_schedule as draft_schedule
from lightning_tlt.rollout.vllm_support import drafter_weights as drafter_weights
from lightning_tlt.rollout.vllm_support import encode_weights as encode_weights
from lightning_tlt.rollout.vllm_support import import_vllm as import_vllm
from lightning_tlt.rollout.vllm_support import model_eos_ids as model_eos_ids
from lightning_tlt.rollout.vllm_support import named_weights as named_weights
from lightning_tlt.rollout.vllm_support import policy_logprobs as policy_logprobs
from lightning_tlt.rollout.vllm_support import sampling_params_kwargs as sampling_params_kwargs
from lightning_tlt.rollout.vllm_support import speculative_config as speculative_config
from lightning_tlt.rollout.vllm_support import unwrap_module as unwrap_module

if TYPE_CHECKING:  # pragma: no cover
    from vllm import LLM, SamplingParams


# ---------------------------------------------------------------------------- worker side
class TLTWorkerExtension:
    """Methods added to each vLLM worker (``LLM(worker_extension_cls=WORKER_EXTENSION)``).

    vLLM mixes this class into its worker class, so ``self`` is the worker: ``get_model()``,
    ``get_draft_model()``, ``reload_weights(...)``, ``vllm_config`` are vLLM's own.
    """

    def tlt_load_weights(self, payload: bytes | Iterable[tuple[str, Tensor]], draft: bool = False) -> int:
        """Load weights in place into the target (``draft=False``) or the speculative draft model.

        ``payload``: serialised weights (another process), or ``(name, tensor)`` pairs in this process: a
        list, or a lazy iterator (a sharded policy gathered one tensor at a time while vLLM loads it).
        Returns the number of tensors received.
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        worker: Any = self
        if not draft and not isinstance(payload, (bytes, bytearray, memoryview, list, tuple)):
            counted = _Counted(payload)  # lazy: each tensor is gathered as vLLM asks for it
            worker.reload_weights(weights_iterator=iter(counted), is_checkpoint_format=True)
            return counted.count
        weights = decode_weights(payload if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload))
        if not draft:
            worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
            return len(weights)
        model = worker.get_draft_model()
        spec = worker.vllm_config.speculative_config
        if model is None or spec is None or spec.draft_model_config is None:
            raise RuntimeError(
                "this vLLM engine has no draft model (start it with an EAGLE speculative_config)"
            )
        with set_current_vllm_config(worker.vllm_config):
            initialize_layerwise_reload(model)
            model.load_weights(weights)
            finalize_layerwise_reload(model, spec.draft_model_config)
        return len(weights)


class _Counted:
    """An iterable of weights that counts what was taken from it."""

    def __init__(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        self.weights, self.count = weights, 0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for pair in self.weights:
            self.count += 1
            yield pair


# ---------------------------------------------------------------------------- the engine
class VLLMRolloutEngine:
    """Generates rollouts with a colocated ``vllm.LLM``, behind the native engine's interface.

    Args:
        model_or_path: an HF causal LM (saved to a temporary directory for vLLM to load, and kept
            as the policy whose weights `update_policy_weights` pushes by default) or the path of
            an HF model directory. A sharded policy (FSDP2, `lightning_tlt.rl.fsdp`) is not saved:
            vLLM starts on dummy weights (``load_format="dummy"``) from its config and the policy is
            gathered into it at once, one tensor at a time in vLLM's dtype, through the same
            in-place reload every later push takes (every rank builds its engine together).
        tokenizer: saved beside the model when given, so the directory serves as it is later;
            vLLM itself works on token ids here (``skip_tokenizer_init=True``).
        speculative: how vLLM speculates (see `speculative_config`); ``None`` never does.
        max_seq_len: longest prompt + completion (vLLM's ``max_model_len``).
        gpu_memory_utilization: share of accelerator memory vLLM may take (weights + KV cache);
            leave room for training when colocated. On CPU, set ``VLLM_CPU_KVCACHE_SPACE`` (GiB).
        enforce_eager: no CUDA graphs / torch.compile inside vLLM (fast start, slower decode).
        dtype: vLLM's ``dtype`` ("auto" follows the checkpoint).
        seed: vLLM's engine seed (per-request seeds come from ``generate``'s generator).
        enable_sleep_mode: allow `sleep`/`wake_up` (CUDA/ROCm/XPU only; ignored with a warning
            elsewhere).
        dynamic_speculation: pass TLT's batch-size schedule (`draft_schedule`) to vLLM.
        max_batch_size: most sequences vLLM runs at once (its ``max_num_seqs``); ``None``: vLLM's default.
        auto_sync: before each ``generate``, push the held policy's weights if any parameter was
            modified in place since the last push (an optimizer step bumps every tensor's version
            counter), so that the engine follows training like the native one, with no hook.
        **llm_kwargs: passed to ``vllm.LLM`` as they are (``tensor_parallel_size``,
            ``distributed_executor_backend``, ...); ``worker_extension`` replaces the worker
            extension class (a subclass of `TLTWorkerExtension`).
    """

    _drafter: nn.Module | None = None  # the frozen copy `set_drafter` pushes (none before the first)
    _drafter_version = 0  # `drafter_version`: 0 before any publication

    def __init__(
        self,
        model_or_path: nn.Module | str | os.PathLike[str],
        tokenizer: Any = None,
        *,
        speculative: SpeculativeConfig | None = None,
        max_seq_len: int,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        dtype: str = "auto",
        seed: int = 0,
        enable_sleep_mode: bool = False,
        dynamic_speculation: bool = True,
        max_batch_size: int | None = None,
        auto_sync: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len!r}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size!r}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if "worker_extension_cls" in llm_kwargs:
            raise ValueError(
                f"worker_extension_cls is set by VLLMRolloutEngine ({WORKER_EXTENSION}), got "
                f"{llm_kwargs['worker_extension_cls']!r}: subclass TLTWorkerExtension and pass it as "
                "worker_extension to combine them"
            )
        vllm = import_vllm()
        self.speculative = speculative or SpeculativeConfig()
        self.max_seq_len = max_seq_len
        self._listeners: list[StepListener] = []
        self._policy: nn.Module | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._asleep_level: int | None = None
        self.last_stats: dict[str, float] = {}
        path = self._materialize(model_or_path, tokenizer)
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(path)
        try:
            gen_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json
            gen_config = None
        self.eos_ids = model_eos_ids(config, gen_config)
        """The model's end-of-sequence ids: the stop ids of a call whose sampling names none."""
        self.vocab_size = int(config.vocab_size)
        self.positions = policy_positions(config)
        """The policy's position limit, checked against every prompt and its completion budget."""
        self.model_path = str(path)
        from vllm.platforms import current_platform

        self.sleep_supported = bool(enable_sleep_mode and current_platform.is_sleep_mode_available())
        if enable_sleep_mode and not self.sleep_supported:
            warnings.warn(
                f"enable_sleep_mode=True is not supported on this platform ({current_platform.device_type}); "
                "sleep()/wake_up() will be no-ops",
                stacklevel=2,
            )
        kwargs: dict[str, Any] = dict(
            model=str(path),
            skip_tokenizer_init=True,  # token ids in, token ids out: no tokenizer needed
            max_model_len=max_seq_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            dtype=dtype,
            seed=seed,
            enable_sleep_mode=self.sleep_supported,
            # the sampled token's logprob after temperature/top-k/top-p: what RolloutOutput promises
            logprobs_mode="processed_logprobs",
            worker_extension_cls=llm_kwargs.pop("worker_extension", WORKER_EXTENSION),
            speculative_config=speculative_config(self.speculative, dynamic=dynamic_speculation),
            disable_log_stats=False,  # keeps the speculation counters that `stats` reports
        )
        if max_batch_size is not None:
            kwargs["max_num_seqs"] = max_batch_size
        sharded = self._policy is not None and is_sharded(unwrap_module(self._policy))
        if sharded:
            kwargs["load_format"] = "dummy"  # the directory holds the config only; the weights come next
        kwargs.update(llm_kwargs)
        self.llm: LLM = vllm.LLM(**kwargs)
        self._sampling_params_cls = vllm.SamplingParams
        self.auto_sync = auto_sync
        self.policy_version = 0
        self._synced_versions = self._param_versions()
        if sharded:  # every rank builds its engine at the same point: the gather is a collective
            self.update_policy_weights(self._policy)

    # ------------------------------------------------------------------ the native engine's attributes
    @property
    def device(self) -> torch.device:
        """Where ``generate``'s generator lives: seeds are drawn on the CPU (vLLM samples itself)."""
        return torch.device("cpu")

    @property
    def drafter(self) -> nn.Module | None:
        """The drafter last published with `set_drafter` (``None`` before): a frozen copy whose
        weights are the ones vLLM's draft model holds."""
        return self._drafter

    @property
    def drafter_version(self) -> int:
        """Version of the drafter in vLLM (`set_drafter`'s, or one more for each `update_drafter_weights`)."""
        return self._drafter_version

    def draft_vocab_ids(self) -> Tensor | None:
        """vLLM's EAGLE drafts over the whole vocabulary: ``None``."""
        return None

    def set_drafter(self, drafter: Any, version: int | None = None) -> bool:
        """Publish an `EagleDrafter`'s weights to vLLM's draft model (`lightning_tlt.core.types.DrafterHost`).

        A drafter whose weights are not all finite is refused with a warning and ``False``. The
        weights are copied into the engine's own frozen copy (made on the first call), which is then
        pushed (`update_drafter_weights`); ``version`` is recorded (``None``: one more).
        """
        from lightning_tlt.drafters.eagle import EagleDrafter

        if not isinstance(drafter, EagleDrafter):
            raise TypeError(f"set_drafter takes an EagleDrafter, got {type(drafter).__name__}")
        bad = [name for name, t in drafter.state_dict().items() if not bool(torch.isfinite(t).all())]
        if bad:
            warnings.warn(f"refusing to publish a drafter with non-finite weights ({', '.join(bad[:3])}); vLLM keeps "
                          f"drafter version {self._drafter_version}", stacklevel=2)  # fmt: skip
            return False
        current = self._drafter
        if isinstance(current, EagleDrafter) and current is not drafter and current.same_layout(drafter):
            current.copy_weights_from(drafter)
        else:
            current = drafter.inference_copy()
            self._drafter = current
        before = self._drafter_version
        self.update_drafter_weights(current)
        self._drafter_version = before + 1 if version is None else int(version)
        return True

    def stage_drafter(self, drafter: Any) -> None:
        """Nothing to prepare: vLLM's draft model is loaded with the engine (``speculative_config``)."""

    def adaptive_state_dict(self) -> dict[str, Any]:
        """The native engine's checkpoint hook: empty here, vLLM's speculation keeps no state worth resuming
        (TLT's schedule is passed in whole by `speculative_config`)."""
        return {}

    def load_adaptive_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accept what `adaptive_state_dict` (of either engine) returned; nothing to restore in vLLM."""

    # ------------------------------------------------------------------ construction helpers
    def _materialize(self, model_or_path: nn.Module | str | os.PathLike[str], tokenizer: Any) -> Path:
        if isinstance(model_or_path, (str, os.PathLike)):
            path = Path(model_or_path)
            if not (path / "config.json").is_file():
                raise ValueError(
                    f"model_or_path must be an HF model directory (config.json) or a model, got {str(path)!r}"
                )
            if tokenizer is not None and not (path / "tokenizer_config.json").is_file():
                warnings.warn(f"tokenizer is ignored: {str(path)!r} is loaded as it is", stacklevel=3)
            return path
        if not isinstance(model_or_path, nn.Module) or not hasattr(unwrap_module(model_or_path), "save_pretrained"):
            raise ValueError(
                f"model_or_path must be an HF PreTrainedModel or a directory path, got {type(model_or_path).__name__}"
            )
        self._policy = model_or_path
        self._tmpdir = tempfile.TemporaryDirectory(prefix="lightning-tlt-vllm-")
        path = Path(self._tmpdir.name)
        hf: Any = unwrap_module(model_or_path)
        if is_sharded(hf):  # no rank holds the weights whole: vLLM starts on dummy ones and gets them pushed
            hf.config.save_pretrained(path)
            if getattr(hf, "generation_config", None) is not None:
                hf.generation_config.save_pretrained(path)
        else:
            hf.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return path

    # ------------------------------------------------------------------ listeners (as RolloutEngine)
    def add_listener(self, fn: StepListener) -> None:
        """Call ``fn(StepEvent)`` once per ``generate``, with phase "done" (vLLM steps internally)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: StepListener) -> None:
        self._listeners.remove(fn)

    # ------------------------------------------------------------------ generation
    def validate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, num_samples: int
    ) -> list[list[int]]:
        """The checks ``generate`` runs on its arguments before any work, raising as the native engine does
        (`lightning_tlt.core.prompts`); returns the prompts as lists of token ids."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples!r}")
        ids = validate_prompts(
            prompts, self.vocab_size, max_new_tokens=sampling.max_new_tokens, max_seq_len=self.max_seq_len,
            positions=self.positions,
        )
        check_stop_ids(sampling.stop_token_ids or [], self.vocab_size)  # the caller's; the model's are its own
        return [list(p) for p in ids]

    def sampling_params(self, sampling: SamplingConfig, num_samples: int, seed: int) -> SamplingParams:
        """The ``vllm.SamplingParams`` of one prompt (see `sampling_params_kwargs`)."""
        stop = self.eos_ids if sampling.stop_token_ids is None else list(sampling.stop_token_ids)
        return self._sampling_params_cls(**sampling_params_kwargs(sampling, num_samples, seed, stop))

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig | None = None,
        num_samples: int = 1,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """Sample ``num_samples`` completions of every prompt with vLLM.

        Args:
            prompts: token-id lists.
            sampling: temperature (0 = greedy), top-k, top-p, max new tokens, stop tokens.
            num_samples: completions per prompt (TRL's ``num_generations``; vLLM's ``n``).
            generator: seeds the sampling: one draw per prompt becomes that request's vLLM seed
                (the same generator state gives the same rollouts). ``None`` draws from torch's
                default generator.

        Returns:
            `RolloutOutput`, grouped by prompt. ``logprobs`` are of the processed distribution;
            under greedy decoding that distribution is one-hot, so they are 0.0, as in the native
            engine (vLLM itself reports the temperature-1 log-probability there).
        """
        sampling = sampling or SamplingConfig()
        ids = self.validate(prompts, sampling, num_samples)
        self._ensure_awake()
        if self.auto_sync and self._policy is not None and self._param_versions() != self._synced_versions:
            self.update_policy_weights(self._policy)
        source = "cpu" if generator is None else generator.device  # a CUDA generator draws on its device
        seeds = torch.randint(0, 2**62, (len(ids),), generator=generator, device=source).tolist()
        # greedy samples are all alike (and vLLM refuses n > 1 without sampling): decode once, copy
        n = 1 if sampling.greedy else num_samples
        params = [self.sampling_params(sampling, n, int(s)) for s in seeds]
        requests = [{"prompt_token_ids": p} for p in ids]
        before = self._spec_counters()
        start = time.perf_counter()
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = self._spec_counters()
        prompt_ids: list[list[int]] = []
        completion_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        reasons: list[FinishReason] = []
        for prompt, out in zip(ids, outputs):
            completions = sorted(out.outputs, key=lambda c: c.index)
            for completion in completions * (num_samples // len(completions)):
                tokens = list(completion.token_ids)
                prompt_ids.append(list(prompt))
                completion_ids.append(tokens)
                if sampling.greedy:
                    logprobs.append([0.0] * len(tokens))
                else:
                    logprobs.append(
                        [float(step[t].logprob) for step, t in zip(completion.logprobs or [], tokens)]
                    )
                reasons.append("stop" if completion.finish_reason == "stop" else "length")
        if self.speculative.enabled and not sampling.greedy:
            logprobs = self._speculative_logprobs(prompt_ids, completion_ids, logprobs, sampling)
        generated = sum(len(c) for c in completion_ids)
        stats: dict[str, float] = {
            "tokens": float(generated),
            "wall_time_s": wall,
            "tokens_per_s": generated / wall if wall > 0 else 0.0,
            "policy_version": float(self.policy_version),
            "drafter_version": float(self._drafter_version),
        }
        if self.speculative.enabled:
            drafts, drafted, accepted = (a - b for a, b in zip(after, before))
            stats.update(
                spec_drafts=drafts,
                spec_draft_tokens=drafted,
                spec_accepted_tokens=accepted,
                spec_acceptance_rate=accepted / drafted if drafted > 0 else 0.0,
                # tokens per speculative row-step (accepted + the bonus token), as `engine_metrics` reads
                spec_accept_len=1.0 + accepted / drafts if drafts > 0 else 1.0,
                # share of row-steps that drafted (each row-step yields 1 + its accepted tokens)
                spec_fraction=drafts / (generated - accepted) if generated > accepted else 0.0,
            )
        self.last_stats = stats
        event = StepEvent(
            step=1,
            phase="done",
            active_rows=0,
            queued_rows=0,
            num_slots=len(completion_ids),
            step_time_s=wall,
            new_tokens=generated,
        )
        for fn in list(self._listeners):
            fn(event)
        return RolloutOutput(prompt_ids, completion_ids, logprobs, reasons, stats)

    def _speculative_logprobs(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        vllm_logprobs: list[list[float]],
        sampling: SamplingConfig,
    ) -> list[list[float]]:
        """Log-probabilities of speculatively decoded tokens, recomputed by the policy.

        vLLM 0.32 misplaces the logprobs of tokens decided by its rejection sampler (measured on
        CPU: values of all-zero logit rows, ``-log(V)``, 0.0 and NaN). When this engine holds the
        policy (built from a module, or given one by `update_policy_weights`), the completions
        are scored by one forward pass of it, through `processed_probs` (the sampled
        distribution); otherwise vLLM's values are returned with a warning.
        """
        if self._policy is None:
            warnings.warn(
                "vLLM's logprobs under speculative decoding are unreliable (vLLM 0.32) and this engine holds no "
                "policy module to recompute them: pass the model to VLLMRolloutEngine or update_policy_weights",
                stacklevel=3,
            )
            return vllm_logprobs
        return policy_logprobs(self._policy, prompt_ids, completion_ids, sampling)

    def _spec_counters(self) -> tuple[float, float, float]:
        """vLLM's cumulative (drafts, draft tokens, accepted tokens) counters."""
        if not self.speculative.enabled:
            return (0.0, 0.0, 0.0)
        values = {
            "vllm:spec_decode_num_drafts": 0.0,
            "vllm:spec_decode_num_draft_tokens": 0.0,
            "vllm:spec_decode_num_accepted_tokens": 0.0,
        }
        for metric in self.llm.get_metrics():
            if metric.name in values:
                values[metric.name] += float(getattr(metric, "value", 0.0))
        return (
            values["vllm:spec_decode_num_drafts"],
            values["vllm:spec_decode_num_draft_tokens"],
            values["vllm:spec_decode_num_accepted_tokens"],
        )

    # ------------------------------------------------------------------ weights
    @property
    def in_process(self) -> bool:
        """Whether vLLM's workers live in this process (then tensors are passed, not serialised)."""
        core = type(self.llm.llm_engine.engine_core).__name__
        backend = self.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
        return core == "InprocClient" and backend in ("uni", "external_launcher")

    def _push(self, weights: Iterable[tuple[str, Tensor]], draft: bool) -> int:
        payload: bytes | Iterable[tuple[str, Tensor]] = weights if self.in_process else encode_weights(weights)
        counts = self.llm.collective_rpc("tlt_load_weights", args=(payload, draft))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        return int(counts[0])

    def update_policy_weights(self, model: nn.Module | Mapping[str, Tensor] | None = None) -> int:
        """Push the policy's current weights into vLLM (call after each optimizer step).

        Args:
            model: the policy (wrappers such as DDP are unwrapped; HF parameter names), or a
                name -> tensor mapping; ``None`` pushes the model this engine was built from.

        Returns:
            The number of tensors pushed.
        """
        if model is None:
            if self._policy is None:
                raise ValueError("update_policy_weights(None) needs an engine built from a model, got a path")
            model = self._policy
        self._ensure_awake()
        count = self._push(named_weights(model, self._model_dtype()), draft=False)
        if isinstance(model, nn.Module):
            self._policy = model  # scores speculative logprobs, re-pushed after a level-2 sleep
            self._synced_versions = self._param_versions()
        self.policy_version += 1
        return count

    def _param_versions(self) -> tuple[int, ...]:
        """In-place modification counters of the held policy's parameters (empty without one; a sharded
        policy's ``DTensor`` s count their own in-place updates, which every optimizer step makes on every rank)."""
        if self._policy is None:
            return ()
        return tuple(p._version for p in unwrap_module(self._policy).parameters())

    def _model_dtype(self) -> torch.dtype | None:
        """vLLM's model dtype: what a sharded policy's gathered tensors are cast to on the way."""
        dtype = getattr(getattr(self.llm.llm_engine.vllm_config, "model_config", None), "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def update_drafter_weights(
        self, drafter: nn.Module | Mapping[str, Tensor] | str | os.PathLike[str]
    ) -> int:
        """Load a new version of the EAGLE drafter into vLLM's running draft model.

        vLLM 0.32 has a runtime draft-weight update of its own (``start_draft_weight_update``), but
        only through its NCCL / CUDA-IPC weight-transfer engines; colocated, the same in-place
        layerwise reload is driven directly on the worker's draft model.

        Args:
            drafter: an exported directory (``model.safetensors`` of ``EagleDrafter.save_pretrained``),
                a mapping in that layout, or a module with ``save_pretrained`` (exported to a
                temporary directory and read back, so exactly the exported layout is pushed).

        Returns:
            The number of tensors pushed.
        """
        if self.speculative.method != "eagle":
            raise ValueError(
                f"update_drafter_weights needs an engine speculating with method 'eagle', got {self.speculative.method!r}"
            )
        self._ensure_awake()
        count = self._push(drafter_weights(drafter), draft=True)
        self._drafter_version += 1
        return count

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, level: int = 1) -> None:
        """Free vLLM's accelerator memory for training (level 1: offload weights, drop KV; level 2:
        drop both: the next `generate` or `wake_up` re-pushes the policy's weights).

        A no-op with a warning where vLLM has no sleep mode (CPU) or it was not enabled.
        """
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if not self.sleep_supported:
            warnings.warn(
                "vLLM sleep mode is unavailable here (needs CUDA/ROCm/XPU and enable_sleep_mode=True); sleep() does nothing",
                stacklevel=2,
            )
            return
        if self._asleep_level is None:
            self.llm.sleep(level=level)
            self._asleep_level = level

    def wake_up(self) -> None:
        """Undo `sleep` (re-pushing the policy after a level-2 sleep); a no-op when awake."""
        if not self.sleep_supported:
            warnings.warn("vLLM sleep mode is unavailable here; wake_up() does nothing", stacklevel=2)
            return
        self._ensure_awake()

    @property
    def is_sleeping(self) -> bool:
        return self._asleep_level is not None

    def _ensure_awake(self) -> None:
        level = self._asleep_level
        if level is None:
            return
        self.llm.wake_up()
        self._asleep_level = None
        if level == 2:
            if self._policy is None:
                raise RuntimeError(
                    "vLLM dropped its weights in a level-2 sleep; call update_policy_weights(model) after wake_up"
                )
            self._push(named_weights(self._policy, self._model_dtype()), draft=False)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Shut vLLM down and remove the temporary model directory."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del self.llm
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> VLLMRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
