"""Validation loss on the held-out split every `eval.interval` steps (and at the end)."""

from __future__ import annotations

from ultratron.errors import DataError


class Validator:
    def __init__(self, open_loader, *, interval: int, batches: int, micro_batch_size: int, eval_loss):
        self.open_loader = open_loader  # () -> a fresh loader of the held-out split, or None without one
        self.interval, self.batches, self.micro_batch_size = interval, batches, micro_batch_size
        self.eval_loss = eval_loss  # (inputs, targets) -> float, the step strategy's

    def due(self, step: int, at_end: bool) -> bool:
        return self.interval > 0 and (step % self.interval == 0 or at_end)

    def run(self) -> float | None:
        """The mean loss over `batches` micro-batches of the held-out split (the same ones each
        time), or None without a held-out split one micro-batch long."""
        try:
            loader = self.open_loader()
        except DataError:
            return None
        if loader is None:
            return None
        batches = min(self.batches, loader.n_sequences // self.micro_batch_size)
        if batches == 0:
            return None
        return sum(self.eval_loss(*loader.next_batch()) for _ in range(batches)) / batches
