"""Tensor parallelism with DTensor's `parallelize_module`, on the plan the model family provides
(`models/*/parallel_plan.py` says which layers are column- or row-parallel).

The cross-entropy runs under `loss_parallel` on vocab-sharded logits, so the full (tokens × vocab)
logits never exist on one rank. In eval mode the model returns full logits (sampling and
validation read them like in one process).

In a step (`TensorAxis`): the training loss under `loss_parallel`; tp ranks hold the same tokens,
so nothing is averaged over them; under sequence parallelism sampling pads its context to a
multiple of tp (the activations between blocks are split along the sequence).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from ultratron.models.plan import ParallelPlan
from ultratron.parallel.axis import Axis
from ultratron.parallel.dims import ParallelDims


def _gather_logits_in_eval(module: nn.Module, args, output):
    if isinstance(output, DTensor) and not module.training:
        return output.full_tensor()
    return output


class TensorAxis(Axis):
    name = "tensor"

    def __init__(self, dims: ParallelDims):
        self.sequence_multiple = dims.tp if dims.sp else 1

    def step_context(self, training: bool):
        return loss_parallel() if training else contextlib.nullcontext()


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, plan: ParallelPlan) -> tuple[nn.Module, Axis | None]:
    if dims.tp == 1:
        return model, None
    root_plan, block_plan = plan.tensor_parallel(dims.sp)
    # A pipeline part holds the embedding or the head only where its stages need them.
    parallelize_module(model, dims.tp_mesh, {name: style for name, style in root_plan.items()
                                             if getattr(model, name.split(".")[0], None) is not None})
    for block in plan.blocks(model).values():
        parallelize_module(block, dims.tp_mesh, block_plan(block))
    plan.tie_weights(model)
    model.register_forward_hook(_gather_logits_in_eval)
    return model, TensorAxis(dims)
