"""AdamW and the learning-rate schedule (linear warmup, then cosine or warmup-stable-decay)."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.AdamW:
    """AdamW on the fp32 parameters (which are the master weights: bf16 runs only autocast the
    compute). Weight decay applies to matrices, not to norm gains (common practice since GPT-2)."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2),
                             eps=optim_cfg.eps, fused=_can_fuse(decay + no_decay))


def _can_fuse(params: list[torch.Tensor]) -> bool:
    """The fused AdamW kernel (one pass over each tensor instead of ~10 element-wise ops) runs on
    CPU and CUDA tensors; sharded (DTensor) parameters take the default multi-tensor path."""
    from torch.distributed.tensor import DTensor

    return all(p.device.type in ("cpu", "cuda") and not isinstance(p, DTensor) for p in params)


def lr_at(step: float, total_steps: int, optim_cfg) -> float:
    """Learning rate for optimizer step `step` (0-based; fractional under a batch ramp, where it is
    the tokens seen ÷ training.batch_tokens, so the schedule follows tokens).

    warmup: linear from lr/warmup to lr over `warmup_steps`; then
    cosine: half a cosine from lr down to lr·min_lr_ratio at the last step;
    wsd: constant lr, and over the last `decay_fraction` of steps linear down to the floor
    (Hu et al. 2024, MiniCPM); constant: lr after warmup.
    """
    peak = optim_cfg.lr
    floor = peak * optim_cfg.min_lr_ratio
    warmup = optim_cfg.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if optim_cfg.schedule == "constant":
        return peak
    if optim_cfg.schedule == "wsd":
        decay_steps = max(1, round(optim_cfg.decay_fraction * total_steps))
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return peak
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return peak + (floor - peak) * progress
    span = max(1, total_steps - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
