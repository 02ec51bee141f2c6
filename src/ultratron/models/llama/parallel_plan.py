"""How the parallel axes cut a Llama: the names of its blocks and layers, kept beside the model so
that `ultratron.parallel` stays generic (it asks the plan, never for `attention.wq`).

Tensor parallel (Megatron-LM, Shoeybi et al. 2019): per block, wq/wk/wv and w1/w3 are
column-parallel (each rank keeps n_heads/tp heads and ffn_dim/tp hidden units), wo and w2
row-parallel, so each half-block needs one all-reduce in forward. With sequence parallel
(Korthikanti et al. 2022) the norms and residual stream are split along the sequence instead, the
all-reduce becomes a reduce-scatter after wo/w2 and an all-gather before wq/w1. The embedding is
vocab-parallel (rows split over ranks); the output head is column-parallel over the vocabulary
and keeps its logits sharded for `loss_parallel`. A mixture-of-experts layer takes the whole
(gathered) tokens as a plain tensor: its router is replicated, its shared experts are column- then
row-parallel like the dense SwiGLU, and its routed experts are split by `parallel.expert`
(over the hidden width on the tp ranks, over the experts on the ep ranks); under sequence parallel
its output is cut back to the rank's part of the sequence.

Pipeline parallel: a `LlamaStage` holds a run of the blocks, with the embedding on the first stage
and the final norm and head on the last, under the full model's attribute names, so parameter
names (`layers.5.attention.wq.weight`, `output.weight`) — and checkpoints — are the same in every
layout. With tied embeddings the last stage keeps its own copy of the table as `output.weight`
(`tied_copies` names copy and original); the pipeline sums the two copies' gradients after
backward, the way Megatron-LM's embedding group does, so they stay equal.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from ultratron.models.attention import attend
from ultratron.models.llama.model import rope_and_mask, softcap
from ultratron.models.moe import MoE
from ultratron.models.plan import ParallelPlan


def blocks(model: nn.Module) -> nn.ModuleDict:
    """The repeated transformer blocks: the units of FSDP, recomputation and pipeline stages."""
    return model.layers


def tensor_parallel(sp: bool):
    """(plan for the root module, block → its plan) for DTensor's `parallelize_module`."""
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
    moe_block = {name: style for name, style in block.items() if not name.startswith("feed_forward")}
    moe_block["feed_forward"] = PrepareModuleInputOutput(
        input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=Replicate(), desired_output_layouts=residual)
    moe_block |= {"feed_forward.shared.w1": ColwiseParallel(), "feed_forward.shared.w3": ColwiseParallel(),
                  "feed_forward.shared.w2": RowwiseParallel()}

    def block_plan(module: nn.Module) -> dict:
        if not isinstance(module.feed_forward, MoE):
            return block
        return {k: v for k, v in moe_block.items() if module.feed_forward.shared is not None or ".shared." not in k}

    return root, block_plan


def tie_weights(model: nn.Module) -> None:
    """Tied embeddings: both TP styles shard the table along the vocabulary, so one DTensor serves both.
    (A pipeline stage's head is a copy of its own and stays one.)"""
    if model.args.tie_embeddings and not isinstance(model, LlamaStage):
        model.output.weight = model.tok_embeddings.weight


class LlamaStage(nn.Module):
    """Some of a Llama's blocks (a pipeline stage, or all the stages of one rank), with the embedding
    if it holds the first stage and the final norm and head if it holds the last, under the names the
    full model gives them. Its forward runs one stage: token ids or the previous stage's activations
    in, activations or logits out. `sequence_shards`: under sequence parallel the activations between
    stages hold 1/tp of the sequence, so the rotary tables are cut for tp times their length;
    `positions`: the tokens' positions when they are not 0, 1, ... (a context-parallel shard's)."""

    def __init__(self, model: nn.Module, layer_names: list[str], first: bool, last: bool):
        super().__init__()
        self.args = model.args
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({name: model.layers[name] for name in layer_names})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        source_embedding = getattr(model, "tok_embeddings", None)
        if last and source_embedding is not None and model.output.weight is source_embedding.weight:
            table = source_embedding.weight  # untie: a copy, frozen if the table is (under LoRA)
            self.output.weight = nn.Parameter(table.detach().clone(), requires_grad=table.requires_grad)
        # tied parameters across the pipeline: the last stage's copy → the first stage's original
        self.tied_copies = {"output.weight": "tok_embeddings.weight"} if model.args.tie_embeddings else {}
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.sequence_shards = 1
        self.positions: torch.Tensor | None = None
        self.hidden_out = False  # the last stage hands the final normed hidden states on (Llama.hidden_out)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents`: the packed documents of the micro-batch's rows, as `Llama.forward` takes them
        (every stage builds their attention mask and positions)."""
        if self.tok_embeddings is not None:
            seq = x.shape[1]
            x = self.tok_embeddings(x)
        else:
            seq = x.shape[1] * self.sequence_shards
        cos, sin, mask = rope_and_mask(self.rope_cos, self.rope_sin, seq, self.positions, documents,
                                       self.args.attention)
        for layer in self.layers.values():
            x = layer(x, cos, sin, mask=mask)
        if self.output is not None:
            x = self.norm(x)
            return x if self.hidden_out else self.head(x)
        return x

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's final normed hidden states → logits (as `Llama.head`)."""
        return softcap(self.output(hidden), self.args.final_softcap)


def pipeline_stage(model: nn.Module, layer_names: list[str], first: bool, last: bool) -> LlamaStage:
    return LlamaStage(model, layer_names, first, last)


def set_attention(model: nn.Module, attend) -> None:
    for block in model.layers.values():
        block.attention.attend = attend


def moe_layers(model: nn.Module) -> list[nn.Module]:
    return [block.feed_forward for block in model.layers.values() if isinstance(block.feed_forward, MoE)]


PLAN = ParallelPlan(blocks=blocks, tensor_parallel=tensor_parallel, tie_weights=tie_weights,
                    pipeline_stage=pipeline_stage, set_attention=set_attention, attention=attend,
                    moe_layers=moe_layers,
                    lora_targets={"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
                                  "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"})
