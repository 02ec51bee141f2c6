"""Next-token cross-entropy in fp32, with the optional PaLM z-loss: on whole logits, or chunk by chunk
from the final hidden states and the output head (`training.loss_chunk`): `linear_cross_entropy`
for a plain linear head, `chunked_cross_entropy` for any other."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
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


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0, chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cross_entropy(hidden @ weight.T, targets, z_loss)` for a plain linear head, with at most
    `chunk` tokens' worth of logits (chunk × vocabulary) alive at any moment and the head's weight
    gradient made once, in place.

    Forward runs `chunk` tokens at a time over the whole vocabulary and keeps each token's log Z.
    Backward recomputes the logits a slice of the vocabulary at a time over all the tokens (the same
    number of elements), so each slice of the weight's gradient comes out of one matmul over every
    token — as the whole-logits path computes it, rounded once — and is written where it belongs;
    only the hidden states' gradient adds up over the slices (in fp32). Under autocast the matmuls run
    in its dtype as they would inside the model.

    Tensor parallel (a DTensor head, its rows — the vocabulary — split over the tp ranks, as loss
    parallel keeps the logits): each rank runs its own rows on every token (the hidden states gathered
    under sequence parallel); a token's log Z and its target's logit are all-reduced over the ranks
    (max, then the sum of exponentials; the one rank holding the target gives its logit), and the
    hidden states' gradient is the sum of the ranks' partial ones."""
    group, offset = None, 0
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        group = mesh.get_group()
        if isinstance(hidden, DTensor):  # (sequence parallel: every token's row on every rank)
            hidden = hidden.redistribute(mesh, [Replicate()]).to_local()
        offset = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())  # torch's Shard: chunks of ⌈v/tp⌉
        weight = weight.to_local()
    flat, targets = hidden.flatten(0, -2), targets.flatten()
    device = flat.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    with torch.autocast(device, enabled=False):
        ce, z = _LinearCrossEntropy.apply(flat, weight, targets, z_loss, chunk if chunk > 0 else flat.shape[0], dtype,
                                          group, offset)
    return (ce + z_loss * z, ce) if z_loss > 0 else (ce, ce)


def _log_z_and_target(logits: torch.Tensor, targets: torch.Tensor, group, offset: int):
    """Each row's log-sum-exp and its target's logit (0 for an ignored one), over the rows' whole
    vocabulary: here, or across the tp ranks holding its parts (`offset`: this rank's first entry)."""
    local = targets - offset
    inside = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1) * inside
    if group is None:
        return torch.logsumexp(logits, dim=-1), picked
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    total = (logits - top.unsqueeze(1)).exp_().sum(dim=-1)
    dist.all_reduce(total, group=group)
    dist.all_reduce(picked, group=group)
    return total.log_() + top, picked


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, z_loss, chunk, dtype, group, offset):
        counted = targets != IGNORE
        n = counted.sum().clamp(min=1).float()
        h, w = (hidden, weight) if dtype is None else (hidden.to(dtype), weight.to(dtype))
        log_z = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(h[rows], w).float()
            log_z[rows], picked = _log_z_and_target(logits, targets[rows], group, offset)
            ce += ((log_z[rows] - picked) * counted[rows]).sum()
            del logits
        z = (log_z.pow(2) * counted).sum() if z_loss > 0 else torch.zeros_like(ce)
        ctx.save_for_backward(hidden, weight, targets, log_z, n)
        ctx.chunk, ctx.dtype, ctx.z_loss, ctx.group, ctx.offset = chunk, dtype, z_loss, group, offset
        return ce / n, z / n

    @staticmethod
    def backward(ctx, grad_ce, grad_z):
        hidden, weight, targets, log_z, n = ctx.saved_tensors
        dtype = ctx.dtype
        h, w = (hidden, weight) if dtype is None else (hidden.to(dtype), weight.to(dtype))
        tokens, vocab = hidden.shape[0], weight.shape[0]
        counted = (targets != IGNORE).float()
        # d(ce)/d(logit_k) = (p_k − [k = target]) / n and d(z)/d(logit_k) = 2·log Z·p_k / n, per counted token
        scale = counted * (grad_ce + (2 * grad_z * log_z if ctx.z_loss > 0 else 0)) / n
        hit = counted * grad_ce / n
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None  # (a frozen head: none)
        width = max(1, ctx.chunk * vocab // tokens)  # a slice of the vocabulary: chunk tokens' worth of logits
        for start in range(0, vocab, width):
            cols = slice(start, start + width)
            grad = F.linear(h, w[cols]).float().sub_(log_z.unsqueeze(1)).exp_().mul_(scale.unsqueeze(1))
            first = ctx.offset + start  # (the slice's first vocabulary entry)
            inside = (targets >= first) & (targets < first + grad.shape[1])  # (a row elsewhere adds 0)
            grad.scatter_add_(1, (targets - first).clamp(0, grad.shape[1] - 1).unsqueeze(1),
                              (-hit * inside).unsqueeze(1))
            grad = grad if dtype is None else grad.to(dtype)
            if grad_weight is not None:
                grad_weight[cols] = grad.t() @ h
            grad_hidden.add_(grad @ w[cols])
            del grad
        if ctx.group is not None:  # each rank's rows gave a part of every token's gradient
            dist.all_reduce(grad_hidden, group=ctx.group)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None
