"""Chunked token log-probabilities: the same numbers and gradients as the full logits, without the (N, V) tensors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from lightning_tlt.models.zoo import build_config, build_model
from lightning_tlt.rl.batch import RolloutBatch
from lightning_tlt.rl.common import completion_forward
from lightning_tlt.rl.config import GRPOConfig, PPOConfig
from lightning_tlt.rl.logprobs import chunked_token_logprobs, plain_lm_head

N, H, V = 10, 16, 50


def reference(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Today's full path: float32 log_softmax of the whole (N, V) logits."""
    logp = torch.log_softmax(F.linear(hidden, weight, bias).float() / temperature, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1).detach()


def leaves(bias: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    # hidden non-contiguous (a transposed view), as the model's sliced last hidden state can be
    hidden = torch.randn(H, N, generator=g).t().requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_(True)
    b = torch.randn(V, generator=g).requires_grad_(True) if bias else None
    targets = torch.randint(0, V, (2 * N,), generator=g)[::2]  # non-contiguous too
    upstream = torch.randn(N, 2, generator=g)[:, 0]  # a non-contiguous incoming gradient
    return hidden, weight, b, targets, upstream


@pytest.mark.parametrize("chunk", [1, 3, 5, N, 64])  # 3 leaves a remainder, 5 and N divide, 64 exceeds N
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_full_logits_and_gradients(chunk: int, bias: bool) -> None:
    hidden, weight, b, targets, upstream = leaves(bias)
    params = [hidden, weight] + ([b] if b is not None else [])
    logps, ent = reference(hidden, weight, b, targets, 0.7)
    want = torch.autograd.grad((logps * upstream).sum(), params)
    got_logps, got_ent = chunked_token_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=chunk, bias=b)
    assert not got_ent.requires_grad and got_logps.dtype == got_ent.dtype == torch.float32
    torch.testing.assert_close(got_logps, logps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_ent, ent, rtol=1e-5, atol=1e-6)
    for name, w, g in zip(("hidden", "weight", "bias"), want, torch.autograd.grad((got_logps * upstream).sum(), params)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)


def test_hand_computed_gradient_and_empty_input() -> None:
    # V = 2, H = 1, W = [[1], [-1]], h = 1, T = 2: logits (1/2, -1/2); d logp[0] / d h = (1 - p0) * (1 - (-1)) / T
    hidden = torch.ones(1, 1, requires_grad=True)
    weight = torch.tensor([[1.0], [-1.0]])
    logp, _ = chunked_token_logprobs(hidden, weight, torch.tensor([0]), temperature=2.0, chunk_tokens=1)
    p0 = 1 / (1 + torch.exp(torch.tensor(-1.0)))
    torch.testing.assert_close(logp, torch.log(p0)[None])
    logp.sum().backward()
    torch.testing.assert_close(hidden.grad, ((1 - p0) * 2 / 2).reshape(1, 1))
    empty = torch.zeros(0, 1, requires_grad=True)
    w = weight.clone().requires_grad_(True)
    logp, ent = chunked_token_logprobs(empty, w, torch.zeros(0, dtype=torch.long), chunk_tokens=4)
    assert logp.shape == ent.shape == (0,)
    logp.sum().backward()
    assert empty.grad is not None and empty.grad.shape == (0, 1)
    assert w.grad is not None and not w.grad.any()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_chunk_size_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"chunk_tokens must be an int >= 1, got {bad!r}"):
        chunked_token_logprobs(torch.zeros(2, H), torch.zeros(V, H), torch.zeros(2, dtype=torch.long), chunk_tokens=bad)
    if bad != 0:
        match = rf"logprob_chunk_tokens must be an int >= 0 \(0: the full logits\), got {bad!r}"
        with pytest.raises(ValueError, match=match):
            GRPOConfig(logprob_chunk_tokens=bad)
        with pytest.raises(ValueError, match=match):
            PPOConfig(logprob_chunk_tokens=bad)
    assert GRPOConfig(logprob_chunk_tokens=0).logprob_chunk_tokens == 0  # 0: the full path


# ---------------------------------------------------------------------------------- through completion_forward
def tied_qwen2(vocab_size: int | None = None) -> nn.Module:
    config = build_config("qwen2", "tiny", vocab_size=vocab_size)
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def batch_for(vocab: int, rows: int = 3, prompt: int = 4, completion: int = 9) -> RolloutBatch:
    g = torch.Generator().manual_seed(3)
    prompt_mask = (torch.arange(prompt)[None, :] >= torch.tensor([0, 2, 1][:rows])[:, None]).long()  # left-padded
    completion_mask = (torch.arange(completion)[None, :] < torch.tensor([completion, 4, 7][:rows])[:, None]).long()
    zeros = torch.zeros(rows)
    return RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (rows, prompt), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(3, vocab, (rows, completion), generator=g) * completion_mask,
        completion_mask=completion_mask, sampling_logprobs=torch.zeros(rows, completion), rewards=zeros,
        rewards_per_func=zeros[:, None], advantages=zeros, is_truncated=zeros.bool(), num_generations=1,
    )


def assert_grads_close(got: dict[str, Tensor], want: dict[str, Tensor], rel: float) -> None:
    """Each gradient within ``rel`` of its own largest entry: summing the head's gradient in a different order
    moves entries near zero by float rounding of the large ones, so an entrywise relative bound means nothing there."""
    assert got.keys() == want.keys()
    for name, w in want.items():
        err, scale = (got[name] - w).abs().max(), w.abs().max()
        assert err <= rel * scale, f"{name}: max error {err:.3g} > {rel} x {scale:.3g}"


def forward_and_grads(
    model: nn.Module, batch: RolloutBatch, chunk: int, autocast: bool = False
) -> tuple[Any, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fwd = completion_forward(model, batch, temperature=0.7, output_hidden_states=True, logprob_chunk_tokens=chunk)
    weights = torch.linspace(-1.0, 1.0, fwd.logps.numel()).view_as(fwd.logps)
    ((fwd.logps * weights * batch.completion_mask).sum() + fwd.hidden_states.square().mean()).backward()
    return fwd, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


MODELS = {
    "qwen2": lambda: build_model("qwen2", "tiny", seed=0),
    "qwen2-tied": tied_qwen2,
    "llama": lambda: build_model("llama", "tiny", seed=0),
    "qwen3": lambda: build_model("qwen3", "tiny", seed=0),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_completion_forward_chunked_equals_full(name: str) -> None:
    """Log-probs, entropies, the harvested hidden states and every parameter's gradient, chunked (27 tokens in
    chunks of 4: a remainder; of 9: none) or not, float32."""
    model = MODELS[name]().train()
    batch = batch_for(model.config.vocab_size)
    assert isinstance(plain_lm_head(model), tuple)
    full, full_grads = forward_and_grads(model, batch, 0)
    assert len(full_grads) == len(list(model.parameters()))
    for chunk in (4, 9):
        fwd, grads = forward_and_grads(model, batch, chunk)
        torch.testing.assert_close(fwd.logps, full.logps, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fwd.entropies, full.entropies, rtol=1e-5, atol=1e-6)
        assert torch.equal(fwd.hidden_states, full.hidden_states)  # the drafter's features: the same tensor
        assert_grads_close(grads, full_grads, 1e-5)


@pytest.mark.parametrize("name", ["qwen2", "qwen2-tied"])
def test_completion_forward_chunked_equals_full_under_bf16_autocast(name: str) -> None:
    """Under bf16 autocast both paths round the same bf16 logits, so log-probs agree to float32 rounding (1e-5); the
    head's backward rounds its product to bf16 (8 bits of mantissa) once for the whole batch in the full path
    and once per chunk here (the chunks then summed in float32), so each gradient agrees to about one bf16 ulp
    (2^-8 = 3.9e-3) of its largest entry: bounded by 1e-2, below what bf16 autocast itself moves it from float32."""
    model = MODELS[name]().train()
    batch = batch_for(model.config.vocab_size)
    full, full_grads = forward_and_grads(model, batch, 0, autocast=True)
    fwd, grads = forward_and_grads(model, batch, 4, autocast=True)
    torch.testing.assert_close(fwd.logps, full.logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fwd.entropies, full.entropies, rtol=1e-5, atol=1e-5)
    assert torch.equal(fwd.hidden_states, full.hidden_states)
    assert_grads_close(grads, full_grads, 1e-2)  # measured 4.5e-3 (lm_head); bf16 vs float32: 1.4e-2


def test_unknown_or_transformed_heads_take_the_full_path() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    batch = batch_for(model.config.vocab_size)
    capped = copy.deepcopy(model)
    capped.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in str(plain_lm_head(capped))
    hooked = copy.deepcopy(model)
    hooked.lm_head.register_forward_hook(lambda m, i, o: o * 2)
    assert "forward hooks" in str(plain_lm_head(hooked))

    class Wrapped(type(model)):  # type: ignore[misc]
        pass

    sub = copy.deepcopy(model)
    sub.__class__ = Wrapped
    assert "not one of the known" in str(plain_lm_head(sub))
    with pytest.warns(UserWarning, match="logprob_chunk_tokens=4 ignored for Qwen2ForCausalLM: it or its output"):
        doubled = completion_forward(hooked, batch, temperature=1.0, logprob_chunk_tokens=4)
    # the hook's doubled logits are what the full path sees: the chunked path would have missed them
    plain = completion_forward(model, batch, temperature=0.5, logprob_chunk_tokens=0)
    torch.testing.assert_close(doubled.logps, plain.logps, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"logprob_chunk_tokens must be an int >= 0 \(0: the full logits\), got -1"):
        completion_forward(model, batch, temperature=1.0, logprob_chunk_tokens=-1)


class LargestLogits(TorchDispatchMode):
    """The most elements of any tensor an op returns whose last dimension is the vocabulary (logits,
    probabilities and their gradients), but for the head's weight seen transposed, ``(H, V)``."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.largest = vocab, hidden, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.dim() and t.shape[-1] == self.vocab and tuple(t.shape) != (self.hidden, self.vocab):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tokens_by_vocabulary_tensor_exists_forward_or_backward() -> None:
    vocab = 1024  # unlike every other width of the tiny model (hidden 128, MLP 256)
    model = build_model("qwen2", "tiny", seed=0, vocab_size=vocab).train()
    batch = batch_for(vocab)
    tokens = batch.completion_ids.numel()  # 27
    largest = {}
    for chunk in (0, 4):
        with LargestLogits(vocab, model.config.hidden_size) as mode:
            forward_and_grads(model, batch, chunk)
        largest[chunk] = mode.largest
    assert largest[0] >= tokens * vocab  # today's path: the whole (B, C, V) logits, and more
    assert largest[4] == 4 * vocab  # chunked: never more than one chunk of logits, forward or backward


def test_grpo_update_is_the_same_with_chunking_on_and_off(tmp_path: Path) -> None:
    """Two optimizer steps of a real Trainer on one rollout batch: the same gradients and updated weights.

    A large ``adam_epsilon`` keeps Adam from blowing float noise in near-zero gradients up to full-size steps.
    """
    from test_grpo import Grads, make, trainer  # a sibling (rootdir-relative imports, as the suite uses)

    runs = {}
    for chunk in (0, 5):
        module, data = make(seed=2, num_iterations=2, beta=0.04, adam_epsilon=1e-3, logprob_chunk_tokens=chunk)
        grads = Grads()
        trainer(tmp_path / str(chunk), 2, [grads]).fit(module, datamodule=data)
        runs[chunk] = (module, grads)
    (full, full_grads), (chunked, chunked_grads) = runs[0], runs[5]
    assert len(full_grads.steps) == len(chunked_grads.steps) == 2
    for step in range(2):
        assert_grads_close(chunked_grads.steps[step], full_grads.steps[step], 1e-5)
    initial = build_model("qwen2", "tiny", seed=2).state_dict()
    after = chunked.policy.state_dict()
    for name, w in full.policy.state_dict().items():
        assert not torch.equal(w, initial[name]) or "norm" in name, name  # the update moved the weights
        torch.testing.assert_close(after[name], w, rtol=1e-5, atol=1e-6, msg=name)


def saved_bytes(model: nn.Module, batch: RolloutBatch, chunk: int) -> int:
    """Bytes of the tensors the training forward saves for its backward (autograd's saved tensors)."""
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_forward(model, batch, temperature=0.7, output_hidden_states=True, logprob_chunk_tokens=chunk)
    return total


@pytest.mark.parametrize("name", ["qwen2", "qwen2-tied", "llama"])
def test_checkpointed_layers_give_the_same_gradients_and_save_a_fraction(name: str) -> None:
    # issue 37: on an H100 the 0.5 B policy's training step at 16,384 micro-batch tokens peaked at 41.8 GiB,
    # the memory model's 13.7 GiB assuming checkpointed layers the kit did not have
    from lightning_tlt.rl.fsdp import checkpoint_layers

    reference = MODELS[name]().train()
    model = copy.deepcopy(reference)
    assert checkpoint_layers(model) == reference.config.num_hidden_layers
    assert checkpoint_layers(model) == 0  # once only
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    batch = batch_for(reference.config.vocab_size)
    want, want_grads = forward_and_grads(reference, batch, 4)
    got, grads = forward_and_grads(model, batch, 4)
    torch.testing.assert_close(got.logps, want.logps, rtol=0, atol=0)  # the same forward
    assert torch.equal(got.hidden_states, want.hidden_states)
    assert_grads_close(grads, want_grads, 1e-6)  # the recompute's gradients
    assert saved_bytes(model, batch, 4) < 0.5 * saved_bytes(reference, batch, 4)


def test_a_checkpointed_layer_recomputes_with_its_forwards_attention_kernel() -> None:
    # issue 37, on an H100: the training forward ran under `training_attention` (flash), the recompute in
    # the backward outside it picked cuDNN's kernel and torch raised CheckpointError (saved statistics of
    # another shape). The CPU shows the same with a forward under MATH: the recompute would pick flash.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_tlt.rl.fsdp import checkpoint_layers

    reference = MODELS["qwen2"]().train()
    model = copy.deepcopy(reference)
    checkpoint_layers(model)
    ids = torch.randint(3, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a padded row: the CPU's default then picks flash, MATH saves other tensors

    def grads(m: nn.Module) -> dict[str, Tensor]:
        with sdpa_kernel([SDPBackend.MATH]):
            logits = m(input_ids=ids, attention_mask=mask, use_cache=False).logits
        (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()  # outside the `with`
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    assert_grads_close(grads(model), grads(reference), 1e-6)
