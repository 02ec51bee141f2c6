"""A key/value cache of per-sequence slots, for batched generation where sequences come and go.

The cache holds `slots` rows of `capacity` positions per layer, allocated once. The running
sequences occupy slots 0..n-1; a new one takes slot n and a finished one is replaced by the last
(its keys and values move into the freed slot), so a decode step always reads one contiguous
block. `rows(lo, hi)` is the view a forward pass uses: it supplies each row's positions and
stores the new keys/values at them.

Within a view, rows are right-padded: a forward of (batch, seq) new tokens writes them at each
row's current length, and `advance` then moves each row on by its number of real tokens, so
padding is simply overwritten later. A query attends to every cached key at a position not after
its own, which is the causal rule for real tokens; padded queries compute garbage nobody reads.
"""

from __future__ import annotations

import torch

from ultratron.models.registry import model_args, plan_of


class _LayerCache:
    def __init__(self, rows: Rows, name: str):
        self.rows, self.name = rows, name

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store new keys/values (batch, kv_heads, seq, head_dim); return all of them and the mask."""
        return self.rows._update(self.name, k, v)


class Rows:
    """Slots lo..hi-1 of a `SlotCache`, as the model's forward sees a cache."""

    def __init__(self, cache: SlotCache, lo: int, hi: int):
        self.cache, self.lo, self.hi = cache, lo, hi
        self._positions: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._end = 0

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths[self.lo:self.hi]

    def positions(self, seq: int) -> torch.Tensor:
        """Absolute positions (batch, seq) of the tokens about to be forwarded."""
        capacity = self.cache.capacity
        pos = self.lengths[:, None] + torch.arange(seq, device=self.lengths.device)[None, :]
        if int(pos[:, 0].max()) + 1 > capacity:
            raise ValueError("KV cache is full")
        pos = pos.clamp(max=capacity - 1)  # only padding can reach past the end
        self._end = int(pos.max()) + 1
        keys = torch.arange(self._end, device=pos.device)
        self._mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # (batch, 1, seq, end)
        self._positions = pos
        return pos

    def layer(self, name: str) -> _LayerCache:
        return _LayerCache(self, name)

    def _update(self, name: str, k: torch.Tensor, v: torch.Tensor):
        keys = self.cache.keys[name][self.lo:self.hi]  # views: the writes land in the cache
        values = self.cache.values[name][self.lo:self.hi]
        index = self._positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        keys.scatter_(2, index, k.to(keys.dtype))
        values.scatter_(2, index, v.to(values.dtype))
        end = self._end
        return keys[:, :, :end], values[:, :, :end], self._mask

    def advance(self, n_tokens: torch.Tensor | int) -> None:
        """Move each row on by its number of real (non-padding) tokens just forwarded."""
        self.cache.lengths[self.lo:self.hi] += n_tokens


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
