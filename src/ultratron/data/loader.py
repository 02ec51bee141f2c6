"""Fixed-length training sequences from token shards: deterministic, rank-aware, resumable on any
number of ranks.

The global stream is a seeded permutation of all sequences (windows of seq_len + 1 tokens with
stride seq_len, never crossing a shard), followed by another permutation for the next epoch, and
so on; over shards on an object store (data/remote.py) each epoch's permutation works within
windows of the set's `window` shards, so that only a window's shards are needed at a time
(data/order.py). The loader's position is global too: the number of sequences of that stream consumed so
far by every rank together (`consumed`). Each micro-batch step consumes the next
`dp_world × micro_batch_size` sequences and rank r reads the r-th block of them, so the ranks see
disjoint data that together is exactly the one-rank stream with a dp_world-times larger
micro-batch. Since nothing in the position depends on the layout, a run saved at dp2 resumes at
dp4, dp1 or any other layout, or with another global batch, and reads each sequence of the
stream exactly once across the interruption; `view` changes the layout mid-run (a replica group
that left the quorum, parallel/replicas.py).

Packed shards (chat data) hold sequences of exactly seq_len tokens with a flags byte per token:
a window is one packed sequence (and the next one's first token, which never counts in the loss),
and targets that do not count in the loss are IGNORE. With `documents`, a batch also numbers each
row's documents (a packed shard's DOC_START flags; else a document ends with EOS) for the model's
document masking, and a target that begins a document does not count: nothing before it in its
own document predicts it.
"""

from __future__ import annotations

import numpy as np
import torch

from ultratron.data.order import make_order
from ultratron.data.shards import DOC_START, LOSS, ShardSet
from ultratron.errors import DataError

IGNORE = -100  # a target that does not count in the loss (training/loss.py's IGNORE)


def batch_of(windows: list[tuple[np.ndarray, np.ndarray | None]], eos_id: int, documents: bool) -> tuple:
    """Windows of seq_len + 1 tokens (and flags, for packed shards) → (inputs, targets) or, with
    `documents`, (inputs, targets, document numbers), int64 of shape (rows, seq_len)."""
    rows = torch.from_numpy(np.stack([w for w, _ in windows]).astype(np.int64))
    inputs, targets = rows[:, :-1], rows[:, 1:].clone()
    packed = windows[0][1] is not None
    if packed:
        flags = torch.from_numpy(np.stack([f for _, f in windows]).astype(np.int64))
        targets[(flags[:, 1:] & LOSS) == 0] = IGNORE
        starts = (flags & DOC_START) != 0
    else:
        starts = torch.zeros_like(rows, dtype=torch.bool)
        starts[:, 1:] = rows[:, :-1] == eos_id  # the token after an EOS begins a document
    if not documents:
        return inputs, targets
    starts[:, 0] = True  # a window's first token begins its row's first (part of a) document
    targets[starts[:, 1:]] = IGNORE
    return inputs, targets, torch.cumsum(starts[:, :-1].long(), dim=1)


class TokenLoader:
    def __init__(self, shards: ShardSet, *, seq_len: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0, documents: bool = False):
        self.shards, self.documents = shards, documents
        self.window = getattr(shards, "window", 0)  # 0: one permutation of the whole epoch
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.view(dp_rank, dp_world)
        self.packed = shards.flags is not None
        if self.packed and shards.meta["packed"] != seq_len:
            raise DataError(f"{shards.root}: conversations were packed into sequences of {shards.meta['packed']} "
                            f"tokens, not training.seq_len={seq_len}; prepare the data again")
        lengths = [s["n_tokens"] for s in shards.meta["shards"]]
        per_shard = [n // seq_len if self.packed else max(0, (n - 1) // seq_len) for n in lengths]
        self._first = np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int64)
        self.n_sequences = int(self._first[-1])
        needed = micro_batch_size * dp_world
        if self.n_sequences < needed:
            raise DataError(
                f"{shards.root}: {shards.n_tokens} tokens make {self.n_sequences} sequences of "
                f"{seq_len + 1} tokens, fewer than one step needs ({needed}); add data or lower "
                "training.seq_len / training.micro_batch_size"
            )
        self.consumed = 0  # sequences of the global stream consumed so far, by every rank, over every epoch
        self.order = make_order(self._first, seed, self.window)

    def view(self, dp_rank: int, dp_world: int) -> None:
        """Read as rank `dp_rank` of `dp_world` from the next micro-batch step on."""
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, {dp_world})")
        self.dp_rank, self.dp_world = dp_rank, dp_world

    @property
    def epoch(self) -> int:
        """How many times the whole data has been used up (the epoch the next sequence is in)."""
        return self.consumed // self.n_sequences

    def indices_at(self, start: int, count: int) -> np.ndarray:
        """Sequence indices of positions start .. start + count - 1 of the global stream."""
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs = positions // self.n_sequences
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):  # one, or two where the block straddles the end of an epoch
            mask = epochs == epoch
            out[mask] = self.order.in_epoch(int(epoch), positions[mask] - epoch * self.n_sequences)
        return out

    def _sequence(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Window `index`: seq_len + 1 tokens, and their flags in a packed set (the last packed
        sequence of a shard is followed by an EOS that counts in nothing)."""
        shard = int(np.searchsorted(self._first, index, side="right") - 1)
        start = (index - int(self._first[shard])) * self.seq_len
        tokens = self.shards.tokens[shard][start:start + self.seq_len + 1]
        if not self.packed:
            return tokens, None
        flags = self.shards.flags[shard][start:start + self.seq_len + 1]
        if len(tokens) == self.seq_len:
            tokens = np.append(tokens, self.shards.meta["eos_id"]).astype(tokens.dtype)
            flags = np.append(flags, DOC_START).astype(np.uint8)
        return tokens, flags

    def next_indices(self) -> np.ndarray:
        """Sequence indices of this rank's next micro-batch (advances the global position by the
        whole micro-batch step: every rank's block)."""
        begin = self.consumed + self.dp_rank * self.micro_batch_size
        if self.window and (ahead := self.order.shards_ahead(begin)) is not None:
            self.shards.advise(*ahead)  # what the shard cache should hold now and fetch next
        self.consumed += self.micro_batch_size * self.dp_world
        return self.indices_at(begin, self.micro_batch_size)

    def next_batch(self) -> tuple:
        """(inputs, targets), each int64 of shape (micro_batch_size, seq_len), and with `documents`
        each token's document number (`batch_of`)."""
        windows = [self._sequence(int(i)) for i in self.next_indices()]
        return batch_of(windows, self.shards.meta["eos_id"], self.documents)

    def state_dict(self) -> dict:
        state = {"consumed": self.consumed, "seed": self.seed, "n_sequences": self.n_sequences, "seq_len": self.seq_len}
        return state | ({"window": self.window} if self.window else {})

    def metrics(self) -> dict[str, float]:
        """The shard cache's counters where the shards are fetched (data/remote.py); else none."""
        return getattr(self.shards, "metrics", dict)()

    def load_state_dict(self, state: dict) -> None:
        if "names" in state:
            raise DataError(f"data loader state is of the mixture {state['names']}, but the data is one dataset now "
                            "(was data.sources removed?)")
        for key in ("seed", "n_sequences", "seq_len", "window"):
            if (saved := state.get(key, 0)) != getattr(self, key):  # (a state saved on local data has no window)
                raise DataError(
                    f"data loader state does not match the data: saved {key}={saved}, "
                    f"now {getattr(self, key)} (were the shards or training.seq_len changed?)"
                )
        if "consumed" in state:
            self.consumed = int(state["consumed"])
        else:  # written before the position was global: (epoch, position within its permutation)
            self.consumed = int(state["epoch"]) * self.n_sequences + int(state["position"])
