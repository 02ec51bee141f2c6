"""Validation loss on the held-out split every `eval.interval` steps (and at the end)."""

from __future__ import annotations

from ultratron.errors import DataError


class Validator:
    def __init__(self, open_loader, *, interval: int, batches: int, micro_batch_size: int, eval_loss,
                 open_sources=None):
        self.open_loader = open_loader  # () -> a fresh loader of the held-out split, or None without one
        self.interval, self.batches, self.micro_batch_size = interval, batches, micro_batch_size
        self.eval_loss = eval_loss  # (inputs, targets[, documents]) -> float, the step strategy's
        # () -> {source name: a fresh loader of its held-out split}: a mixture's sources, each also alone
        self.open_sources = open_sources or dict
        self.per_source: dict[str, float] = {}  # the last run's loss of each source

    def due(self, step: int, at_end: bool) -> bool:
        return self.interval > 0 and (step % self.interval == 0 or at_end)

    def run(self) -> float | None:
        """The mean loss over `batches` micro-batches of the held-out split (the same ones each
        time), or None without a held-out split one micro-batch long; with several sources, each
        source's own (`per_source`) too."""
        try:
            loader = self.open_loader()
        except DataError:
            return None
        self.per_source = {}
        for name, source in self.open_sources().items():
            if (loss := self._mean(source)) is not None:
                self.per_source[name] = loss
        return self._mean(loader)

    def _mean(self, loader) -> float | None:
        if loader is None:
            return None
        batches = min(self.batches, loader.n_sequences // self.micro_batch_size)
        if batches == 0:
            return None
        return sum(self.eval_loss(*loader.next_batch()) for _ in range(batches)) / batches
