"""The forward-and-backward part of one optimizer step, as a strategy a parallel layout can replace.

`GradAccumStep` runs the step's micro-batches one after another (gradient accumulation) on any
data/tensor-parallel layout; a pipeline schedule, which runs forward and backward itself, is
another strategy with the same two methods. The trainer around it clips, steps the optimizer and
reports, whatever strategy ran.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ultratron.parallel.data_parallel import average_over_dp
from ultratron.parallel.dims import ParallelDims
from ultratron.parallel.parallelize import micro_batch
from ultratron.parallel.tensor_parallel import local_value
from ultratron.training.loss import cross_entropy
from ultratron.training.precision import autocast


class StepStrategy(Protocol):
    def forward_backward(self, next_batch, n_micro_batches: int) -> float:
        """Accumulate the gradients of `n_micro_batches` micro-batches; returns their mean loss
        over every data-parallel rank (the plain cross-entropy, without z-loss)."""

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The cross-entropy of one batch, no gradients (for validation)."""


class GradAccumStep:
    def __init__(self, model: nn.Module, dims: ParallelDims, device: torch.device, precision: str, z_loss: float):
        self.model, self.dims, self.device = model, dims, device
        self.precision, self.z_loss = precision, z_loss

    def forward_backward(self, next_batch, n_micro_batches: int) -> float:
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(n_micro_batches):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in next_batch())
            with micro_batch(self.model, self.dims, last=micro == n_micro_batches - 1):
                with autocast(self.precision, self.device):
                    logits = self.model(inputs)
                loss, ce = cross_entropy(logits, targets, self.z_loss)
                (loss / n_micro_batches).backward()
            loss_sum += local_value(ce.detach())
        return float(average_over_dp(loss_sum, self.dims) / n_micro_batches)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.model.eval()
        with autocast(self.precision, self.device):
            logits = self.model(inputs.to(self.device))
        return float(cross_entropy(logits, targets.to(self.device))[1])  # eval mode: full logits on every rank
