"""Gradient accumulation in one process: N micro-batches of b sequences make the same optimizer step
as one micro-batch of N·b sequences (the same global batch) — the same loss, the same gradient of
every parameter before clipping, the same gradient norm and the same weights after AdamW.

The gradients are compared, not only the losses: a micro-batch loss left undivided by N scales every
gradient by N, which AdamW's first steps almost hide (its update is about lr·sign(g)), so the losses
of a short run barely move.

Tolerances (fp32): loss, gradient norm and each gradient within 1e-5 relative (a gradient: of its
tensor's largest element). Accumulation sums the same n = 512 per-token terms in another order
(N partial sums instead of one); a float32 sum of n terms in another order differs by at most
n·u ≈ 3e-5 of the sum of the terms' magnitudes (u = 2^-24), typically √n·u ≈ 1.4e-6. Measured:
gradients ≤ 7.8e-7 of their tensor's largest element, loss and norm ≤ 1 ulp. A plant changes them
by the factor N ≥ 2.
Weights after the step: AdamW's first update is lr·g/(|g| + ε) per element (m̂ = g, v̂ = g²), whose
slope in g is ε/(|g| + ε)²; so the gradients' difference δg moves a weight by at most
lr·|δg|·ε/(min|g| + ε)² (lr·|δg|/ε where the two gradients differ in sign), plus each run's
rounding: 1 ulp of the weight (2u·|w|) and about 4u·lr for the update (the moments, the bias
corrections, the square root and the division), u = 2^-24, twice for the two runs. The bound is
computed per element from the two runs' gradients — a bound, not a tolerance: tight wherever the
gradient is large against ε, lenient only where it is tiny. Measured: up to 0.99 of it (the slope
term is the first-order change itself; what is left is the rounding).
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY
from ultratron.config import load_config
from ultratron.training.trainer import Trainer

WHOLE = 8  # TINY's batch: 512 tokens = 8 sequences of 64
TOL = 1e-5


@pytest.fixture(scope="module")
def base(small_corpus, tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("grad-accum-data")  # tokenized once for every run of the module
    # grad_clip above the first step's norm (0.67): the optimizer sees the gradients compared here
    return TINY + ["--data.path", str(small_corpus), "--data.extensions", ".py", "--data.cache_dir", str(cache),
                   "--training.steps", "1", "--eval.interval", "0", "--training.grad_clip", "1.0"]


def _one_step(base: list[str], micro_batch_size: int, run_dir) -> dict:
    """One trainer step with `micro_batch_size`; what the step read, its gradients right after
    forward and backward (before clipping), its record and the weights after the optimizer."""
    trainer = Trainer(load_config(None, base + ["--training.micro_batch_size", str(micro_batch_size),
                                                "--run.dir", str(run_dir)]), echo=False)
    seen: dict = {"batches": []}
    read = trainer.train_loader.next_batch

    def recording_read():
        seen["batches"].append(read())
        return seen["batches"][-1]

    forward_backward = trainer.strategy.forward_backward

    def capturing(next_batch, n_micro_batches):
        loss = forward_backward(next_batch, n_micro_batches)
        seen["n_micro_batches"] = n_micro_batches
        seen["grads"] = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()}
        return loss

    trainer.train_loader.next_batch = recording_read
    trainer.strategy.forward_backward = capturing
    seen["record"] = trainer.train_step()
    seen["weights"] = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    seen["eps"] = trainer.cfg.optim.eps
    return seen


@pytest.fixture(scope="module")
def whole(base, tmp_path_factory) -> dict:
    return _one_step(base, WHOLE, tmp_path_factory.mktemp("whole"))


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_accumulated_micro_batches_make_the_same_step_as_one_batch(base, whole, micro_batch_size, tmp_path):
    acc = _one_step(base, micro_batch_size, tmp_path / "run")
    n = WHOLE // micro_batch_size
    assert acc["n_micro_batches"] == n and whole["n_micro_batches"] == 1
    # the same sequences, in the same order: the one-rank stream cut into smaller micro-batches
    for i in (0, 1):  # inputs, targets
        assert torch.equal(torch.cat([b[i] for b in acc["batches"]]), whole["batches"][0][i])

    mine, ref = acc["record"], whole["record"]
    assert mine["lr"] == ref["lr"]
    assert abs(mine["loss"] - ref["loss"]) <= TOL * ref["loss"], (mine["loss"], ref["loss"])
    assert abs(mine["grad_norm"] - ref["grad_norm"]) <= TOL * ref["grad_norm"], (mine["grad_norm"], ref["grad_norm"])
    assert ref["grad_norm"] < 1.0  # below grad_clip: the optimizer stepped with the gradients compared below

    lr, eps = ref["lr"], whole["eps"]
    assert acc["grads"].keys() == whole["grads"].keys()
    for name, expected in whole["grads"].items():
        got = acc["grads"][name]
        largest = float(expected.abs().max())
        assert largest > 0, name  # every parameter has a gradient: the comparison is not of zeros
        gap = float((got - expected).abs().max())
        assert gap <= TOL * largest, f"{name}: gradients differ by {gap:.3g}, {gap / largest:.3g} of the largest"

        smaller = torch.where(got.sign() == expected.sign(), torch.minimum(got.abs(), expected.abs()), 0.0)
        bound = lr * (got - expected).abs() * eps / (smaller + eps) ** 2
        u = torch.finfo(torch.float32).eps / 2  # the unit roundoff, 2^-24
        bound += 2 * (2 * u * whole["weights"][name].abs() + 4 * u * lr)  # each run's rounding of the update
        moved = (acc["weights"][name] - whole["weights"][name]).abs()
        assert bool((moved <= bound).all()), f"{name}: weights differ by up to {float(moved.max()):.3g} after AdamW"


MOE = ["--model.n_experts", "4", "--model.n_active_experts", "2", "--model.expert_ffn_dim", "64",
       "--training.micro_batch_size", "2"]


def _moe_gradients(base: list[str], batch_tokens: int, run_dir) -> tuple[int, dict]:
    """One MoE trainer step whose every micro-batch is the loader's first one: its micro-batch count and
    gradients."""
    trainer = Trainer(load_config(None, base + MOE + ["--training.batch_tokens", str(batch_tokens),
                                                      "--run.dir", str(run_dir)]), echo=False)
    first = trainer.train_loader.next_batch()
    seen = {}
    forward_backward = trainer.strategy.forward_backward

    def capturing(next_batch, n_micro_batches):
        loss = forward_backward(lambda: first, n_micro_batches)
        seen["n"] = n_micro_batches
        seen["grads"] = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()
                         if p.grad is not None}
        return loss

    trainer.strategy.forward_backward = capturing
    trainer.train_step()
    return seen["n"], seen["grads"]


def test_the_moe_balancing_loss_takes_a_micro_batchs_share_of_the_step(base, tmp_path):
    """Four copies of one micro-batch make the step one copy makes: the cross-entropy is divided by
    the micro-batch count, and so must the balancing loss be, whose gradient the router injects in
    backward itself (`loss_weight`); counted whole per micro-batch, the routers' gradients would
    carry four times their balancing share."""
    n, repeated = _moe_gradients(base, 4 * 2 * 64, tmp_path / "four")
    one, once = _moe_gradients(base, 2 * 64, tmp_path / "one")
    assert (n, one) == (4, 1)
    routers = [name for name in once if "router" in name]
    assert once.keys() == repeated.keys() and routers and all(float(once[name].abs().max()) > 0 for name in routers)
    for name, expected in once.items():
        gap = float((repeated[name] - expected).abs().max())
        assert gap <= TOL * float(expected.abs().max()), f"{name}: differs by {gap:.3g}"
