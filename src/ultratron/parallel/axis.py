"""The one interface between the parallel axes and the training step.

Each axis module (`data`, `tensor`, `pipeline`, `context`, `expert`) says what it does to a model
(its `apply`, called by `parallelize` in the fixed order) and what it does in a step, as an `Axis`:
every hook below does nothing unless the axis overrides it. `Axes` holds the active ones and runs
each hook as one loop over them, so the step (`training/step.py`) and the trainer name no axis. Two
things are not a loop: the micro-batches of a step run through one `Runner` — one after another
(`Accumulation`, here), or through the pipeline's schedule, which runs forward and backward itself
—, and the global gradient norm is one computation over every mesh (`grads.py`) to which the axes
add process groups and leave out copies.

The step in one picture, for any set of active axes:

    batches = [axes.shard(micro_batch) ...]          context: each rank's share of the sequence
    with axes.step_context(training=True):            tensor: loss on vocab-sharded logits; context: ring attention
        local = runner.forward_backward(batches)      (each micro-batch inside axes.micro_batch_context(last))
    axes.after_backward()                             pipeline: tied copies; expert: split experts' gradients
    loss = axes.average_loss(local)                   pipeline: from the last stage; data, context: mean over ranks
    axes.clip_grad_norm(max_norm) → optimizer step → axes.zero_grad(optimizer)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ultratron.parallel.grads import clip_grad_norm


@dataclass(frozen=True)
class MicroBatch:
    """What a rank computes one micro-batch on: token ids, targets (-100 where a token does not
    count in the loss), where they are not 0, 1, ... (a shard of longer sequences) the tokens'
    positions, and under document masking each token's document number (of the whole sequences:
    a shard's positions say which of those tokens it holds). `loss_weight` (a shard's, 0-dim): what
    its mean loss over its own counted targets is multiplied by to be its part of the whole
    micro-batch's mean, when the ranks that share the micro-batch average their losses."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    loss_weight: torch.Tensor | None = None

    def weighted(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.loss_weight is None else loss * self.loss_weight

    def to(self, device: torch.device) -> MicroBatch:
        documents = None if self.documents is None else to_device(self.documents, device)
        return replace(self, inputs=to_device(self.inputs, device), targets=to_device(self.targets, device),
                       documents=documents)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on the device the step computes on. To a GPU from host memory it goes through
    pinned (page-locked) memory, copied with `non_blocking`: the copy is a DMA on the current stream
    that the host does not wait for (from pageable memory a "non-blocking" copy is staged and
    synchronous). Torch's pinned allocator caches the buffers and keeps each until its copy is done."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def plain(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor, e.g. a loss computed on sharded logits."""
    return value.full_tensor() if isinstance(value, DTensor) else value


class Axis:
    """One active parallel axis' part of a training step; the defaults do nothing."""

    name = "axis"
    splits_layers = False  # whether ranks hold different layers (their metrics are combined across)
    sequence_multiple = 1  # sampling pads the context to a multiple of this (sequence parallel)

    def shard(self, batch: MicroBatch) -> MicroBatch:
        """This rank's share of a micro-batch every rank of the axis was given whole."""
        return batch

    def step_context(self, training: bool) -> contextlib.AbstractContextManager:
        """Around a step's forward and backward (training) or a validation forward."""
        return contextlib.nullcontext()

    def micro_batch_context(self, last: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward when they run one after another."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Once per step, after the last micro-batch's backward."""

    def average_loss(self, value: torch.Tensor, training: bool) -> torch.Tensor:
        """This rank's loss → the loss over the axis' ranks (the mean over every token)."""
        return value

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        """A count over this rank's tokens → over the tokens of every rank of the axis."""
        return value

    def reduce_over_stages(self, value: torch.Tensor, op) -> torch.Tensor:
        """A per-layer figure of this rank's layers → combined with the other ranks' layers."""
        return value

    def norm_groups(self) -> list:
        """Process groups over which the squared gradient norm is summed besides its mesh's."""
        return []

    def uncounted(self) -> list[torch.Tensor]:
        """Parameters whose gradients are clipped but not counted in the norm (a copy counted elsewhere)."""
        return []

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def keeps_gradients(self) -> bool:
        """Whether gradients are buffers to zero in place rather than set to None."""
        return False

    def describe(self) -> list[str]:
        return []

    def begin_step(self, loader) -> None:
        """Before a step reads its data: the axis may change which block of the global order this
        rank reads (`loader.view`), e.g. after the set of replica groups changed."""

    def committed(self) -> bool:
        """After the optimizer step: whether the step counts (False: nothing changed, it runs again)."""
        return True

    def step_metrics(self) -> dict:
        """Figures of the step just taken for its metrics record."""
        return {}

    def track_state(self, states: dict) -> None:
        """The run's state (Statefuls by name: the model and optimizer, the run state), for an axis
        that hands it to a replica that rejoins."""

    def close(self) -> None:
        """At the end of training, whether it succeeded or failed: release what the axis started
        (threads, servers) so that the process can exit."""

    def runner(self, model: nn.Module, loss: Loss, around_forward: AroundForward) -> Runner | None:
        """A runner of its own for the step's micro-batches (the pipeline's schedule), or None."""
        return None


class Runner(Protocol):
    """How a step's micro-batches run forward and backward on this rank."""

    def forward_backward(self, batches: list[MicroBatch]) -> torch.Tensor:
        """Accumulate the micro-batches' gradients; returns this rank's mean cross-entropy over them
        (zero on a rank that computes no loss)."""

    def loss_weight(self, n_micro_batches: int) -> float:
        """A micro-batch's weight in the gradients backward accumulates (what a gradient injected in
        backward, such as the MoE balancing loss's, is scaled by)."""

    def eval_loss(self, batch: MicroBatch, loss: Loss) -> torch.Tensor | None:
        """One micro-batch's cross-entropy (`loss`'s second value), forward only and no gradients,
        through the forward the step runs — what it hands the loss, no more (None on a rank that
        computes none)."""

    def train(self, mode: bool) -> None:
        """Training or evaluation mode for everything the runner runs."""

    def sampling_model(self) -> Callable:
        """What `models.sampling.generate` calls for full logits (every rank takes part)."""


Loss = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # → (training loss, cross-entropy)
AroundForward = Callable[[], contextlib.AbstractContextManager]  # e.g. autocast, around every forward


class Accumulation:
    """The runner without pipeline stages: each micro-batch's forward, loss and backward in turn,
    the loss divided by the count so that the gradients add up to the step's mean."""

    def __init__(self, model: nn.Module, axes: Axes, loss: Loss, around_forward: AroundForward):
        self.model, self.axes, self.loss, self.around_forward = model, axes, loss, around_forward

    def forward(self, model: nn.Module, batch: MicroBatch) -> torch.Tensor:
        with self.around_forward():
            return model(batch.inputs, positions=batch.positions, documents=batch.documents)

    def forward_backward(self, batches: list[MicroBatch]) -> torch.Tensor:
        total = None
        for i, batch in enumerate(batches):
            with self.axes.micro_batch_context(last=i == len(batches) - 1):
                loss, ce = map(batch.weighted, self.loss(self.forward(self.model, batch), batch.targets))
                (loss / len(batches)).backward()
            total = plain(ce.detach()) if total is None else total + plain(ce.detach())
        return total / len(batches)

    def loss_weight(self, n_micro_batches: int) -> float:
        return 1.0 / n_micro_batches

    @torch.no_grad()
    def eval_loss(self, batch: MicroBatch, loss: Loss) -> torch.Tensor:
        return plain(loss(self.forward(self.model, batch), batch.targets)[1])

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    def sampling_model(self) -> nn.Module:
        return self.model


class Axes:
    """The active axes of a parallelized model, each hook run as one loop over them."""

    def __init__(self, axes: list[Axis], model: nn.Module):
        self.axes, self.model = axes, model

    def runner(self, loss: Loss, around_forward: AroundForward) -> Runner:
        """The axis' own runner where one has it (a pipeline schedule), else `Accumulation`."""
        for axis in self.axes:
            if (runner := axis.runner(self.model, loss, around_forward)) is not None:
                return runner
        return Accumulation(self.model, self, loss, around_forward)

    def __iter__(self) -> Iterator[Axis]:
        return iter(self.axes)

    @property
    def names(self) -> list[str]:
        return [axis.name for axis in self.axes]

    def shard(self, batch: MicroBatch) -> MicroBatch:
        for axis in self.axes:
            batch = axis.shard(batch)
        return batch

    @contextlib.contextmanager
    def step_context(self, training: bool):
        with contextlib.ExitStack() as stack:
            for axis in self.axes:
                stack.enter_context(axis.step_context(training))
            yield

    @contextlib.contextmanager
    def micro_batch_context(self, last: bool):
        with contextlib.ExitStack() as stack:
            for axis in self.axes:
                stack.enter_context(axis.micro_batch_context(last))
            yield

    def after_backward(self) -> None:
        for axis in self.axes:
            axis.after_backward()

    def average_loss(self, value: torch.Tensor, training: bool) -> torch.Tensor:
        value = value.detach().float().clone()
        for axis in self.axes:
            value = axis.average_loss(value, training)
        return value

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().float().clone()
        for axis in self.axes:
            value = axis.sum_over_data(value)
        return value

    def reduce_over_stages(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        for axis in self.axes:
            value = axis.reduce_over_stages(value, op)
        return value

    @property
    def splits_layers(self) -> bool:
        return any(axis.splits_layers for axis in self.axes)

    @property
    def sequence_multiple(self) -> int:
        return math.prod(axis.sequence_multiple for axis in self.axes)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient by the global norm over all ranks; returns the norm before."""
        uncounted = [p for axis in self.axes for p in axis.uncounted()]
        groups = [g for axis in self.axes for g in axis.norm_groups()]
        return clip_grad_norm(self.model.parameters(), max_norm, groups, uncounted=uncounted)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        for axis in self.axes:
            optimizer = axis.wrap_optimizer(optimizer)
        return optimizer

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=not any(axis.keeps_gradients() for axis in self.axes))

    def describe(self) -> list[str]:
        return [line for axis in self.axes for line in axis.describe()]

    def begin_step(self, loader) -> None:
        for axis in self.axes:
            axis.begin_step(loader)

    def committed(self) -> bool:
        return all(axis.committed() for axis in self.axes)

    def step_metrics(self) -> dict:
        return {k: v for axis in self.axes for k, v in axis.step_metrics().items()}

    def track_state(self, states: dict) -> None:
        for axis in self.axes:
            axis.track_state(states)

    def close(self) -> None:
        for axis in self.axes:
            axis.close()
