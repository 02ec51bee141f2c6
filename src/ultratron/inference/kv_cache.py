"""A key/value cache of per-sequence slots, for batched generation where sequences come and go.

The engine uses the paged cache (inference/paged_kv.py), which gives the same numbers without
reserving the whole context per sequence; this one stays as the simplest cache the model's
interface takes and the reference the paged one is tested against.

The cache holds `slots` rows of `capacity` positions per layer, allocated once. The running
sequences occupy slots 0..n-1; a new one takes slot n and a finished one is replaced by the last
(its keys and values move into the freed slot), so a decode step always reads one contiguous
block. `rows(lo, hi)` is the view a forward pass uses: it supplies each row's positions and
stores the new keys/values at them.

Within a view, rows are right-padded: a forward of (batch, seq) new tokens writes them at each
row's current length, and `advance` then moves each row on by its number of real tokens, so
padding is simply overwritten later. A query attends to every cached key at a position not after
its own, which is the causal rule for real tokens; padded queries compute garbage nobody reads.

`at(slots)` is the same view over any slots (a prefill of sequences that sit apart): it reads and
writes them by index, a copy per forward, where `rows` hands out views.
"""

from __future__ import annotations

import torch

from ultratron.models.masks import MaskSpec
from ultratron.models.registry import model_args, plan_of


class _LayerCache:
    def __init__(self, rows: Rows, name: str):
        self.rows, self.name = rows, name

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values (batch, kv_heads, seq, head_dim); return all of them (the model masks
        them from the positions, `Rows.positions`)."""
        return self.rows._update(self.name, k, v)


class Rows:
    """Slots lo..hi-1 of a `SlotCache` (or the slots `index`), as the model's forward sees a cache."""

    def __init__(self, cache: SlotCache, lo: int, hi: int, index: torch.Tensor | None = None):
        self.cache, self.lo, self.hi, self.index = cache, lo, hi, index
        self._positions: torch.Tensor | None = None
        self._end = 0

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths[self.lo:self.hi] if self.index is None else self.cache.lengths[self.index]

    def positions(self, seq: int) -> torch.Tensor:
        """Absolute positions (batch, seq) of the tokens about to be forwarded."""
        capacity = self.cache.capacity
        pos = self.lengths[:, None] + torch.arange(seq, device=self.lengths.device)[None, :]
        if int(pos[:, 0].max()) + 1 > capacity:
            raise ValueError("KV cache is full")
        pos = pos.clamp(max=capacity - 1)  # only padding can reach past the end
        self._end = int(pos.max()) + 1
        self._positions = pos
        return pos

    def layer(self, name: str) -> _LayerCache:
        return _LayerCache(self, name)

    @staticmethod
    def mask(positions: torch.Tensor, backend: str) -> MaskSpec:
        """Which keys each query sees: a row's keys sit at their positions (causal on them)."""
        return MaskSpec(rows=positions, backend=backend)

    def _update(self, name: str, k: torch.Tensor, v: torch.Tensor):
        if self.index is not None:
            return self._update_at(name, k, v)
        keys = self.cache.keys[name][self.lo:self.hi]  # views: the writes land in the cache
        values = self.cache.values[name][self.lo:self.hi]
        index = self._positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        keys.scatter_(2, index, k.to(keys.dtype))
        values.scatter_(2, index, v.to(values.dtype))
        end = self._end
        return keys[:, :, :end], values[:, :, :end]

    def _update_at(self, name: str, k: torch.Tensor, v: torch.Tensor):
        rows, pos, end = self.index[:, None], self._positions, self._end
        out = []
        for store, new in ((self.cache.keys[name], k), (self.cache.values[name], v)):
            store[rows, :, pos] = new.transpose(1, 2).to(store.dtype)  # (batch, seq, kv_heads, head_dim)
            out.append(store[self.index, :, :end])
        return out[0], out[1]

    def advance(self, n_tokens: torch.Tensor | int) -> None:
        """Move each row on by its number of real (non-padding) tokens just forwarded."""
        if self.index is None:
            self.cache.lengths[self.lo:self.hi] += n_tokens
        else:
            self.cache.lengths[self.index] += n_tokens


class SlotCache:
    def __init__(self, model, slots: int, capacity: int):
        args = model_args(model)
        if capacity > args.max_seq_len:
            raise ValueError(f"cache capacity {capacity} exceeds max_seq_len={args.max_seq_len}")
        param = next(model.parameters())
        shape = (slots, args.n_kv_heads, capacity, args.head_dim)
        blocks = plan_of(model).blocks(model)  # the model's attention layers, by the names its forward asks
        self.keys = {name: torch.zeros(shape, dtype=param.dtype, device=param.device) for name in blocks}
        self.values = {name: torch.zeros(shape, dtype=param.dtype, device=param.device) for name in blocks}
        self.lengths = torch.zeros(slots, dtype=torch.long, device=param.device)
        self.slots, self.capacity = slots, capacity

    @staticmethod
    def bytes_needed(model, slots: int, capacity: int) -> int:
        args = model_args(model)
        itemsize = next(model.parameters()).element_size()
        return 2 * len(plan_of(model).blocks(model)) * slots * args.n_kv_heads * capacity * args.head_dim * itemsize

    def rows(self, lo: int, hi: int) -> Rows:
        return Rows(self, lo, hi)

    def at(self, slots: list[int]) -> Rows:
        """The view over `slots` in this order (views when they are consecutive)."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return Rows(self, slots[0], slots[0] + len(slots))
        return Rows(self, 0, 0, torch.tensor(slots, device=self.lengths.device))

    def swap(self, a: int, b: int) -> None:
        """Exchange two slots' keys, values and lengths."""
        if a == b:
            return
        end = int(max(self.lengths[a], self.lengths[b]))
        for store in (self.keys, self.values):
            for tensor in store.values():  # (an index-list assignment takes a slow path: ~500× slower)
                held = tensor[a, :, :end].clone()
                tensor[a, :, :end] = tensor[b, :, :end]
                tensor[b, :, :end] = held
        la, lb = int(self.lengths[a]), int(self.lengths[b])
        self.lengths[a], self.lengths[b] = lb, la

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Slot `src`'s keys, values and length into slot `dst` (which is being freed)."""
        if src == dst:
            return
        end = int(self.lengths[src])
        for store in (self.keys, self.values):
            for tensor in store.values():
                tensor[dst, :, :end] = tensor[src, :, :end]
        self.lengths[dst] = self.lengths[src]
