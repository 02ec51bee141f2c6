"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022) with DTensor's `parallelize_module`.

Per block: wq/wk/wv and w1/w3 are column-parallel (each rank keeps n_heads/tp heads and
ffn_dim/tp hidden units), wo and w2 row-parallel, so each half-block needs one all-reduce in
forward. With `parallel.sp` the norms and residual stream are split along the sequence instead
of replicated: the all-reduce becomes a reduce-scatter after wo/w2 and an all-gather before
wq/w1, and norm activations shrink by tp.

The embedding is vocab-parallel (rows of the table split over ranks), the output head is
column-parallel over the vocabulary and keeps its logits sharded; the cross-entropy then runs
under `loss_parallel`, so the full (tokens × vocab) logits never exist on one rank. The two
share one parameter when embeddings are tied: both shard it along the vocabulary (dim 0), and we
re-tie them after distributing. In eval mode the model returns full logits (sampling and
validation read them like in one process).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from ultratron.parallel.dims import ParallelDims


def _block_plan(sp: bool) -> dict:
    residual = Shard(1) if sp else Replicate()  # how the residual stream lives between blocks
    plan = {
        "attention": PrepareModuleInput(input_layouts=(residual, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def _gather_logits_in_eval(module: nn.Module, args, output):
    if isinstance(output, DTensor) and not module.training:
        return output.full_tensor()
    return output


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims) -> nn.Module:
    if dims.tp == 1:
        return model
    mesh, sp = dims.tp_mesh, dims.sp
    tied = model.output.weight is model.tok_embeddings.weight
    residual = Shard(1) if sp else Replicate()
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, root_plan)
    for block in model.layers.values():
        parallelize_module(block, mesh, _block_plan(sp))
    if tied:  # both styles shard the table along the vocabulary, so one DTensor serves both
        model.output.weight = model.tok_embeddings.weight
    model.register_forward_hook(_gather_logits_in_eval)
    return model


def loss_context(dims: ParallelDims):
    """`loss_parallel` when the logits are vocab-sharded (tp > 1), else nothing."""
    return loss_parallel() if dims.tp > 1 else contextlib.nullcontext()


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor loss, unchanged otherwise."""
    return value.full_tensor() if isinstance(value, DTensor) else value
