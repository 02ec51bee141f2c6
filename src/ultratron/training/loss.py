"""Next-token cross-entropy in fp32, with the optional PaLM z-loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

IGNORE = -100  # a target that does not count in the loss (F.cross_entropy's default ignore_index)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss to minimise, plain cross-entropy for logging). Logits are upcast to fp32:
    the softmax over a large vocabulary loses too much in bf16.

    z-loss (Chowdhery et al. 2022, PaLM §5): z_loss · mean(log Z²) keeps the softmax normaliser
    near 1 and the output logits from drifting.
    """
    flat = logits.float().flatten(0, 1)
    targets = targets.flatten()
    counted = targets != IGNORE
    # the mean over the tokens that count (targets of IGNORE, e.g. a chat's prompt, do not); a
    # batch without any is 0 rather than F.cross_entropy's 0/0
    n_counted = counted.sum().clamp(min=1)
    ce = F.cross_entropy(flat, targets, ignore_index=IGNORE, reduction="sum") / n_counted
    if z_loss > 0:
        log_z = torch.logsumexp(flat, dim=-1)
        if isinstance(log_z, DTensor):  # loss parallel (vocabulary-sharded logits): the mask is every rank's
            counted = DTensor.from_local(counted, log_z.device_mesh, [Replicate()] * log_z.device_mesh.ndim)
        z = (log_z.pow(2) * counted).sum() / n_counted
        return ce + z_loss * z, ce
    return ce, ce
