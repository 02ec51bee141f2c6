"""The output head and the cross-entropy together, a chunk of tokens at a time (`training.loss_chunk`).

The plain path computes the logits of every token of a micro-batch (tokens × vocabulary), upcasts
them to fp32 for the log-softmax and keeps them for backward: for Llama-3 8B at 8,192 tokens that
is 4.2 GB of fp32 logits and as much again for their gradient. Here the head's matmul, the fp32
log-sum-exp and the loss run over `chunk` tokens at a time, and backward computes each chunk's
logits again to form its gradient — the hidden states' and the head weight's — so that at most one
chunk of logits exists at any moment (as Liger-Kernel's fused linear cross-entropy and torchtune's
chunked output loss do; Cut Cross-Entropy goes further with a fused kernel).

The model stays plain: `DeferredHead` takes the place of its `output` layer (the same Parameter, so
a tied embedding stays tied and the state-dict names do not change) and, while `deferred` is on,
returns a `HeadInput` — the normed hidden states and the head weight — instead of logits; the
training step's loss recognises it. Everywhere else (validation, sampling, export) the head is an
ordinary linear layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100


@dataclass
class HeadInput:
    """What the head would have multiplied: hidden (batch, seq, dim) and weight (vocab, dim)."""

    hidden: torch.Tensor
    weight: torch.Tensor


class DeferredHead(nn.Linear):
    """An `nn.Linear` whose forward, while `deferred`, hands its input on instead of the logits."""

    deferred: bool = False

    def forward(self, x: torch.Tensor):
        return HeadInput(x, self.weight) if self.deferred else super().forward(x)


def defer_head(model: nn.Module, attribute: str = "output") -> DeferredHead:
    """Swap `model.<attribute>` (a bias-free linear layer) for a `DeferredHead` holding its weight."""
    linear = getattr(model, attribute)
    head = DeferredHead(linear.in_features, linear.out_features, bias=False, device="meta")
    head.weight = linear.weight
    setattr(model, attribute, head)
    return head


@contextlib.contextmanager
def deferred(model: nn.Module):
    """Heads of `model` hand on their input within this block (the training step's forward)."""
    heads = [m for m in model.modules() if isinstance(m, DeferredHead)]
    for head in heads:
        head.deferred = True
    try:
        yield
    finally:
        for head in heads:
            head.deferred = False


def _logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """One chunk's logits in fp32, computed as the plain path computes them (in the autocast dtype)."""
    if dtype is not None:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return F.linear(hidden, weight).float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, n_counted, z_loss, chunk, dtype):
        ce = hidden.new_zeros((), dtype=torch.float32)
        z = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            logits = _logits(hidden[start:start + chunk], weight, dtype)
            target = targets[start:start + chunk]
            counted = target != IGNORE
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
            ce = ce + ((lse - picked) * counted).sum()
            if z_loss > 0:
                z = z + (lse.pow(2) * counted).sum()
        ctx.save_for_backward(hidden, weight, targets)
        ctx.n_counted, ctx.z_loss, ctx.chunk, ctx.dtype = n_counted, z_loss, chunk, dtype
        return ce / n_counted, z / n_counted

    @staticmethod
    def backward(ctx, grad_ce, grad_z):
        hidden, weight, targets = ctx.saved_tensors
        dtype, n = ctx.dtype, ctx.n_counted
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start:start + ctx.chunk]
            target = targets[start:start + ctx.chunk]
            counted = (target != IGNORE).unsqueeze(1)
            # in place on the chunk's logits: one chunk-sized tensor at a time, not one per step
            grad = _logits(h, weight, dtype)
            lse = torch.logsumexp(grad, dim=-1, keepdim=True)
            probs = grad.sub_(lse).exp_()
            # d(ce)/d(logits) = softmax − one-hot; d(z)/d(logits) = 2·lse·softmax; each over n tokens
            scale = (grad_ce / n) + ((2 * grad_z / n) * lse if ctx.z_loss > 0 else 0)
            grad = probs.mul_(scale)
            grad.scatter_add_(1, target.clamp(min=0).unsqueeze(1), (-grad_ce / n).expand(len(target), 1).clone())
            grad.mul_(counted)
            if dtype is not None:  # as autograd would: the matmul's gradients in its own dtype
                grad = grad.to(dtype)
                grad_hidden[start:start + ctx.chunk] = (grad @ weight.to(dtype)).to(hidden.dtype)
                grad_weight += (grad.t() @ h.to(dtype)).float()
            else:
                grad_hidden[start:start + ctx.chunk] = grad @ weight
                grad_weight.addmm_(grad.t(), h)
            del grad, probs
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def chunked_cross_entropy(head: HeadInput, targets: torch.Tensor, z_loss: float, chunk: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to minimise, plain cross-entropy) as `training.loss.cross_entropy` gives them for the
    logits `head` stands for, without those logits: `chunk` tokens' worth at a time."""
    hidden = head.hidden.flatten(0, 1)
    targets = targets.flatten()
    n_counted = int((targets != IGNORE).sum().clamp(min=1))
    dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else None
    with torch.autocast(hidden.device.type, enabled=False):
        ce, z = _ChunkedCrossEntropy.apply(hidden, head.weight, targets, n_counted, z_loss, chunk, dtype)
    return (ce + z_loss * z if z_loss > 0 else ce), ce
