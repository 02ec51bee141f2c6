"""Expert parallelism: a mixture of experts' routed experts split over the `ep` ranks (and their
hidden width over the `tp` ranks), token slots sent to their expert's rank and back by all-to-all.

ep borrows its ranks from data parallelism, as Megatron-LM, DeepSpeed-MoE and torchtitan do: the
world stays dp·tp·pp·cp, and the ep ranks are neighbouring data-parallel ranks (`ParallelDims`
cuts dp into edp × ep). Everything but the routed experts is data-parallel as usual; each rank
holds E/ep experts as DTensors `Shard(0)` on the ep mesh (and `Shard` of the hidden width on tp),
so checkpoints keep the experts' global shapes and reshard to any other ep, tp or one process.

The dispatch (`ShardedExperts`, swapped into each MoE layer for `models.moe.local_dispatch`):
  1. the rank's token slots, sorted by expert (the router ran on its own tokens, as in one process);
  2. all-to-all of the per-expert counts, then of the slots, to the ranks holding their experts;
  3. the received slots regrouped expert by expert (they arrive grouped by sender), the local
     experts' SwiGLU, the inverse regrouping;
  4. all-to-all back, then weighted and summed per token, as in one process.
Backward runs the same all-to-alls in reverse (autograd through `_AllToAll`). Under tensor
parallel the tokens are the same on every tp rank and each computes its share of every expert's
hidden width: the slots enter through `_CopyToTP` (identity; backward sums the tp ranks' input
gradients) and the summed output leaves through `_ReduceFromTP` (all-reduce; backward identity) —
Megatron-LM's f and g operators (Shoeybi et al. 2019).

Gradients: a rank's expert gradients hold the contributions of every ep rank's tokens (they came
back through the all-to-all); FSDP/DDP leave the experts alone (`ExpertAxis.params`, which
`parallelize` hands the data axis to ignore), and after backward the axis sums them over the ranks
that hold the same experts (dp_replicate × edp × cp) and divides by dp × cp — the same mean over
every token that data parallelism takes of the other gradients.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ultratron.models import moe as moe_layer
from ultratron.models.moe import GroupedExperts, grouped_swiglu, sort_by_expert
from ultratron.models.plan import ParallelPlan
from ultratron.parallel.axis import Axis
from ultratron.parallel.dims import ParallelDims


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _per_rank(counts: list[int], ep: int) -> list[list[int]]:
    """Slots per expert → per ep rank, per its local expert (rank r holds experts r·E/ep onwards)."""
    local = len(counts) // ep
    return [counts[r * local:(r + 1) * local] for r in range(ep)]


def _expert_major(received: list[list[int]], device) -> torch.Tensor:
    """received[s][e] rows came from ep rank s for local expert e, sender after sender: the row
    order that puts them expert after expert (sender order within an expert)."""
    local = len(received[0])
    sizes = [rows for row in received for rows in row]
    starts = [0, *accumulate(sizes)]
    pieces = [torch.arange(starts[s * local + e], starts[s * local + e + 1], device=device)
              for e in range(local) for s in range(len(received))]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


class ShardedExperts:
    """A MoE layer's dispatch when its experts are split over ep (and their width over tp)."""

    def __init__(self, ep_group, ep: int, tp_group):
        self.ep_group, self.ep, self.tp_group = ep_group, ep, tp_group

    def __call__(self, tokens, choice, weights, keep, experts: GroupedExperts) -> torch.Tensor:
        if self.tp_group is not None:
            tokens, weights = _CopyToTP.apply(tokens, self.tp_group), _CopyToTP.apply(weights, self.tp_group)
        token, slot, counts = sort_by_expert(choice, keep, experts.n_experts)
        w1, w2, w3 = _local(experts.w1), _local(experts.w2), _local(experts.w3)
        if self.ep > 1:  # all-to-all takes its split sizes on the host: one read per layer
            sizes = moe_layer.counts_on_host(counts, choice.numel())
            token, slot = token[:sum(sizes)], slot[:sum(sizes)]
        x = tokens[token]
        if self.ep > 1:
            received = torch.empty_like(counts)  # per sender, its slots for each local expert
            dist.all_to_all_single(received, counts, group=self.ep_group)
            got = _per_rank(moe_layer.counts_on_host(received, choice.numel()), self.ep)
            send = _per_rank(sizes, self.ep)
            to_ranks, from_ranks = [sum(row) for row in send], [sum(row) for row in got]
            x = _AllToAll.apply(x, from_ranks, to_ranks, self.ep_group)
            order = _expert_major(got, x.device)
            per_expert = [sum(column) for column in zip(*got, strict=True)]
            out = grouped_swiglu(x[order], per_expert, w1, w2, w3)[torch.argsort(order)]
            out = _AllToAll.apply(out, to_ranks, from_ranks, self.ep_group)
        else:
            out = grouped_swiglu(x, counts, w1, w2, w3)
        out = moe_layer.combine(tokens, out, token, weights.flatten()[slot])
        return _ReduceFromTP.apply(out, self.tp_group) if self.tp_group is not None else out


class ExpertAxis(Axis):
    name = "expert"

    def __init__(self, params: list[nn.Parameter], dims: ParallelDims):
        self.params, self.dims = params, dims  # the split experts' parameters, in the model's order

    @torch.no_grad()
    def after_backward(self) -> None:
        """Each split expert's gradient summed over the ranks holding the same experts and divided by
        dp × cp (the mean over every token, as for the other parameters)."""
        groups = [self.dims.mesh[name].get_group() for name in self.dims.expert_replica_dims]
        for param in self.params:
            if param.grad is None:
                continue
            grad = _local(param.grad)
            for group in groups:
                dist.all_reduce(grad, group=group)
            grad.div_(self.dims.data_parallel)


def apply_expert_parallel(model: nn.Module, dims: ParallelDims, plan: ParallelPlan) -> tuple[nn.Module, Axis | None]:
    """Split every MoE layer's routed experts over ep (experts) and tp (hidden width); swap in the
    all-to-all dispatch. Nothing to do for a dense model or without ep and tp."""
    layers = plan.moe_layers(model)
    if not layers or (dims.ep == 1 and dims.tp == 1):
        return model, None
    mesh = dims.submesh("ep", "tp")
    split = []
    for moe in layers:
        experts = moe.experts
        for name, hidden_dim in GroupedExperts.HIDDEN_DIMS.items():
            placements = ([Shard(0)] if dims.ep > 1 else []) + ([Shard(hidden_dim)] if dims.tp > 1 else [])
            # every rank built the same full weights, so each keeps its own slice without communication
            sharded = nn.Parameter(distribute_tensor(getattr(experts, name).detach(), mesh, placements,
                                                     src_data_rank=None))
            setattr(experts, name, sharded)
            split.append(sharded)
        moe.dispatch = ShardedExperts(dims.ep_mesh.get_group() if dims.ep > 1 else None, dims.ep,
                                      dims.tp_mesh.get_group() if dims.tp > 1 else None)
    return model, ExpertAxis(split, dims)
