"""Next-token cross-entropy in fp32, with the optional PaLM z-loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss to minimise, plain cross-entropy for logging). Logits are upcast to fp32:
    the softmax over a large vocabulary loses too much in bf16.

    z-loss (Chowdhery et al. 2022, PaLM §5): z_loss · mean(log Z²) keeps the softmax normaliser
    near 1 and the output logits from drifting.
    """
    flat = logits.float().flatten(0, 1)
    ce = F.cross_entropy(flat, targets.flatten())
    if z_loss > 0:
        return ce + z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean(), ce
    return ce, ce
