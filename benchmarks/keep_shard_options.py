"""Ways to keep only the sequence shard of a column-parallel layer's gathered input under tp+sp,
side by side on the CPU shape (docs/parallel.md "Activations under tensor and sequence parallel"):

- hooks: the trainer's own (`parallel.tensor.KeepSequenceShard`'s saved-tensor hooks);
- SAC: torch's selective activation checkpoint around the attention and the MLP module, with a
  policy that recomputes only the sequence all-gather (`_GatherOnly`) and saves every other op's
  output;
- input_reshard: torch's `torch.distributed.tensor.parallel.input_reshard` hooks, around each
  column-parallel linear layer (wq, wk, wv, w1, w3), or around the attention and the MLP module;
- plain sp: none of them (the trainer's hook switched off): autograd keeps the gathered tensor.

One trainer per process serves them all (the same weights and batch): each variant's per-block kept
bytes (`dist_jobs.micro_batch_memory`), the largest difference of its gradients from the hooks'
(this rank's shards, one micro-batch), and the median time of a micro-batch's forward and backward,
the variants taking turns so that a busy machine slows them alike.

  python benchmarks/activation_memory.py --shard-options [--tp 2,4]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor.parallel.input_reshard import input_reshard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

VARIANTS = ("hooks", "SAC", "input_reshard, linears", "input_reshard, modules", "plain sp")
COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3")
ROUNDS = 9


class _GatherOnly:
    """The policy: recompute the all-gather (the collective, its wait, and the split and cat that put
    the gathered chunks in sequence order: every op from an all-gather up to the next cat), save
    the output of every other op. It sees the ops in the same order in forward and in the
    recomputation, so its state gives the same answers in both."""

    def __init__(self):
        self.gathering = False
        self.recomputed: set[str] = set()

    def __call__(self, ctx, op, *args, **kwargs):
        if op is torch.ops._c10d_functional.all_gather_into_tensor.default:
            self.gathering = True
        recompute = self.gathering
        if op is torch.ops.aten.cat.default:
            self.gathering = False
        if recompute:
            self.recomputed.add(str(op))
        return CheckpointPolicy.PREFER_RECOMPUTE if recompute else CheckpointPolicy.MUST_SAVE


class _Call(nn.Module):
    """`inner` under a module of its own, which carries `input_reshard`'s hooks (they fire on every
    call), so that `_Option` can run `inner` without them."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class _Option(nn.Module):
    """`inner` run as it is (`mode` None), under a selective checkpoint ("SAC"), or under torch's
    `input_reshard` hooks ("reshard"), which keep what it saves of replicated tensors (and of plain
    ones) as sequence shards and gather them again in backward."""

    def __init__(self, inner: nn.Module, mesh):
        super().__init__()
        self.inner, self.mode, self.policy = inner, None, _GatherOnly()
        self.resharded = input_reshard(_Call(inner), mesh, input_reshard_dim=1)

    def forward(self, *args, **kwargs):
        if self.mode == "reshard":
            return self.resharded(*args, **kwargs)
        if self.mode == "SAC":
            context = partial(create_selective_checkpoint_contexts, self.policy)
            return checkpoint(self.inner, *args, use_reentrant=False, context_fn=context, **kwargs)
        return self.inner(*args, **kwargs)


def _variants(tp: int) -> tuple[str, ...]:
    """All of them at tp2; at tp4 a rank died of SIGFPE in "input_reshard, modules", which gives
    wrong gradients anyway (docs/parallel.md)."""
    return VARIANTS if tp == 2 else tuple(v for v in VARIANTS if v != "input_reshard, modules")


def measure_options(base: list[str], out_dir: str) -> None:
    import torch.distributed as dist
    from dist_jobs import micro_batch_memory

    from ultratron.config import load_config
    from ultratron.parallel import tensor
    from ultratron.training.trainer import Trainer

    trainer = Trainer(load_config(None, base + ["--run.dir", f"{out_dir}/run"]), echo=False)
    mesh, modules, linears = trainer.dims.tp_mesh, [], []
    for block in trainer.model.layers.values():
        for name in ("attention", "feed_forward"):
            module = getattr(block, name)
            for layer in COLUMN_PARALLEL:
                if hasattr(module, layer):
                    linears.append(_Option(getattr(module, layer), mesh))
                    setattr(module, layer, linears[-1])
            modules.append(_Option(module, mesh))
            setattr(block, name, modules[-1])
    hooking = tensor._can_hook_saved_tensors

    def choose(variant: str) -> None:
        for option in modules:
            option.mode = {"SAC": "SAC", "input_reshard, modules": "reshard"}.get(variant)
        for option in linears:
            option.mode = "reshard" if variant == "input_reshard, linears" else None
        tensor._can_hook_saved_tensors = hooking if variant in ("hooks", "SAC") else (lambda: False)

    variants = _variants(trainer.dims.tp)
    memory, grads, times = {}, {}, {v: [] for v in variants}
    inputs, targets = trainer.train_loader.next_batch()
    for variant in variants:
        choose(variant)
        memory[variant] = micro_batch_memory(trainer)
        trainer.model.zero_grad()
        times[variant].append(_forward_backward(trainer, inputs, targets))
        grads[variant] = [p.grad.to_local().clone() for p in trainer.model.parameters() if p.grad is not None]
    for _ in range(ROUNDS):
        for variant in variants:
            choose(variant)
            times[variant].append(_forward_backward(trainer, inputs, targets))
    result = {v: {**memory[v], "seconds": statistics.median(times[v][1:]),
                  "grad_diff": _largest_gap(grads[v], grads["hooks"])} for v in variants}
    result["recomputed"] = sorted(set().union(*(option.policy.recomputed for option in modules)))
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


def _largest_gap(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest |difference| of two lists of gradients; infinite where shapes differ."""
    if [g.shape for g in grads] != [r.shape for r in reference]:
        return float("inf")
    return max((g - r).abs().max().item() for g, r in zip(grads, reference, strict=True))


def _forward_backward(trainer, inputs, targets) -> float:
    import torch.distributed as dist

    from ultratron.training.loss import cross_entropy

    dist.barrier()
    start = time.perf_counter()
    with trainer.axes.step_context(training=True), trainer.axes.micro_batch_context(last=False):
        cross_entropy(trainer.model(inputs), targets)[0].backward()
    return time.perf_counter() - start


def compare(tps: list[int], base: list[str]) -> None:
    from ultratron.launch.local import run_local

    print(f"{'CPU shape, one block':32} {'kept KiB':>9} {'grad gap':>9} {'fwd+bwd ms':>10} {'time / hooks':>12}")
    for tp in tps:
        with tempfile.TemporaryDirectory() as out:
            run_local(tp, measure_options, base + ["--parallel.tp", str(tp), "--parallel.sp", "true"], out)
            got = json.loads(Path(out, "rank0.json").read_text())
        print("    SAC recomputes:", ", ".join(got.pop("recomputed")))
        for variant in _variants(tp):
            row, seconds = got[variant], got[variant]["seconds"]
            print(f"{f'tp{tp}+sp, {variant}':32} {row['layer'] / 1024:9.1f} {row['grad_diff']:9.1e} "
                  f"{seconds * 1e3:10.1f} {seconds / got['hooks']['seconds']:12.3f}")
        sys.stdout.flush()
