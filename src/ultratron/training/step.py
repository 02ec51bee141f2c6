"""The forward-and-backward part of one optimizer step, for any parallel layout.

The step knows no parallel axis: it cuts the step's micro-batches through the active axes
(`parallel.axis.Axes`), runs them through the layout's runner — one after another, or a pipeline's
schedule — inside the axes' step context, lets each axis finish its gradients, and averages the
loss over the ranks the axes name. The trainer around it clips, steps the optimizer and reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ultratron.models.registry import unwrap
from ultratron.parallel.axis import MicroBatch
from ultratron.parallel.parallelize import Parallel
from ultratron.training.loss import IGNORE, chunked_cross_entropy, cross_entropy, linear_cross_entropy
from ultratron.training.precision import autocast


def as_micro_batch(batch: tuple) -> MicroBatch:
    """A loader's (inputs, targets) or, under document masking, (inputs, targets, documents)."""
    return MicroBatch(batch[0], batch[1], documents=batch[2] if len(batch) > 2 else None)


@contextlib.contextmanager
def hidden_out_for_loss(models: list[nn.Module], scoring: Callable[[], bool], precision: str, device: torch.device):
    """Autocast, and a forward that returns the hidden states wherever the step's loss follows it: in
    training, and in validation's forward (`scoring()`); a forward for logits (sampling) keeps logits.
    Of the model, and of a pipeline's stage modules (views of it, which the schedule runs)."""
    for model in models:
        model.hidden_out = model.training or scoring()
    try:
        with autocast(precision, device):
            yield
    finally:
        for model in models:
            model.hidden_out = False


def plain_head(model: nn.Module) -> bool:
    """The output head is a bias-free `nn.Linear` with no soft cap (not fp8's, LoRA's or another
    wrapper): the chunked loss can take its weight (`linear_cross_entropy`) instead of calling it."""
    output = getattr(model, "output", None)
    return type(output) is nn.Linear and output.bias is None and not getattr(model.args, "final_softcap", 0)


class TrainStep:
    """One step's forward and backward, and validation's forward, through one loss: the whole-logits
    cross-entropy (under tp on vocabulary-sharded logits), or with `loss_chunk` the chunked one on the
    hidden states. Validation runs the step's forward and loss without backward (`eval_loss`), so it
    never holds more than the step does: no whole logits, gathered or not, where the step has none."""

    def __init__(self, parallel: Parallel, device: torch.device, precision: str, z_loss: float,
                 compile_loss: bool = False, count_loss_tokens: bool = False, loss_chunk: int = 0):
        self.axes, self.device = parallel.axes, device
        self.count_loss_tokens, self.loss_tokens = count_loss_tokens, 0  # the last step's targets that counted
        self.scoring = False  # validation's forward is on: the model hands over what the loss takes
        if loss_chunk > 0:  # the model hands over its hidden states; the loss makes the logits
            model = unwrap(parallel.model)
            plain = plain_head(model)

            def chunked(z: float):
                def loss_of(hidden, targets):
                    with autocast(precision, device):  # (the head's matmul as inside the forward)
                        if plain:  # (the weight looked up each time: FSDP2 swaps in the gathered one)
                            return linear_cross_entropy(hidden, model.output.weight, targets, z, loss_chunk)
                        return chunked_cross_entropy(hidden, model.head, targets, z, loss_chunk)
                return loss_of

            # validation reports the cross-entropy alone (the loss's second value, the same with z-loss
            # or without): it computes no z-loss
            train_loss, self.validation_loss = chunked(z_loss), chunked(0.0)
            holders = [model]
            self.runner = self.axes.runner(
                train_loss, lambda: hidden_out_for_loss(holders, lambda: self.scoring, precision, device))
            pipeline = getattr(self.runner, "pipeline", None)
            holders += pipeline.modules if pipeline is not None else []
            return
        train_loss = parallel.compiled_loss(cross_entropy, compile_loss)  # (validation's stays eager)
        self.validation_loss = cross_entropy  # (no z-loss, as above)
        self.runner = self.axes.runner(lambda logits, targets: train_loss(logits, targets, z_loss),
                                       lambda: autocast(precision, device))

    def forward_backward(self, next_batch: Callable, n_micro_batches: int) -> float:
        """Accumulate the gradients of `n_micro_batches` micro-batches; returns their mean loss over
        every rank (the plain cross-entropy, without z-loss)."""
        self.runner.train(True)
        batches = [self.axes.shard(as_micro_batch(next_batch()).to(self.device)) for _ in range(n_micro_batches)]
        with self.axes.step_context(training=True):
            local = self.runner.forward_backward(batches)
        self.axes.after_backward()
        if self.count_loss_tokens:  # (a collective: only where some targets do not count, e.g. chat data)
            counted = sum((b.targets != IGNORE).sum() for b in batches)
            self.loss_tokens = int(self.axes.sum_over_data(counted))
        return float(self.axes.average_loss(local, training=True))

    def loss_weight(self, n_micro_batches: int) -> float:
        """A micro-batch's weight in the accumulated gradients (MoE balancing loss scale)."""
        return self.runner.loss_weight(n_micro_batches)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None) -> float:
        """The cross-entropy of one batch, no gradients (for validation): the step's forward and loss
        in eval mode — chunked, on vocabulary-sharded logits, on the last stage, as the step computes it."""
        self.runner.train(False)
        batch = self.axes.shard(MicroBatch(inputs, targets, documents=documents).to(self.device))
        self.scoring = True
        try:
            with self.axes.step_context(training=False):
                ce = self.runner.eval_loss(batch, self.validation_loss)
        finally:
            self.scoring = False
        loss = batch.weighted(ce) if ce is not None else torch.zeros((), device=self.device)
        return float(self.axes.average_loss(loss, training=False))

    @property
    def sampling_model(self):
        """What `models.sampling.generate` calls for logits (every rank takes part)."""
        self.runner.train(False)
        return self.runner.sampling_model()
