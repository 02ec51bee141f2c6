"""The forward-and-backward part of one optimizer step, as a strategy a parallel layout can replace.

`GradAccumStep` runs the step's micro-batches one after another (gradient accumulation) on any
data/tensor-parallel layout; `PipelineStep` hands them to a pipeline schedule, which runs forward
and backward itself (`parallel/pipeline.py`). `step_strategy` picks one. The trainer around it
clips, steps the optimizer and reports, whatever strategy ran.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ultratron.parallel.compile import compiled_loss
from ultratron.parallel.context_parallel import shard_batch, sharded
from ultratron.parallel.data_parallel import average_over_dp
from ultratron.parallel.dims import ParallelDims
from ultratron.parallel.parallelize import after_backward, micro_batch
from ultratron.parallel.pipeline import TiedGradients, broadcast_from_last, build_schedule, forward_only
from ultratron.parallel.tensor_parallel import local_value, loss_context
from ultratron.training.loss import cross_entropy
from ultratron.training.precision import autocast


class StepStrategy(Protocol):
    def forward_backward(self, next_batch, n_micro_batches: int) -> float:
        """Accumulate the gradients of `n_micro_batches` micro-batches; returns their mean loss
        over every data-parallel rank (the plain cross-entropy, without z-loss)."""

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The cross-entropy of one batch, no gradients (for validation)."""

    @property
    def sampling_model(self):
        """What `models.sampling.generate` calls for logits (every rank takes part)."""

    def loss_weight(self, n_micro_batches: int) -> float:
        """The weight one micro-batch's loss has in the gradients backward accumulates (what a
        gradient injected in backward, such as the MoE balancing loss's, is scaled by)."""


class GradAccumStep:
    def __init__(self, model: nn.Module, dims: ParallelDims, device: torch.device, precision: str, z_loss: float,
                 train_loss=cross_entropy):
        self.model, self.dims, self.device = model, dims, device
        self.precision, self.z_loss = precision, z_loss
        self.train_loss = train_loss  # (validation's stays the eager cross_entropy)

    def forward_backward(self, next_batch, n_micro_batches: int) -> float:
        """Under context parallel each rank runs its shard of the sequences (tokens, targets and
        positions alike) and the loss is averaged over dp × cp."""
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(n_micro_batches):
            inputs, targets, positions = shard_batch(*(t.to(self.device, non_blocking=True) for t in next_batch()),
                                                     self.dims)
            with micro_batch(self.model, self.dims, last=micro == n_micro_batches - 1):
                with autocast(self.precision, self.device):
                    logits = self.model(inputs, positions=positions)
                loss, ce = self.train_loss(logits, targets, self.z_loss)
                (loss / n_micro_batches).backward()
            loss_sum += local_value(ce.detach())
        after_backward(self.model, self.dims)
        return float(average_over_dp(loss_sum, self.dims) / n_micro_batches)

    def loss_weight(self, n_micro_batches: int) -> float:
        return 1.0 / n_micro_batches

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Eval mode: full logits on every tp rank; under context parallel each rank its shard, the
        loss averaged over the cp ranks (the dp ranks validate the same batch)."""
        self.model.eval()
        inputs, targets, positions = shard_batch(inputs.to(self.device), targets.to(self.device), self.dims)
        with autocast(self.precision, self.device), sharded(self.model):
            logits = self.model(inputs, positions=positions)
        loss = cross_entropy(logits, targets)[1]
        if self.dims.cp > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.dims.cp_mesh.get_group())
            loss /= self.dims.cp
        return float(loss)

    @property
    def sampling_model(self) -> nn.Module:
        return self.model


class PipelineStep:
    """The step's micro-batches through torch's pipeline schedule (`parallel.pp_schedule`): the first
    stage reads the inputs, the last computes the loss, the schedule runs forward and backward and
    divides the gradients by the micro-batch count. Then the tied embedding's two copies add their
    gradients; the loss, known on the last stage, is averaged over dp and given to every rank."""

    def __init__(self, model: nn.Module, dims: ParallelDims, device: torch.device, precision: str, z_loss: float,
                 train_loss=cross_entropy):
        self.model, self.dims, self.device = model, dims, device
        self.precision, self.z_loss = precision, z_loss
        self.train_loss = train_loss  # (validation's stays the eager cross_entropy)
        self.pipeline = model.pipeline
        self.tied = TiedGradients(model, dims)
        self.schedule, self.n_micro_batches = None, 0
        self._losses: list[torch.Tensor] = []
        for module in self.pipeline.modules:  # forward under autocast, backward outside it, as GradAccumStep
            _forward_under(module, lambda: autocast(precision, device))

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss, ce = self.train_loss(logits, targets, self.z_loss)
        self._losses.append(local_value(ce.detach()))
        return loss

    def forward_backward(self, next_batch, n_micro_batches: int) -> float:
        if self.schedule is None or n_micro_batches != self.n_micro_batches:
            self.schedule = build_schedule(self.model, self.dims, self.device, n_micro_batches, self._loss)
            self.n_micro_batches = n_micro_batches
        self._train(True)
        batches = [next_batch() for _ in range(n_micro_batches)]  # every rank keeps the loader in step
        inputs = torch.cat([b[0] for b in batches]).to(self.device)
        targets = torch.cat([b[1] for b in batches]).to(self.device)
        self._losses.clear()
        with loss_context(self.dims):
            self.schedule.step(*([inputs] if self.pipeline.holds_first else []), return_outputs=False,
                               target=targets if self.pipeline.holds_last else None)
        self.tied()
        after_backward(self.model, self.dims)
        mean = torch.zeros((), device=self.device)
        if self.pipeline.holds_last:  # (metadata inference on the first step computes one loss more)
            mean = torch.stack(self._losses[-n_micro_batches:]).mean().float()
        dist.all_reduce(mean, group=self.dims.pp_group)  # only the last stage's rank adds a value
        return float(average_over_dp(mean, self.dims))

    def loss_weight(self, n_micro_batches: int) -> float:
        return 1.0  # torch's schedule divides the gradients by the micro-batch count after backward

    def _train(self, mode: bool) -> None:
        self.model.train(mode)
        for module in self.pipeline.modules:  # (views of the part, not its children)
            module.train(mode)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        logits = self.sampling_model(inputs.to(self.device), everywhere=False)
        loss = cross_entropy(logits, targets.to(self.device))[1] if logits is not None else None
        return float(broadcast_from_last(loss, self.model, self.dims, (), torch.float32, self.device))

    @property
    def sampling_model(self) -> PipelineLogits:
        return PipelineLogits(self)


class PipelineLogits:
    """The pipeline as a callable model for validation and sampling: full logits on every rank
    (`everywhere=False`: only on the rank of the last stage, None elsewhere)."""

    def __init__(self, step: PipelineStep):
        self.step, self.args = step, step.model.args

    def parameters(self):
        return self.step.model.parameters()

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, everywhere: bool = True) -> torch.Tensor | None:
        step = self.step
        step._train(False)
        logits = forward_only(step.model, step.dims, tokens)  # (the stages run under autocast already)
        if not everywhere:
            return logits
        shape = (*tokens.shape, self.args.vocab_size)
        return broadcast_from_last(logits, step.model, step.dims, shape, torch.float32, step.device)


def _forward_under(module: nn.Module, context) -> None:
    """Run `module`'s forward inside `context()` (forward hooks: torch's schedule calls the module)."""
    active: list = []

    def enter(*_):
        active.append(context())
        active[-1].__enter__()

    def leave(*_):
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def step_strategy(model: nn.Module, dims: ParallelDims, device: torch.device, precision: str,
                  z_loss: float, compile_loss: bool = False) -> StepStrategy:
    """The pipeline schedule under pipeline parallelism, gradient accumulation otherwise;
    `compile_loss` (training.compile) compiles the training loss (`parallel.compile.compiled_loss`)."""
    return (PipelineStep if dims.pp > 1 else GradAccumStep)(model, dims, device, precision, z_loss,
                                                            compiled_loss(cross_entropy, compile_loss, dims))
