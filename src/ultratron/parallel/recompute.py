"""Activation recomputation, applied from outside the model to each transformer block.

full: keep only each block's input and recompute the block in backward (Chen et al. 2016).
selective: keep the outputs of the matmuls and attention, recompute the cheap element-wise ops
(norms, activations, RoPE) — the spirit of Korthikanti et al. 2022's selective recompute,
expressed with PyTorch's selective-checkpoint policy.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ultratron.kernels.cpu_linear import onednn_linear
from ultratron.models.plan import ParallelPlan

_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    onednn_linear._opoverload,  # the CPU fp32 matmul of kernels/cpu_linear.py
}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: nn.Module, mode: str, plan: ParallelPlan) -> nn.Module:
    if mode == "none":
        return model
    blocks = plan.blocks(model)
    for name, block in list(blocks.named_children()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(
                block, preserve_rng_state=False,
                context_fn=partial(create_selective_checkpoint_contexts, _policy),
            )
        blocks.register_module(name, wrapped)
    return model
