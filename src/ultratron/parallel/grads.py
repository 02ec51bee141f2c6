"""The global gradient norm when parameters live on different meshes, and clipping by it.

`torch.nn.utils.clip_grad_norm_` stacks the per-parameter norms, which fails when some gradients
are DTensors on one mesh and others plain tensors or DTensors on another mesh (tensor parallel
without sequence parallel leaves the norm weights as plain tensors). Here each gradient adds its
local sum of squares to a bucket named by the mesh dimensions it is sharded over; each bucket is
summed over exactly those dimensions (replicated dimensions hold copies and must not be summed),
and the buckets are added. Ranks that hold disjoint parameters (pipeline stages) add their totals
over the process groups an axis names (`groups`); the head's copy of a tied embedding table is left
out of the norm (`uncounted`, and clipped all the same), since the first stage counts the table.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def _local_square_sum(grad: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """(key of the mesh dimensions to sum over, this rank's sum of squares in fp32)."""
    if not isinstance(grad, DTensor):
        return (), grad.detach().float().pow(2).sum()
    if any(isinstance(p, Partial) for p in grad.placements):
        grad = grad.redistribute(placements=[Replicate() if isinstance(p, Partial) else p for p in grad.placements])
    # FSDP over a tensor-parallel dimension 0 uses _StridedShard, which is not a Shard subclass.
    sharded = tuple(i for i, p in enumerate(grad.placements) if not isinstance(p, (Replicate, Partial)))
    return (id(grad.device_mesh), sharded, grad.device_mesh), grad.to_local().detach().float().pow(2).sum()


def global_grad_norm(parameters: Iterable[torch.Tensor], groups=()) -> torch.Tensor:
    """The L2 norm of all gradients together, the same value on every rank (fp32, a plain tensor);
    `groups`: also summed over these process groups' ranks (which hold other parameters)."""
    buckets: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float32))
    meshes: dict[tuple, object] = {}
    seen: set[int] = set()
    for param in parameters:
        if param.grad is None or id(param) in seen:  # tied weights appear once
            continue
        seen.add(id(param))
        key, square_sum = _local_square_sum(param.grad)
        bucket_key = key[:2]
        buckets[bucket_key] = buckets[bucket_key].to(square_sum.device) + square_sum
        if key:
            meshes[bucket_key] = key[2]
    total = None
    # Parameters come in the same order on every rank, so the buckets (and collectives) do too.
    for bucket_key, value in buckets.items():
        if bucket_key:
            mesh = meshes[bucket_key]
            for dim in bucket_key[1]:
                dist.all_reduce(value, group=mesh.get_group(dim))
        total = value if total is None else total + value.to(total.device)
    if total is None:
        total = torch.zeros((), dtype=torch.float32)
    for group in groups:
        dist.all_reduce(total, group=group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, groups=(),
                   uncounted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scale all gradients so their global norm is at most `max_norm`; returns the norm before.
    `uncounted`: parameters whose gradients are scaled but not counted (a copy counted elsewhere)."""
    parameters = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in uncounted}
    norm = global_grad_norm([p for p in parameters if id(p) not in skip], groups)
    if math.isfinite(max_norm):
        # a tensor, not a Python float: no host sync, and it runs under fake tensors (`simulate`);
        # multiplying by exactly 1.0 leaves a gradient unchanged
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in {id(p): p.grad for p in parameters}.values():
            grad.mul_(coef.to(grad.device))
    return norm
