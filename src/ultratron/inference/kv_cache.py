"""A key/value cache for batched inference where every row sits at its own position.

Rows are right-padded: a forward of (batch, seq) new tokens writes them at each row's current
length, and `advance` then moves each row on by its number of real tokens, so padding is simply
overwritten later. A query attends to every cached key at a position not after its own, which
is the causal rule for real tokens; padded queries compute garbage that nobody reads.
"""

from __future__ import annotations

import torch


class _LayerCache:
    def __init__(self, owner: KVCache, name: str):
        self.owner, self.name = owner, name

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store new keys/values (batch, kv_heads, seq, head_dim); return all of them and the mask."""
        return self.owner._update(self.name, k, v)


class KVCache:
    def __init__(self, model, batch: int, capacity: int):
        args = model.args
        if capacity > args.max_seq_len:
            raise ValueError(f"cache capacity {capacity} exceeds max_seq_len={args.max_seq_len}")
        param = next(model.parameters())
        shape = (batch, args.n_kv_heads, capacity, args.head_dim)
        self.keys = {name: torch.zeros(shape, dtype=param.dtype, device=param.device) for name in model.layers}
        self.values = {name: torch.zeros(shape, dtype=param.dtype, device=param.device) for name in model.layers}
        self.lengths = torch.zeros(batch, dtype=torch.long, device=param.device)
        self.capacity = capacity
        self._positions: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._end = 0

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    def positions(self, seq: int) -> torch.Tensor:
        """Absolute positions (batch, seq) of the tokens about to be forwarded."""
        pos = self.lengths[:, None] + torch.arange(seq, device=self.lengths.device)[None, :]
        if int(pos[:, 0].max()) + 1 > self.capacity:
            raise ValueError("KV cache is full")
        pos = pos.clamp(max=self.capacity - 1)  # only padding can reach past the end
        self._end = int(pos.max()) + 1
        keys = torch.arange(self._end, device=pos.device)
        self._mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # (batch, 1, seq, end)
        self._positions = pos
        return pos

    def layer(self, name: str) -> _LayerCache:
        return _LayerCache(self, name)

    def _update(self, name: str, k: torch.Tensor, v: torch.Tensor):
        index = self._positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.keys[name].scatter_(2, index, k.to(self.keys[name].dtype))
        self.values[name].scatter_(2, index, v.to(self.values[name].dtype))
        end = self._end
        return self.keys[name][:, :, :end], self.values[name][:, :, :end], self._mask

    def advance(self, n_tokens: torch.Tensor | int) -> None:
        """Move each row on by its number of real (non-padding) tokens just forwarded."""
        self.lengths += n_tokens

    def keep(self, rows: list[int]) -> None:
        """Drop every row not listed (finished sequences leave the batch)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
        for store in (self.keys, self.values):
            for name in store:
                store[name] = store[name].index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
