"""Fixed-length training sequences from token shards: deterministic, rank-aware, resumable.

The one-rank stream is a seeded permutation of all sequences (windows of seq_len + 1 tokens
with stride seq_len, never crossing a shard), reshuffled every epoch. With `dp_world` ranks each
micro-batch step consumes `dp_world × micro_batch_size` sequences of that stream and rank r takes
the r-th block, so the ranks see disjoint data that together is exactly the one-rank stream
with a dp_world-times larger micro-batch.
"""

from __future__ import annotations

import numpy as np
import torch

from ultratron.data.shards import ShardSet
from ultratron.errors import DataError


class TokenLoader:
    def __init__(self, shards: ShardSet, *, seq_len: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, {dp_world})")
        self.shards = shards
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        per_shard = [max(0, (len(t) - 1) // seq_len) for t in shards.tokens]
        self._first = np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int64)
        self.n_sequences = int(self._first[-1])
        needed = micro_batch_size * dp_world
        if self.n_sequences < needed:
            raise DataError(
                f"{shards.root}: {shards.n_tokens} tokens make {self.n_sequences} sequences of "
                f"{seq_len + 1} tokens, fewer than one step needs ({needed}); add data or lower "
                "training.seq_len / training.micro_batch_size"
            )
        self.epoch = 0
        self.position = 0  # index into the one-rank stream of the current epoch
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_sequences)

    def _sequence(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self._first, index, side="right") - 1)
        start = (index - int(self._first[shard])) * self.seq_len
        return self.shards.tokens[shard][start:start + self.seq_len + 1]

    def next_indices(self) -> np.ndarray:
        """Sequence indices of this rank's next micro-batch (advances the stream)."""
        step = self.micro_batch_size * self.dp_world
        if self.position + step > self.n_sequences:  # drop the ragged tail, start a new epoch
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        begin = self.position + self.dp_rank * self.micro_batch_size
        self.position += step
        return self._order[begin:begin + self.micro_batch_size]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 of shape (micro_batch_size, seq_len)."""
        rows = np.stack([self._sequence(int(i)) for i in self.next_indices()]).astype(np.int64)
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n_sequences": self.n_sequences, "seq_len": self.seq_len}

    def metrics(self) -> dict[str, float]:
        """Per-source counters (a mixture's); one dataset has none beyond the trainer's own."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if "names" in state:
            raise DataError(f"data loader state is of the mixture {state['names']}, but the data is one dataset now "
                            "(was data.sources removed?)")
        for key in ("seed", "n_sequences", "seq_len"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"data loader state does not match the data: saved {key}={state[key]}, "
                    f"now {getattr(self, key)} (were the shards or training.seq_len changed?)"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
