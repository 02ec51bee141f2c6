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

# The ops whose outputs selective recompute keeps: the matmuls and attention kernels of every device
# (a GPU's attention is cuDNN's, flash or memory-efficient SDPA, or FlexAttention's higher-order
# op; fp8 linear layers are `_scaled_mm`; an MoE's experts grouped matmuls) and the collectives whose
# outputs are a shard of the sequence (recomputed, they would run again in backward). Named, and
# resolved against this torch by `saved_ops` (tests/test_recompute_ops.py checks that every one
# resolves): an op a torch lacks is reported, not silently left out.
SAVED_OP_NAMES = (
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",  # CPU SDPA
    "aten._scaled_dot_product_flash_attention.default",  # CUDA SDPA: FlashAttention-2
    "aten._scaled_dot_product_efficient_attention.default",  # memory-efficient (xformers') kernel
    "aten._scaled_dot_product_cudnn_attention.default",  # cuDNN's, the default on H100
    "aten._flash_attention_forward.default", "aten._efficient_attention_forward.default",  # (context parallel's)
    "higher_order.flex_attention",  # FlexAttention (compiled)
    "aten._scaled_mm.default",  # fp8 matmul (torchao's float8 linear layers)
    "aten._grouped_mm.default", "aten._scaled_grouped_mm.default",  # grouped (MoE) matmuls, bf16 and fp8
    "_c10d_functional.reduce_scatter_tensor.default",  # sequence parallel's row-parallel outputs (a shard)
    "_c10d_functional.all_to_all_single.default",  # expert parallel's dispatch
)
# Not saved: sequence parallel's all-gathers, whose outputs are the whole sequence (a column-parallel
# matmul keeps its gathered input as the rank's shard and gathers it again in backward,
# `parallel.tensor.KeepSequenceShard`: saving the gather would undo that), and tensor parallel's
# all-reduce without sp (whose whole output the planner does not count as kept).


def resolve_op(name: str):
    """`torch.ops.<name>` (an op overload, or a higher-order op), or None where this torch has none."""
    found = torch.ops
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def saved_ops() -> tuple[set, list[str]]:
    """(the ops selective recompute saves, the names of SAVED_OP_NAMES this torch lacks)."""
    ops, missing = {onednn_linear._opoverload}, []  # (and the CPU fp32 matmul of kernels/cpu_linear.py)
    for name in SAVED_OP_NAMES:
        op = resolve_op(name)
        if op is None:
            missing.append(name)
        else:
            ops.add(op)
    return ops, missing


_SAVED_OPS = saved_ops()[0]


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
