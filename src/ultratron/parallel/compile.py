"""torch.compile, applied from outside the model to each transformer block (`training.compile`).

Each block is compiled on its own (as torchtitan does), after tensor parallel and recomputation
have wrapped it and before FSDP shards it: a block's graph is small, every block shares one
compiled program (the same code, parameters passed in), and FSDP's hooks stay outside the graph,
in eager code around each compiled block. Inductor fuses a block's element-wise work — RMSNorm,
RoPE, SwiGLU's silu·mul, the residual adds — forward and backward into a few loops instead of one
pass over memory per operator. The embedding, the final norm, the head and the loss stay eager.
Parameter names gain `_orig_mod.`, which the checkpoint code strips (`checkpoint/state.py`), so
a checkpoint is the same with and without compile.
"""

from __future__ import annotations

import torch
from torch import nn

from ultratron.models.plan import ParallelPlan


def apply_compile(model: nn.Module, enabled: bool, plan: ParallelPlan) -> nn.Module:
    if not enabled:
        return model
    blocks = plan.blocks(model)
    for name, block in list(blocks.named_children()):
        blocks.register_module(name, torch.compile(block, fullgraph=True))
    return model
