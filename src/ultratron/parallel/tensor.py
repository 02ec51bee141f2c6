"""Tensor parallelism with DTensor's `parallelize_module`, on the plan the model family provides
(`models/*/parallel_plan.py` says which layers are column- or row-parallel).

The cross-entropy runs under `loss_parallel` on vocab-sharded logits, so the full (tokens × vocab)
logits never exist on one rank. In eval mode the model returns full logits (sampling and
validation read them like in one process).

LoRA's adapters (`models/lora.py`) are split as their base layer is, so that B A x comes out in the
layout W x does: a column-parallel layer (its output features split) splits B (out × rank) along
its rows and keeps A whole; a row-parallel one (its input features split) splits A (rank × in)
along its columns and keeps B whole, and B A x is then a partial sum like W x, which the layer's
own reduction (all-reduce, or reduce-scatter under sequence parallel) sums with it: the adapter's
hook runs before the one `parallelize_module` adds.

In a step (`TensorAxis`): the training loss under `loss_parallel`; tp ranks hold the same tokens,
so nothing is averaged over them; under sequence parallelism sampling pads its context to a
multiple of tp (the activations between blocks are split along the sequence).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from ultratron.models.lora import ADAPTERS
from ultratron.models.plan import ParallelPlan
from ultratron.parallel.axis import Axis
from ultratron.parallel.dims import ParallelDims


def _gather_logits_in_eval(module: nn.Module, args, output):
    if isinstance(output, DTensor) and not module.training:
        return output.full_tensor()
    return output


# each adapter's dim of W's size: A (rank × in) has W's input features (dim 1), B (out × rank) its outputs (dim 0)
_WEIGHT_DIM = {"lora_a": 1, "lora_b": 0}


def _parallelize(module: nn.Module, mesh, styles: dict) -> None:
    """`parallelize_module`, with the LoRA adapters of its linear layers split along the dim their
    layer's weight is split along (module docstring). They are set aside meanwhile: a column-parallel
    style would split every parameter of its layer along dim 0, A's rank too. A frozen parameter
    (LoRA's base model) stays frozen."""
    adapted = {layer: {name: layer._parameters.pop(name) for name in ADAPTERS}
               for layer in module.modules() if ADAPTERS[0] in layer._parameters}
    frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
    parallelize_module(module, mesh, styles)
    for name, param in module.named_parameters():  # SequenceParallel makes its norms' weights trainable
        param.requires_grad_(name not in frozen)
    for layer, adapters in adapted.items():
        split = layer.weight.placements[0] if isinstance(layer.weight, DTensor) else None
        for name, param in adapters.items():
            if split is not None:  # a layer tp leaves whole keeps whole adapters
                place = Shard(_WEIGHT_DIM[name]) if split == Shard(_WEIGHT_DIM[name]) else Replicate()
                param = nn.Parameter(distribute_tensor(param.detach(), mesh, [place]),
                                     requires_grad=param.requires_grad)
            layer.register_parameter(name, param)


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
    _parallelize(model, dims.tp_mesh, {name: style for name, style in root_plan.items()
                                       if getattr(model, name.split(".")[0], None) is not None})
    for block in plan.blocks(model).values():
        _parallelize(block, dims.tp_mesh, block_plan(block))
    plan.tie_weights(model)
    model.register_forward_hook(_gather_logits_in_eval)
    return model, TensorAxis(dims)
