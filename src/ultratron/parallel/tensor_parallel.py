"""Tensor parallelism with DTensor's `parallelize_module`, on the plan the model family provides
(`models/*/parallel_plan.py` says which layers are column- or row-parallel).

The cross-entropy runs under `loss_parallel` on vocab-sharded logits, so the full (tokens × vocab)
logits never exist on one rank. In eval mode the model returns full logits (sampling and
validation read them like in one process).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from ultratron.models.plan import ParallelPlan
from ultratron.parallel.dims import ParallelDims


def _gather_logits_in_eval(module: nn.Module, args, output):
    if isinstance(output, DTensor) and not module.training:
        return output.full_tensor()
    return output


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, plan: ParallelPlan) -> nn.Module:
    if dims.tp == 1:
        return model
    root_plan, block_plan = plan.tensor_parallel(dims.sp)
    # A pipeline part holds the embedding or the head only where its stages need them.
    parallelize_module(model, dims.tp_mesh, {name: style for name, style in root_plan.items()
                                             if getattr(model, name.split(".")[0], None) is not None})
    for block in plan.blocks(model).values():
        parallelize_module(block, dims.tp_mesh, block_plan(block))
    plan.tie_weights(model)
    model.register_forward_hook(_gather_logits_in_eval)
    return model


def loss_context(dims: ParallelDims):
    """`loss_parallel` when the logits are vocab-sharded (tp > 1), else nothing."""
    return loss_parallel() if dims.tp > 1 else contextlib.nullcontext()


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor loss, unchanged otherwise."""
    return value.full_tensor() if isinstance(value, DTensor) else value
