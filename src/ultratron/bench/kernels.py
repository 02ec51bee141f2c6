"""The model's own work that the planner's matmul rate does not cover, timed on one rank for
`ultratron bench comm`: a block's forward + backward, the ends of the model (embedding, final norm,
head and the fp32 cross-entropy) forward + backward, the family's attention forward + backward, and
the optimizer step (gradient-norm clipping and fused AdamW, as the trainer runs them). Each is timed
at the given micro-batch and sequence and, for the fixed cost of its calls, at one token; the median
of `repeat` runs after a warm-up, each paced by a square matmul timed just before it (see
`kernel_measurements`). `planning.profile.fit_kernels` turns the times into the planner's
rates (the products and attention the compute term prices taken off).

The model is built through the registry at the preset's width with one layer, and cut with its
family's own pipeline stages: a stage holding only the block (hidden states in and out) and one
holding the embedding and the head (token ids in, logits out).
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from ultratron.bench.timing import seconds_of
from ultratron.models import registry
from ultratron.planning.rules import head_dim_of


def kernel_measurements(model: str, shape, micro_batch: int, seq: int, device, precision: str,
                        repeat: int, matmul: tuple[int, float]) -> dict:
    """The profile's `kernel_measurements`: where they were taken and their seconds (module docstring).
    `matmul` (size, FLOP/s): the square product and its rate the times are paced by — each run is
    timed right after that product and kept as the ratio of the two, the median ratio times the
    product's time at that rate, so that a shared machine's load changing between the rate's
    measurement and these leaves the times at the same pace as the rate they are fitted against."""
    size, rate = matmul
    left, right = (torch.randn(size, size, device=device,
                               dtype=torch.bfloat16 if precision == "bf16" else torch.float32) for _ in "lr")

    def _median_seconds(run) -> float:
        run()  # warm-up
        ratios = []
        for _ in range(repeat):
            product = seconds_of(lambda: left @ right, device)
            ratios.append(seconds_of(run, device) / product)
        return statistics.median(ratios) * 2 * size**3 / rate

    torch.manual_seed(0)
    one_layer = registry.build_model(replace(shape, n_layers=1), device)
    plan = registry.plan_of(one_layer)
    block = plan.pipeline_stage(one_layer, list(plan.blocks(one_layer))[:1], False, False)
    ends = plan.pipeline_stage(one_layer, [], True, True)
    params = list(one_layer.parameters())  # the one-layer model's, as the planner counts them (tied once)
    trained = params + list(ends.parameters())  # with the ends' untied copy of the head
    cast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()

    def backward(out: torch.Tensor, *inputs: torch.Tensor) -> None:
        for p in (*trained, *inputs):  # each run as a step's first micro-batch: no gradient to accumulate into
            p.grad = None
        out.backward(torch.ones_like(out))

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # the trainer's: fp32 logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    seconds = {}
    for suffix, (b, s) in (("", (micro_batch, seq)), ("_one_token", (1, 1))):
        hidden = torch.randn(b, s, shape.dim, device=device, requires_grad=True)
        tokens = torch.randint(0, shape.vocab_size, (b, s), device=device)
        with cast:
            seconds["layer" + suffix] = _median_seconds(lambda x=hidden: backward(block(x), x))
            seconds["loss" + suffix] = _median_seconds(lambda t=tokens: backward(loss(ends(t), t)))
    hd = head_dim_of(shape)
    q = torch.randn(micro_batch, shape.n_heads, seq, hd, device=device, requires_grad=True)
    k, v = (torch.randn(micro_batch, shape.n_kv_heads, seq, hd, device=device, requires_grad=True) for _ in "kv")
    groups = shape.n_heads // shape.n_kv_heads
    with cast:
        seconds["attention"] = _median_seconds(lambda: backward(plan.attention(q, k, v, None, groups), q, k, v))
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type in ("cpu", "cuda"))

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    seconds["optimizer"] = _median_seconds(step)
    return {"model": model, "shape": asdict(shape), "micro_batch": micro_batch, "seq": seq, "precision": precision,
            "paced_by": {"matmul_size": size, "matmul_flops": rate}, "seconds": seconds}
