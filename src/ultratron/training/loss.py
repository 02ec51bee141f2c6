"""Next-token cross-entropy in fp32, with the optional PaLM z-loss: on whole logits, or chunk by chunk
from the final hidden states and the output head (`chunked_cross_entropy`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

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


def chunked_cross_entropy(
    hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
    z_loss: float = 0.0, chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cross_entropy(head(hidden), targets, z_loss)` without ever holding the whole logits tensor:
    the output head, the fp32 softmax and their gradients run `chunk` tokens at a time.

    Each chunk is a checkpointed region (chunked recomputation): its forward keeps only the two sums
    (cross-entropy and z²) and the references to its hidden rows and the head's weight; its backward
    recomputes that chunk's logits, and the engine frees them before it reaches the next chunk. So at
    most one chunk of logits (and of their fp32 copy and gradient) exists at a time. The weight's
    gradient (tied embeddings included) accumulates over the chunks as for any reused parameter.
    """
    flat, targets = hidden.flatten(0, -2), targets.flatten()
    n_counted = (targets != IGNORE).sum().clamp(min=1)
    chunk = chunk if chunk > 0 else flat.shape[0]
    ce_sum = z_sum = None
    for rows, tgt in zip(flat.split(chunk), targets.split(chunk), strict=True):
        ce, z = checkpoint(_chunk_sums, rows, tgt, head, z_loss > 0, use_reentrant=False)
        ce_sum, z_sum = (ce, z) if ce_sum is None else (ce_sum + ce, z_sum + z)
    ce = ce_sum / n_counted
    return (ce + z_loss * (z_sum / n_counted), ce) if z_loss > 0 else (ce, ce)


def _chunk_sums(hidden: torch.Tensor, targets: torch.Tensor, head, with_z: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed cross-entropy over its counted targets and its summed log Z² (0 without z-loss)."""
    logits = head(hidden).float()
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    if not with_z:
        return ce, torch.zeros((), device=ce.device)
    return ce, (torch.logsumexp(logits, dim=-1).pow(2) * (targets != IGNORE)).sum()
