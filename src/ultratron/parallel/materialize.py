"""From the meta device to the shards a rank owns: the step between `parallelize` and the first step.

Every user of a model takes one path: the model is built on `meta` (shapes, no memory), `parallelize`
applies every axis to it, then `materialize` gives each parameter and buffer storage on the device —
only the rank's local shard of each parameter (`to_empty`) — and `initialize` writes into each shard
the values one process would put at those rows and columns (`models/init.py`): a parameter is drawn
in fixed row blocks, each from a seed of (run seed, name, block), so a shard draws only the blocks
it overlaps. A checkpoint load (`checkpoint/`) then overwrites the shards where the run starts from
weights. No rank ever holds a parameter it does not own; beside the shards, initialization holds one
drawn block (at most `INIT_BLOCK_ELEMENTS`, 16 MiB in fp32) and the rows of it a shard takes.

A sharded parameter (a DTensor) keeps its Parameter object through `to_empty` (torch swaps its
storage in place), so the axes that captured one while they applied (the expert axis, FSDP2) hold
the materialized one; a plain parameter keeps its object on a real device (its data is replaced)
and a tied weight is tied again after, whatever the device made of it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ultratron.models import init
from ultratron.models.lora import adapter_init_rule, is_adapter
from ultratron.models.registry import family_of, materialize, model_args, plain_name, unwrap

__all__ = ["initialize", "is_meta", "local_region", "materialize"]


def is_meta(model: nn.Module) -> bool:
    return any(param.is_meta for param in model.parameters())


def local_region(param: torch.Tensor) -> tuple[torch.Tensor, init.Region]:
    """The tensor this rank holds of a parameter and which rows and columns of the whole it is."""
    if not isinstance(param, DTensor):
        return _unwrapped(param), init.whole(param.shape)
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with unset_fake_temporarily():  # it indexes with small tensors whose values it reads (simulate's fakes)
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = _unwrapped(param.to_local())
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"a shard of shape {tuple(local.shape)} where its placements give {tuple(shape)}")
    return local, tuple((start, start + size) for start, size in zip(offset, shape, strict=True))


def _unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor a wrapper subclass (torchao's fp8 weights) holds; the tensor if plain."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return tensor
    names, _ = tensor.__tensor_flatten__()
    return getattr(tensor, names[0])


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> None:
    """Every local shard of `model` written with the values one process's initialization gives its
    positions (the model's family says how each parameter is drawn; LoRA's adapters as LoRA does)."""
    family, args = family_of(model), model_args(model)
    copies = getattr(unwrap(model), "tied_copies", {})  # a pipeline's copy of a tied table → the original
    for name, param in model.named_parameters():
        source = copies.get(plain_name(name), plain_name(name))
        rule = adapter_init_rule(source, param.shape) if is_adapter(source) else \
            family.init_rule(source, param.shape, args)
        local, region = local_region(param)
        if not local.is_contiguous():
            raise RuntimeError(f"{source}: a local shard that is not contiguous cannot be initialized in place")
        init.fill(local, rule, source, tuple(param.shape), region, seed=seed)
