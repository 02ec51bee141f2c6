"""Data parallelism by ZeRO stage, on PyTorch's own pieces.

  zero 0  DDP: gradients all-reduced in 25 MB buckets while backward still runs; under gradient
          accumulation only the last micro-batch synchronises (`no_sync`).
  zero 1  DDP + ZeroRedundancyOptimizer: each rank keeps the AdamW state of its own share of the
          parameters, steps those, and broadcasts the updated weights.
  zero 2  FSDP2 `fully_shard(reshard_after_forward=False)`: gradients reduce-scattered, optimizer
          state sharded; parameters stay gathered from forward through backward.
  zero 3  FSDP2 `fully_shard(reshard_after_forward=True)`: parameters gathered per block just in
          time, in forward and again in backward (≈1.5× the traffic of DP: Ultra-Scale Playbook),
          and gradients reduce-scattered after every micro-batch, the shards adding up.
  HSDP    `parallel.dp_replicate > 1`: FSDP2 on a 2-D mesh, sharded within each group of
          dp / dp_replicate ranks and replicated (all-reduced) across the groups.

DDP cannot take DTensor parameters, so when data parallelism meets tensor parallelism it always
runs as FSDP2 (zero 0/1 as zero 2: the same arithmetic, sharded state as a bonus). Under pipeline
parallelism torch's stages run backward themselves (the zero-bubble schedules in separate input
and weight parts, which DDP's autograd hooks do not follow) and call FSDP2's gradient reduction
once after the last micro-batch, each stage an FSDP root; so zero 0 runs as FSDP2's `replicate`
(DDP's arithmetic: parameters, gradients and optimizer state replicated, gradients all-reduced)
and zero 1 as zero 2.
Mixed precision: under bf16 (and fp8, `float8.py`, but for its fp8-gathered weights) FSDP2 keeps
bf16 parameters in flight and reduces in fp32 (`MixedPrecisionPolicy`); DDP runs bf16 compute
through autocast on fp32 weights. Either way the master weights, the reductions and the optimizer
state are fp32.

Context-parallel ranks hold other tokens of the same sequences, so the gradients are reduced over
dp × cp (the flattened mesh `ParallelDims.dp_mesh` gives); the loss and token counts, though, are
averaged here over the dp ranks only, and the context axis adds its own ranks.

In a step (`DataAxis`): gradients are reduced only on a step's last micro-batch (`no_sync`, or
FSDP2's `set_requires_gradient_sync`), but under ZeRO-3, which reduce-scatters every micro-batch's
and adds up the shards; the training loss is the mean over the dp ranks (validation
runs the same batch on every dp rank); ZeRO-1 wraps the optimizer; DDP's gradients stay as views
of its buckets, zeroed in place.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ultratron.models.plan import ParallelPlan
from ultratron.parallel.axis import Axis
from ultratron.parallel.dims import ParallelDims
from ultratron.planning.rules import gathers_per_linear


def apply_fsdp(model: nn.Module, dims: ParallelDims, precision: str, plan: ParallelPlan,
               roots: list[nn.Module] | None = None, ignored: set | None = None) -> nn.Module:
    """Shard each transformer block, then the root (which holds the embedding, the final norm and the
    output head: with tied embeddings these share one parameter, so they must stay in one group).
    ZeRO-3 under gloo makes each linear layer of a large block a unit of its own (`prefetches_in_backward`).
    Under pipeline parallelism each stage module is a root (`roots`). `ignored`: parameters another
    axis reduces (split experts)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=None if precision == "fp32" else torch.bfloat16,
                              reduce_dtype=torch.float32)
    reshard = dims.zero == 3
    mesh = dims.dp_mesh
    ignored = ignored or None
    sharded = []
    on_cpu = reshard and not prefetches_in_backward()
    for block in plan.blocks(model).values():
        if on_cpu and gathers_per_linear(_local_bytes(block, ignored or ())):
            # each linear layer its own unit, then the block's rest (norms, grouped experts)
            for sub in block.modules():
                if isinstance(sub, nn.Linear) and not (ignored and any(p in ignored for p in sub.parameters())):
                    sharded.append(fully_shard(sub, mesh=mesh, reshard_after_forward=True, mp_policy=mp))
        sharded.append(fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp,
                                   ignored_params=ignored))
    # The root's parameters are the first used in backward's end; keeping them gathered avoids an
    # all-gather that would be needed again at once (as torchtitan does).
    for root in roots or [model]:
        sharded.append(fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp,
                                   ignored_params=ignored))
    if not prefetches_in_backward():
        for module in sharded:
            # FSDP2 has no "off": an empty list means its default (gather the next block in backward
            # order). Naming the module itself makes the prefetch a no-op, since its pre-backward has
            # just gathered it and `FSDPParamGroup.unshard` returns at once for a gathered group.
            module.set_modules_to_backward_prefetch([module])
    return model


def _local_bytes(module: nn.Module, ignored) -> int:
    """The bytes of a module's parameters that ZeRO shards on this rank (a tensor-parallel shard's, not
    the whole; none of `ignored`)."""
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p
    return sum(local(p).numel() * p.element_size() for p in module.parameters() if p not in ignored)


def prefetches_in_backward() -> bool:
    """Whether ZeRO-3 gathers whole blocks and lets FSDP2 gather the next while a block runs backward
    (its default). Not under gloo, where the collectives run on the same CPU cores as the compute, so
    the overlap buys little, while the prefetched block is a second gathered block held at once; there
    each linear layer of a large block is a unit of its own, gathered alone (`rules.gathers_per_linear`:
    from 64 MiB; smaller blocks stay whole, as each unit costs its own collectives). Gloo's all-gather
    holds its output and the unsharded parameters at once, two copies of a unit: for a 47M-parameter
    block in fp32 (the 4.6 GB model of benchmarks/start_at_scale.py) 0.38 GB with a block a unit,
    0.09 GB with its largest linear layer. `planning/memory.py` counts either (`Layout.zero3_units`). Values do not
    change, only what is gathered when (more, smaller collectives)."""
    return dist.get_backend() != "gloo"


def apply_replicate(model: nn.Module, dims: ParallelDims, plan: ParallelPlan, roots: list[nn.Module],
                    ignored: set | None = None) -> nn.Module:
    """DDP under pipeline parallelism: FSDP2's `replicate` on each block and each stage, which torch's
    pipeline stages drive like FSDP2. Parameters stay fp32 (bf16 compute runs through autocast, as
    with DDP); gradients are all-reduced in fp32."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in plan.blocks(model).values():
        replicate(block, mesh=dims.dp_mesh, ignored_params=ignored or None)
    for root in roots:
        replicate(root, mesh=dims.dp_mesh, ignored_params=ignored or None)
    return model


def apply_ddp(model: nn.Module, dims: ParallelDims, ignored: set | None = None) -> nn.Module:
    """torch's DDP, built through the one name `DistributedDataParallel` of this module: `ultratron
    simulate` puts its stand-in there (simulate/ddp.py), which takes these same arguments."""
    if ignored:
        names = [name for name, p in model.named_parameters() if p in ignored]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    device_ids = [dims.local_rank] if next(model.parameters()).is_cuda else None
    # Each gradient is a view of its DDP bucket (`gradient_as_bucket_view`), not a second copy of
    # the gradients beside the buckets (4 bytes per parameter). DDP aliases only gradients that
    # exist when it builds its buckets, so they start as zeros; the trainer then zeroes them in
    # place (`keeps_gradients`) so that backward, `no_sync` micro-batches included, accumulates
    # straight into the buckets.
    for param in model.parameters():
        if param.requires_grad and param.grad is None and not (ignored and param in ignored):
            param.grad = torch.zeros_like(param)
    # The rope tables are the only buffers and never change: no need to broadcast them each step.
    ddp = DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False,
                                  process_group=dims.dp_mesh.get_group(), gradient_as_bucket_view=True)
    return ddp


def apply_data_parallel(model: nn.Module, dims: ParallelDims, precision: str, plan: ParallelPlan,
                        roots: list[nn.Module] | None = None,
                        ignored: set | None = None) -> tuple[nn.Module, DataAxis | None]:
    """Over dp × cp ranks (context-parallel ranks average their gradients like data-parallel ones).
    The axis is active over dp × cp > 1 ranks (under cp alone its loss average is over one rank)."""
    if dims.data_parallel > 1:
        if dims.uses_fsdp:
            model = apply_fsdp(model, dims, precision, plan, roots, ignored)
        elif roots is not None:  # pipeline stages, zero 0
            model = apply_replicate(model, dims, plan, roots, ignored)
        else:
            model = apply_ddp(model, dims, ignored)
    return model, (DataAxis(model, dims) if dims.data_parallel > 1 else None)


class DataAxis(Axis):
    name = "data"

    def __init__(self, model: nn.Module, dims: ParallelDims):
        self.model, self.dims = model, dims
        # the data-parallel ranks alone (not the context-parallel ones FSDP/DDP also reduce over)
        self.groups = [dims.mesh[name].get_group() for name in dims.dp_dims]

    def micro_batch_context(self, last: bool):
        """DDP, ZeRO-1 and ZeRO-2 reduce the gradients only on an accumulation's last micro-batch (the
        unsharded gradients add up in between: one reduction a step); ZeRO-3 reduce-scatters after every
        micro-batch, so that the sharded gradients add up instead — an unsharded fp32 accumulation
        would hold 4 bytes of every parameter, more than ZeRO-3 saves (its traffic buys memory)."""
        if last or self.dims.zero == 3:
            return contextlib.nullcontext()
        if hasattr(self.model, "no_sync"):  # DDP
            return self.model.no_sync()
        return _without_gradient_sync(self.model)  # FSDP2

    def average_loss(self, value: torch.Tensor, training: bool) -> torch.Tensor:
        """Each dp rank trains on its own sequences (as many tokens each: the mean of the means is the
        mean over every token); validation gives every dp rank the same batch."""
        return self.sum_over_data(value) / self.dims.dp if training else value

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            dist.all_reduce(value, group=group)
        return value

    def keeps_gradients(self) -> bool:
        """DDP's gradients are views of its buckets; a None would make the next backward allocate a
        second copy."""
        return bool(getattr(self.model, "gradient_as_bucket_view", False))

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """ZeRO-1 with DDP: the same AdamW groups, each rank holding the state of its share."""
        if self.dims.zero != 1 or self.dims.uses_fsdp:
            return optimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = optimizer.param_groups
        defaults = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")}
        zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=type(optimizer),
                                       process_group=self.dims.dp_mesh.get_group(),
                                       **{**defaults, "weight_decay": groups[0]["weight_decay"]})
        for group in groups[1:]:
            zero.add_param_group({"params": group["params"], "weight_decay": group["weight_decay"]})
        return zero


@contextlib.contextmanager
def _without_gradient_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
