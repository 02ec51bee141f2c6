"""A prefix cache of prompt keys/values and prompt log-probabilities, in blocks of positions.

A prompt is cut into blocks of `block` tokens. A block is keyed by (its parent block's id, its
tokens): the key names the whole prefix up to the block's end, so a lookup walks a prompt block by
block from the root, and a hit is exact — the dict compares the tokens, no hash collision can
return another prefix's block. Besides full blocks the cache holds partial blocks (fewer tokens,
always leaves): a prompt's tail, and the point where two prompts admitted together part ways, so a
prompt that shares 37 tokens with another reuses 37, not 32.

Each block keeps, per layer, the keys and values of its positions (model dtype, on the model's
device) and, when the prompt that filled it asked for them (echo), each position's token
log-probability and the top `top_k` alternatives of the distribution it was drawn from (fp32, on
the CPU): what an echo + logprobs request reports for that prompt token. Every one of these is a
function of the tokens up to the block's end only, so a hit returns what computing the prefix
again would (up to the floating-point order of the batch it was computed in).

Memory: `bytes` counts every block's tensors; it never exceeds `budget_bytes`. Before a block is
stored, least recently used blocks that no other block hangs from and no admission holds (`pin`)
are evicted; when that cannot make room the block is not stored.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ultratron.models.registry import model_args, plan_of

ROOT = 0  # the parent id of a prompt's first block


@dataclass(eq=False)
class Block:
    id: int
    key: tuple[int, tuple[int, ...]]  # (parent id, tokens)
    kv: torch.Tensor  # (layers, 2, n, kv_heads, head_dim)
    logprob: torch.Tensor | None = None  # (n,) fp32: each token's log-probability (nan: the prompt's first)
    top_ids: torch.Tensor | None = None  # (n, top_k) int32
    top_values: torch.Tensor | None = None  # (n, top_k) fp32
    children: int = 0
    pins: int = 0

    @property
    def parent(self) -> int:
        return self.key[0]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.key[1]


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens `a` and `b` share."""
    n, i = min(len(a), len(b)), 0
    while i + 64 <= n and a[i:i + 64] == b[i:i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, model, tokens: int, top_k: int = 20, block: int = 16):
        args = model_args(model)
        self.layers = len(plan_of(model).blocks(model))
        itemsize = next(model.parameters()).element_size()
        self.kv_bytes_per_token = 2 * self.layers * args.n_kv_heads * args.head_dim * itemsize
        self.logprob_bytes_per_token = 4 + top_k * (4 + 4)
        self.budget_bytes = tokens * (self.kv_bytes_per_token + self.logprob_bytes_per_token)
        self.top_k, self.block = top_k, block
        self.blocks: dict[tuple[int, tuple[int, ...]], Block] = {}
        self.lru: OrderedDict[int, Block] = OrderedDict()  # id → block, least recently used first
        self.bytes = self.tokens = 0
        self._ids = itertools.count(ROOT + 1)
        self.evicted = self.lookups = self.hit_lookups = 0
        self.version = 0  # changes whenever a block is added, upgraded or evicted: a match may differ

    def nbytes(self, b: Block) -> int:
        n = len(b.tokens)
        return n * self.kv_bytes_per_token + (0 if b.logprob is None else n * self.logprob_bytes_per_token)

    # ---- lookup --------------------------------------------------------------------------------
    def match(self, tokens: list[int], logprobs: bool) -> list[Block]:
        """The blocks of the longest cached prefix of `tokens` (with log-probabilities when asked),
        root first; they become the most recently used."""
        chain, parent, i, size = [], ROOT, 0, self.block
        while i + size <= len(tokens):
            b = self.blocks.get((parent, tuple(tokens[i:i + size])))
            if b is None or (logprobs and b.logprob is None):
                break
            chain.append(b)
            parent, i = b.id, i + size
        for n in range(min(size - 1, len(tokens) - i), 0, -1):  # a partial block: the tail
            b = self.blocks.get((parent, tuple(tokens[i:i + n])))
            if b is not None and not (logprobs and b.logprob is None):
                chain.append(b)
                break
        self.lookups += 1
        self.hit_lookups += bool(chain)
        self._touch(chain)
        return chain

    def _touch(self, chain: list[Block]) -> None:
        for b in reversed(chain):  # the leaf first, so a parent is never less recent than its child
            self.lru.move_to_end(b.id)

    # ---- storing -------------------------------------------------------------------------------
    def store(self, tokens: list[int], read_kv, infos: tuple[torch.Tensor, ...] | None,
              splits: tuple[int, ...] = ()) -> int:
        """Store the blocks of a computed prompt: every full block, a partial block at its end and at
        each of `splits` (positions where another prompt parts from this one). `read_kv(a, b)` gives
        positions a..b-1's keys/values (layers, 2, b - a, kv_heads, head_dim); `infos` is the
        prompt's (logprob, top_ids, top_values) per position, or None. Returns the tokens stored."""
        size, stored, chain, parent = self.block, 0, [], ROOT
        full = len(tokens) // size
        try:
            for j in range(full):
                b = self._put(parent, tokens, j * size, (j + 1) * size, read_kv, infos)
                if b is None:
                    return stored
                chain.append(b)
                b.pins += 1
                parent, stored = b.id, stored + size
            for end in sorted({s for s in (*splits, len(tokens)) if 0 < s <= len(tokens) and s % size}):
                j = end // size
                if j <= len(chain):
                    self._put(chain[j - 1].id if j else ROOT, tokens, j * size, end, read_kv, infos)
            return stored
        finally:
            for b in chain:  # the blocks this store held against eviction, let go
                b.pins -= 1

    def _put(self, parent: int, tokens: list[int], a: int, b: int, read_kv, infos) -> Block | None:
        key = (parent, tuple(tokens[a:b]))
        block = self.blocks.get(key)
        if block is not None:
            if block.logprob is None and infos is not None:  # upgrade: now with log-probabilities
                extra = (b - a) * self.logprob_bytes_per_token
                block.pins += 1  # not evicted to make room for its own upgrade
                room = self._make_room(extra)
                block.pins -= 1
                if room:
                    block.logprob, block.top_ids, block.top_values = (t[a:b].clone() for t in infos)
                    self.bytes += extra
                    self.version += 1
            self.lru.move_to_end(block.id)
            return block
        block = Block(next(self._ids), key, torch.empty(0))
        if infos is not None:
            block.logprob, block.top_ids, block.top_values = (t[a:b].clone() for t in infos)
        need = (b - a) * self.kv_bytes_per_token + (0 if infos is None else (b - a) * self.logprob_bytes_per_token)
        if not self._make_room(need):
            return None
        block.kv = read_kv(a, b)
        self.blocks[key] = block
        self.version += 1
        self.lru[block.id] = block
        self.bytes += need
        self.tokens += b - a
        if parent != ROOT:
            self.lru[parent].children += 1
        return block

    def _make_room(self, need: int) -> bool:
        if need > self.budget_bytes:
            return False
        while self.bytes + need > self.budget_bytes:
            victim = next((b for b in self.lru.values() if b.children == 0 and b.pins == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, b: Block) -> None:
        del self.blocks[b.key]
        self.version += 1
        del self.lru[b.id]
        self.bytes -= self.nbytes(b)
        self.tokens -= len(b.tokens)
        self.evicted += 1
        if b.parent != ROOT:
            self.lru[b.parent].children -= 1

    def clear(self) -> None:
        for b in list(self.lru.values()):
            b.pins = 0
        self.blocks.clear()
        self.lru.clear()
        self.bytes = self.tokens = 0
        self.version += 1

    def stats(self) -> dict:
        """Counters (safe to read from another thread while the engine runs)."""
        return {"blocks": len(self.blocks), "tokens": self.tokens,
                "bytes": self.bytes, "budget_bytes": self.budget_bytes, "lookups": self.lookups,
                "hit_lookups": self.hit_lookups, "evicted_blocks": self.evicted}
