"""Validation loss on the held-out split every `eval.interval` steps (and at the end)."""

from __future__ import annotations

from ultratron.data.loader import TokenLoader
from ultratron.data.shards import ShardSet
from ultratron.errors import DataError


class Validator:
    def __init__(self, shards: ShardSet | None, *, interval: int, batches: int, seq_len: int,
                 micro_batch_size: int, seed: int, eval_loss):
        self.shards, self.interval, self.batches = shards, interval, batches
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.eval_loss = eval_loss  # (inputs, targets) -> float, the step strategy's

    def due(self, step: int, at_end: bool) -> bool:
        return self.interval > 0 and (step % self.interval == 0 or at_end)

    def run(self) -> float | None:
        """The mean loss over `batches` micro-batches of the held-out split (the same ones each
        time), or None without a held-out split one micro-batch long."""
        if self.shards is None:
            return None
        try:
            loader = TokenLoader(self.shards, seq_len=self.seq_len, micro_batch_size=self.micro_batch_size,
                                 seed=self.seed)
        except DataError:
            return None
        batches = min(self.batches, loader.n_sequences // self.micro_batch_size)
        return sum(self.eval_loss(*loader.next_batch()) for _ in range(batches)) / batches
