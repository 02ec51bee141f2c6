"""A paged key/value cache: one pool of fixed-size blocks that the running sequences share.

The keys and values of every layer are one tensor allocated once, the pool: (layers, 2, rows,
kv_heads, head_dim), each layer's keys and values a view of it (n_blocks · block rows, kv_heads,
head_dim), so pool row b · block + i is position i of block b, and a prompt's positions are read,
written or copied for every layer by one index op. A sequence (a "slot": the engine's handle for
it, at most `slots` of them) holds a block table, the pool blocks of its positions 0..block−1,
block..2·block−1, ...; it gets a block when it grows past the ones it has (`grow`) and gives them
all back when it ends (`reset`). Memory follows the positions held, not the context length: the
pool's `tokens` bound the sum of the sequences' lengths (rounded up to blocks), and `slots` only
how many run at once.

A forward's view (`rows`, `at`) is the model's cache interface, as SlotCache's: `positions(seq)`
gives each row's positions and maps them to pool rows (table[p // block] · block + p % block),
`mask(positions, backend)` says which keys each query sees (the `MaskSpec`),
`layer(name).update(k, v)` writes the new keys/values there and returns each row's keys/values
at positions 0..end−1, gathered from its blocks (one index_select per layer and forward, a copy).
Within a view rows are right-padded: a padded position inside the row's blocks is written and
overwritten later (as in a slot); one past them is not written, and a position past a row's
blocks reads whatever pool row 0 holds. Only padded queries, whose outputs nobody reads, attend
to such keys: a real query at position p sees the keys at 0..p, all of them the row's own.
`packed` is the view of prompts that share a prefix forwarded as trees (`PackedRows`).
"""

from __future__ import annotations

import torch

from ultratron.models.masks import MaskSpec
from ultratron.models.registry import model_args, plan_of


def blocks_for(tokens: int, block: int) -> int:
    return -(-tokens // block)


class PagedCache:
    def __init__(self, model, slots: int, capacity: int, tokens: int, block: int = 16):
        args = model_args(model)
        if capacity > args.max_seq_len:
            raise ValueError(f"cache capacity {capacity} exceeds max_seq_len={args.max_seq_len}")
        if tokens < block:
            raise ValueError(f"a KV cache of {tokens} tokens holds not even one block of {block}")
        param = next(model.parameters())
        self.block, self.n_blocks = block, tokens // block
        shape = (self.n_blocks * block, args.n_kv_heads, args.head_dim)
        names = plan_of(model).blocks(model)  # the model's attention layers, by the names its forward asks
        self.pool = torch.zeros((len(names), 2, *shape), dtype=param.dtype, device=param.device)
        self.keys = {n: self.pool[i, 0] for i, n in enumerate(names)}
        self.values = {n: self.pool[i, 1] for i, n in enumerate(names)}
        self.lengths = torch.zeros(slots, dtype=torch.long, device=param.device)
        self.table = torch.zeros(slots, blocks_for(capacity, block), dtype=torch.long, device=param.device)
        self.held = [0] * slots  # blocks in each slot's table
        self._free = list(range(self.n_blocks - 1, -1, -1))  # pop() hands out the lowest first
        self.slots, self.capacity = slots, capacity

    @staticmethod
    def default_tokens(slots: int, capacity: int, block: int = 16) -> int:
        """What slots of `capacity` positions each would reserve, in whole blocks: every slot fits."""
        return slots * blocks_for(capacity, block) * block

    @staticmethod
    def bytes_needed(model, tokens: int, block: int = 16) -> int:
        args = model_args(model)
        itemsize = next(model.parameters()).element_size()
        positions = tokens // block * block
        return 2 * len(plan_of(model).blocks(model)) * positions * args.n_kv_heads * args.head_dim * itemsize

    @property
    def tokens(self) -> int:
        """Positions the pool holds."""
        return self.n_blocks * self.block

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block)

    def grow(self, slot: int, tokens: int) -> None:
        """Give `slot` the blocks its positions 0..tokens−1 need; ValueError when the pool has too few."""
        need = self.blocks_for(tokens) - self.held[slot]
        if need > len(self._free):
            raise ValueError(f"the KV cache has {len(self._free)} free blocks, {need} needed")
        for _ in range(need):
            self.table[slot, self.held[slot]] = self._free.pop()
            self.held[slot] += 1

    def reset(self, slot: int) -> None:
        """The slot's sequence is gone: its blocks go back to the pool."""
        self._free.extend(reversed(self.table[slot, :self.held[slot]].tolist()))
        self.held[slot] = 0
        self.lengths[slot] = 0

    def clear(self) -> None:
        for slot in range(self.slots):
            self.reset(slot)

    def move(self, src: int, dst: int) -> None:
        """Slot `src`'s sequence into slot `dst` (whose blocks are freed): only the table moves."""
        if src == dst:
            return
        self.reset(dst)
        self.table[dst] = self.table[src]
        self.held[dst], self.held[src] = self.held[src], 0
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0

    def swap(self, a: int, b: int) -> None:
        if a == b:
            return
        self.table[[a, b]] = self.table[[b, a]]
        self.held[a], self.held[b] = self.held[b], self.held[a]
        self.lengths[[a, b]] = self.lengths[[b, a]]

    def _pool_rows(self, slot: int, a: int, b: int) -> torch.Tensor:
        pos = torch.arange(a, b, device=self.table.device)
        return self.table[slot, pos // self.block] * self.block + pos % self.block

    def read(self, slot: int, a: int, b: int) -> torch.Tensor:
        """Positions a..b−1 of `slot`: (layers, 2, b − a, kv_heads, head_dim), a copy (positions
        before heads, as the pool holds them: no transpose either way)."""
        return self.pool.index_select(2, self._pool_rows(slot, a, b))

    def write(self, slot: int, a: int, kv: torch.Tensor) -> None:
        """`kv` (layers, 2, n, kv_heads, head_dim), as `read` gives it, into positions a..a+n−1 of
        `slot` (which gets the blocks for them)."""
        n = kv.shape[2]
        self.grow(slot, a + n)
        self.pool.index_copy_(2, self._pool_rows(slot, a, a + n), kv)

    def copy(self, spans: list[tuple[int, int, int, int]]) -> None:
        """For each (src, dst, a, b): positions a..b−1 of slot `src` into the same positions of slot
        `dst` (which has their blocks); one gather and one scatter for them all."""
        spans = [span for span in spans if span[3] > span[2]]
        if not spans:
            return
        frm = torch.cat([self._pool_rows(src, a, b) for src, _, a, b in spans])
        to = torch.cat([self._pool_rows(dst, a, b) for _, dst, a, b in spans])
        self.pool.index_copy_(2, to, self.pool.index_select(2, frm))

    def rows(self, lo: int, hi: int) -> PagedRows:
        return PagedRows(self, torch.arange(lo, hi, device=self.lengths.device))

    def at(self, slots: list[int]) -> PagedRows:
        return PagedRows(self, torch.tensor(slots, device=self.lengths.device))

    def packed(self, rows: list[list[tuple[int, int, int]]]) -> PackedRows:
        return PackedRows(self, rows)


class _LayerCache:
    def __init__(self, rows: PagedRows, name: str):
        self.rows, self.name = rows, name

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values (batch, kv_heads, seq, head_dim); return all of the rows' (the model
        masks them from the positions)."""
        return self.rows._update(self.name, k, v)


class PagedRows:
    """Some slots of a `PagedCache`, as the model's forward sees a cache."""

    def __init__(self, cache: PagedCache, slots: torch.Tensor):
        self.cache, self.slots = cache, slots

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths[self.slots]

    def positions(self, seq: int) -> torch.Tensor:
        """Absolute positions (batch, seq) of the tokens about to be forwarded; where their keys and
        values go in the pool and where every row's keys at 0..end−1 come from."""
        cache, block = self.cache, self.cache.block
        lengths = self.lengths
        pos = lengths[:, None] + torch.arange(seq, device=lengths.device)[None, :]
        if int(pos[:, 0].max()) + 1 > cache.capacity:
            raise ValueError("KV cache is full")
        inside = pos < cache.capacity
        pos = pos.clamp(max=cache.capacity - 1)  # only padding can reach past the end
        end = int(pos.max()) + 1
        table = cache.table[self.slots]  # (batch, blocks a sequence can have)
        held = torch.tensor(cache.held, device=table.device)[self.slots]
        written = inside & (pos // block < held[:, None])  # not clamped, in the row's blocks
        rows = (table.gather(1, pos // block) * block + pos % block).reshape(-1)
        self._take = None if bool(written.all()) else written.reshape(-1).nonzero().squeeze(1)  # (decode: all)
        self._write_rows = rows if self._take is None else rows[self._take]
        every = torch.arange(end, device=table.device)
        reads = table[:, every // block] * block + every % block  # (batch, end)
        reads.masked_fill_(every[None, :] // block >= held[:, None], 0)  # past the row's blocks: masked keys
        self._read_rows, self._shape = reads.reshape(-1), (len(self.slots), end)
        return pos

    def layer(self, name: str) -> _LayerCache:
        return _LayerCache(self, name)

    @staticmethod
    def mask(positions: torch.Tensor, backend: str) -> MaskSpec:
        """Which keys each query sees: a row's keys sit at their positions (causal on them)."""
        return MaskSpec(rows=positions, backend=backend)

    def _update(self, name: str, k: torch.Tensor, v: torch.Tensor):
        out = []
        for store, new in ((self.cache.keys[name], k), (self.cache.values[name], v)):
            new = new.transpose(1, 2).reshape(-1, *store.shape[1:])  # (batch · seq, kv_heads, head_dim)
            if self._take is not None:
                new = new.index_select(0, self._take)
            store.index_copy_(0, self._write_rows, new.to(store.dtype))
            gathered = store.index_select(0, self._read_rows)
            out.append(gathered.view(*self._shape, *store.shape[1:]).transpose(1, 2))
        return out[0], out[1]

    def advance(self, n_tokens: torch.Tensor | int) -> None:
        """Move each row on by its number of real (non-padding) tokens just forwarded."""
        self.cache.lengths[self.slots] += n_tokens


class PackedRows(PagedRows):
    """Prompts that share a prefix, forwarded as trees: each row is a list of segments (slot, first
    position, count). The first segment is a prompt's next chunk, after the positions its slot
    holds already; each further one is another prompt's tail, from the position where it forks from
    the first (its positions before that are the first's, computed now or before, and copied into
    its slot after the forward: `PagedCache.copy`). A row's keys are numbered as one sequence: the
    first slot's held positions, then the row's tokens in order. A segment's queries see its own
    keys and the first segment's before its fork (`MaskSpec.shared`); RoPE takes each token's
    position in its own prompt. Padding is neither written nor seen by a real query."""

    def __init__(self, cache: PagedCache, segments: list[list[tuple[int, int, int]]]):
        super().__init__(cache, torch.tensor([row[0][0] for row in segments], device=cache.lengths.device))
        self.segments = segments

    def positions(self, seq: int) -> torch.Tensor:
        cache, device = self.cache, self.cache.lengths.device
        starts = [row[0][1] for row in self.segments]  # keys before a row's tokens: its first slot's
        end = max(starts) + seq
        pos = torch.zeros(len(self.segments), seq, dtype=torch.long, device=device)
        reads = torch.zeros(len(self.segments), end, dtype=torch.long, device=device)
        docs = torch.full((len(self.segments), end), -1, dtype=torch.long, device=device)
        shared = torch.zeros(len(self.segments), end, dtype=torch.long, device=device)
        real = torch.zeros(len(self.segments), seq, dtype=torch.bool, device=device)
        for r, row in enumerate(self.segments):
            base = starts[r]
            reads[r, :base] = cache._pool_rows(row[0][0], 0, base)
            docs[r, :base] = 0
            t = 0
            for j, (slot, first, count) in enumerate(row):
                pos[r, t:t + count] = torch.arange(first, first + count, device=device)
                reads[r, base + t:base + t + count] = cache._pool_rows(slot, first, first + count)
                docs[r, base + t:base + t + count] = j
                shared[r, base + t:base + t + count] = first if j else 0
                real[r, t:t + count] = True
                t += count
        self._rows = torch.tensor(starts, device=device)[:, None] + torch.arange(seq, device=device)[None, :]
        self._take = real.reshape(-1).nonzero().squeeze(1)
        self._write_rows = reads.gather(1, self._rows).reshape(-1)[self._take]  # (the tokens' own keys)
        self._read_rows, self._shape = reads.reshape(-1), (len(self.segments), end)
        self._documents, self._shared = docs, shared
        return pos

    def mask(self, positions: torch.Tensor, backend: str) -> MaskSpec:
        return MaskSpec(rows=self._rows, documents=self._documents, shared=self._shared, backend=backend)

    def advance(self, n_tokens=None) -> None:
        """Every segment's slot now holds its positions up to the end of its tokens."""
        for row in self.segments:
            for slot, first, count in row:
                self.cache.lengths[slot] = first + count
