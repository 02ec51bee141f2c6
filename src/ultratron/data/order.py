"""The order of the global sequence stream: which sequence is the p-th one of an epoch.

`GlobalOrder` (window 0, the default for local shards) is one seeded permutation of all
sequences per epoch, as it always was; it is made and kept as uint32 where the count fits (4 bytes
per sequence instead of 8 for the array and 8 more for its copy, the same values: at 1T tokens
and seq_len 2,048, 1.95 GB per epoch instead of 3.9).

`WindowedOrder` (window W > 0, the default for shards on an object store) needs only W shards at a
time: each epoch permutes the shards (seed, epoch), cuts that list into windows of W shards, and
walks the windows in turn, each one's sequences in a permutation of their own (seed, epoch,
window), computed when the window is reached. So a reader holds the current window's shards and
prefetches the next window's, and the local cache stays bounded whatever the data's size. Nothing
is held per sequence beyond one window's permutation. Both orders visit every sequence exactly
once per epoch; the position (`consumed`) means the same in both.
"""

from __future__ import annotations

import numpy as np


def permutation(seed: list[int], n: int) -> np.ndarray:
    """`default_rng(seed).permutation(n)`, the same values, shuffled in place as uint32 where they
    fit: 4 bytes a sequence at its peak, not the int64 array and its copy."""
    order = np.arange(n, dtype=np.uint32 if n < 2**32 else np.int64)
    np.random.default_rng(seed).shuffle(order)
    return order


class GlobalOrder:
    def __init__(self, first: np.ndarray, seed: int):
        self.n, self.seed = int(first[-1]), seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # at most two are in use
            self._orders[epoch] = permutation([self.seed, epoch], self.n)
        return self._orders[epoch]

    def in_epoch(self, epoch: int, offsets: np.ndarray) -> np.ndarray:
        return self._order(epoch)[offsets].astype(np.int64)


class WindowedOrder:
    def __init__(self, first: np.ndarray, seed: int, window: int):
        self.first, self.seed, self.window = first, seed, window
        self.n, self.n_shards = int(first[-1]), len(first) - 1
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._windows: dict[tuple[int, int], np.ndarray] = {}
        self._span = (0, 0)  # the global positions of the window shards_ahead last reported
        self._last: tuple = (-1, 0, 0, None)  # (epoch, first offset, end, order) of the window in_epoch last read

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the epoch's shards in order, the first position of each window and the end)."""
        if epoch not in self._epochs:
            self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1}
            shards = np.random.default_rng([self.seed, epoch, 1]).permutation(self.n_shards)
            counts = np.diff(self.first)[shards]
            per_window = np.add.reduceat(counts, np.arange(0, self.n_shards, self.window))
            self._epochs[epoch] = shards, np.concatenate([[0], np.cumsum(per_window)]).astype(np.int64)
        return self._epochs[epoch]

    def window_shards(self, epoch: int, w: int) -> list[int]:
        shards, _ = self._epoch(epoch)
        return [int(s) for s in shards[w * self.window:(w + 1) * self.window]]

    def _window(self, epoch: int, w: int) -> np.ndarray:
        """The window's sequence indices in their order."""
        if (epoch, w) not in self._windows:
            self._windows = {k: v for k, v in self._windows.items() if k >= (epoch, w - 1) or k[0] > epoch}
            ids = np.concatenate([np.arange(self.first[s], self.first[s + 1], dtype=np.int64)
                                  for s in self.window_shards(epoch, w)])
            self._windows[(epoch, w)] = ids[np.random.default_rng([self.seed, epoch, 2, w]).permutation(len(ids))]
        return self._windows[(epoch, w)]

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, window) of a global position."""
        epoch = position // self.n
        _, starts = self._epoch(epoch)
        return epoch, int(np.searchsorted(starts, position - epoch * self.n, side="right") - 1)

    def in_epoch(self, epoch: int, offsets: np.ndarray) -> np.ndarray:
        last = self._last
        if last[0] == epoch and last[1] <= offsets[0] and offsets[-1] < last[2]:
            return last[3][offsets - last[1]]  # the usual case: within the window of the last call
        _, starts = self._epoch(epoch)
        windows = np.searchsorted(starts, offsets, side="right") - 1
        if windows[0] == windows[-1]:  # offsets come in increasing order: one window
            w = int(windows[0])
            self._last = (epoch, int(starts[w]), int(starts[w + 1]), self._window(epoch, w))
            return self._last[3][offsets - starts[w]]
        out = np.empty(len(offsets), dtype=np.int64)
        for w in np.unique(windows):
            mask = windows == w
            out[mask] = self._window(epoch, int(w))[offsets[mask] - starts[w]]
        return out

    def shards_ahead(self, position: int) -> tuple[list[int], list[int]] | None:
        """(the shards of the window at `position`, those of the window after it) — the next
        epoch's first window after the last one of an epoch; None while `position` is still in the
        window of the last call (nothing changed)."""
        if self._span[0] <= position < self._span[1]:
            return None
        epoch, w = self.locate(position)
        starts = self._epoch(epoch)[1]
        self._span = (epoch * self.n + int(starts[w]), epoch * self.n + int(starts[w + 1]))
        after = (epoch, w + 1) if w + 2 < len(starts) else (epoch + 1, 0)
        return self.window_shards(epoch, w), self.window_shards(*after)


def make_order(first: np.ndarray, seed: int, window: int):
    return WindowedOrder(first, seed, window) if window > 0 else GlobalOrder(first, seed)
