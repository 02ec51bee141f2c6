"""How the parallel axes cut a Llama: the names of its blocks and layers, kept beside the model so
that `ultratron.parallel` stays generic (it asks the plan, never for `attention.wq`).

Tensor parallel (Megatron-LM, Shoeybi et al. 2019): per block, wq/wk/wv and w1/w3 are
column-parallel (each rank keeps n_heads/tp heads and ffn_dim/tp hidden units), wo and w2
row-parallel, so each half-block needs one all-reduce in forward. With sequence parallel
(Korthikanti et al. 2022) the norms and residual stream are split along the sequence instead, the
all-reduce becomes a reduce-scatter after wo/w2 and an all-gather before wq/w1. The embedding is
vocab-parallel (rows split over ranks); the output head is column-parallel over the vocabulary
and keeps its logits sharded for `loss_parallel`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from ultratron.models.plan import ParallelPlan


def blocks(model: nn.Module) -> nn.ModuleDict:
    """The repeated transformer blocks: the units of FSDP, recomputation and pipeline stages."""
    return model.layers


def tensor_parallel(sp: bool) -> tuple[dict, dict]:
    """(plan for the root module, plan for each block) for DTensor's `parallelize_module`."""
    residual = Shard(1) if sp else Replicate()  # how the residual stream lives between blocks
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    block = {
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
        root["norm"] = SequenceParallel()
        block["attention_norm"] = SequenceParallel()
        block["ffn_norm"] = SequenceParallel()
    return root, block


def tie_weights(model: nn.Module) -> None:
    """Tied embeddings: both TP styles shard the table along the vocabulary, so one DTensor serves both."""
    if model.args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight


PLAN = ParallelPlan(blocks=blocks, tensor_parallel=tensor_parallel, tie_weights=tie_weights)
