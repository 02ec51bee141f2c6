"""Batched generation over a paged KV cache (inference/paged_kv.py): prompts are prefilled (reusing what
the prefix cache holds, a token budget at a time), then every running sequence gets one token per
step, and sequences join and leave between steps.

Used by the HTTP server (continuous batching: `Engine` under serving's Batcher) and by the local
evaluation backend (`run_batch`). Each row keeps its own sampling settings (temperature, top-p,
seed), stop strings and logprob requests; finished rows leave at once, so the rest run on a
smaller batch or make room for a waiting sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ultratron.inference.paged_kv import PagedCache
from ultratron.inference.prefill import Prefill, PrefillStats
from ultratron.inference.prefix_cache import PrefixCache
from ultratron.inference.sequence import SamplingParams, Sequence, TokenInfo, _adjusted, _Row
from ultratron.models.registry import model_args

__all__ = ["Engine", "Refused", "SamplingParams", "Sequence", "TokenInfo", "_adjusted", "run_batch"]


class Refused(ValueError):
    """Sequences `admit` cannot take, found before any of them is queued: only they fail. Any other
    error from `admit` comes from a prefill forward, and the prompts queued then are in doubt."""


class Engine:
    """Continuous batching: sequences join and leave the running batch at token boundaries.

    Each admitted sequence owns a slot (a block table) of the paged KV cache, at most `slots` of
    them; its blocks come from a pool of `kv_cache_tokens` positions as it grows (default: slots ×
    capacity, what a slot each at full context would reserve). A prompt starts its prefill only when
    the pool can give all of its blocks besides those promised to the prompts prefilling, and (a new
    one) one spare block per running row unless every slot fits at full capacity (`roomy`, the
    default pool); until then it waits in the queue, and the prompts behind it
    too (FIFO). When a decode step needs more blocks than are free, the rows that joined last are
    preempted: their blocks are freed and they go to the front of the queue, where their prompt and
    generated tokens are computed again when blocks free up (vLLM's recompute preemption); their
    sampling goes on where it was. A sequence longer than the pool is refused (ValueError).

    `admit` queues new sequences for prefill
    and runs prefill forwards of at most `max_batched_tokens` tokens (less the running rows' one
    each): a prompt longer than that is prefilled in chunks over several calls, the running rows
    stepping in between. With a prefix cache (`prefix_cache_tokens` > 0) a prompt's longest cached
    prefix is copied into its slot and only the rest computed; a prompt that shares an uncached
    prefix with one in the same forward is computed in its row from where they fork (a packed
    tree, `PagedCache.packed`), or, when it cannot, waits for it and then reuses it. `step`
    samples every running sequence's next token, lets the finished ones go (their slots are
    reused at once) and forwards the rest by one token. A scheduler around it (serving's Batcher)
    decides who is admitted when; `run_batch` admits everything and steps until done.

    Counters for monitoring (`stats()`, also plain attributes): `prefill.prompt_tokens` (prompt
    tokens of the sequences admitted), `prefill.computed_tokens` (those the model computed; the
    rest came from the prefix cache), `prefill.cached_tokens`; the prefix cache's `bytes`,
    `budget_bytes`, `lookups`, `hit_lookups`; the KV slots' `kv_tokens` (positions held now) and
    `kv_peak_tokens` (the most held after any forward) against `kv_capacity` (the pool's positions);
    `kv_blocks` in use now, `kv_peak_blocks`, `preempted` rows and `prefill.recomputed_tokens`.
    """

    def __init__(self, model, eos_id: int, decode: Callable[[list[int]], str], slots: int, capacity: int, *,
                 prefix_cache_tokens: int = 0, cache_top_k: int = 20, max_batched_tokens: int | None = None,
                 block: int = 16, kv_cache_tokens: int | None = None):
        self.model, self.eos_id, self.decode = model, eos_id, decode
        self.device = next(model.parameters()).device
        capacity = min(capacity, model_args(model).max_seq_len)
        pool = kv_cache_tokens or PagedCache.default_tokens(slots, capacity, block)
        self.cache = PagedCache(model, slots, capacity, pool, block)
        # every slot fits at full capacity: no prompt waits for blocks, no row is preempted
        self.roomy = self.cache.n_blocks >= slots * self.cache.blocks_for(capacity)
        self.top_k = min(cache_top_k, model_args(model).vocab_size)  # alternatives kept per prompt position
        self.prefix = PrefixCache(model, prefix_cache_tokens, self.top_k, block) if prefix_cache_tokens > 0 else None
        # prompts that share a prefix are forwarded together as trees (not past a sliding window, whose
        # mask counts positions that a packed row renumbers)
        self.packs = self.prefix is not None and not getattr(model_args(model), "sliding_window", 0)
        self.max_batched_tokens = max_batched_tokens or slots * self.cache.capacity
        self.rows: list[_Row] = []  # row i occupies slot i
        self.pending: list[torch.Tensor] = []  # row i's log-probabilities for its next token
        self.queue: list[Prefill] = []  # admitted, prompt not computed yet; each holds a slot past the rows
        self.prefill = PrefillStats()
        self.kv_peak_tokens = self.kv_peak_blocks = self.preempted = self._joined = 0

    @property
    def free(self) -> int:
        return self.cache.slots - len(self.rows) - len(self.queue)

    @property
    def busy(self) -> bool:
        """Work left: rows to step or prompts to prefill."""
        return bool(self.rows or self.queue)

    @property
    def kv_tokens(self) -> int:
        return int(self.cache.lengths.sum())

    @property
    def kv_capacity(self) -> int:
        return self.cache.tokens

    def stats(self) -> dict:
        """Counters for /metrics: prompt tokens admitted and computed, prefix-cache use, KV use."""
        out = {**vars(self.prefill), "kv_tokens": self.kv_tokens, "kv_peak_tokens": self.kv_peak_tokens,
               "kv_capacity": self.kv_capacity, "kv_blocks": self.cache.n_blocks - self.cache.free_blocks,
               "kv_peak_blocks": self.kv_peak_blocks, "kv_block": self.cache.block, "preempted": self.preempted,
               "running": len(self.rows), "prefilling": len(self.queue)}
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix.stats()
        return out

    @torch.no_grad()
    def admit(self, seqs: list[Sequence]) -> list[Sequence]:
        """Queue `seqs` for prefill, each in a free slot, and prefill within the token budget;
        returns the sequences finished already (max_tokens 0)."""
        if len(seqs) > self.free:
            raise Refused(f"{len(seqs)} sequences do not fit the {self.free} free slots")
        if any(not s.prompt_ids for s in seqs):
            raise Refused("every prompt needs at least one token")
        longest = max((len(s.prompt_ids) for s in seqs), default=0)
        if longest > self.cache.capacity:
            raise Refused(f"a prompt of {longest} tokens exceeds the cache capacity {self.cache.capacity}")
        longest = max((min(len(s.prompt_ids) + s.params.max_tokens, self.cache.capacity) for s in seqs), default=0)
        if longest > self.cache.tokens:
            raise Refused(f"a sequence of {longest} tokens (prompt and max_tokens) exceeds the KV cache "
                          f"of {self.cache.tokens} tokens")
        held = {p.slot for p in self.queue}
        free = (slot for slot in range(len(self.rows), self.cache.slots) if slot not in held)
        for s, slot in zip(seqs, free, strict=False):
            self.cache.reset(slot)
            self.queue.append(Prefill(s, slot))
        return self.run_prefill()

    def run_prefill(self) -> list[Sequence]:
        """Prefill forwards until the token budget of this iteration is spent or nothing is left
        that may go now; the prompts completed join the running rows."""
        budget = max(self.max_batched_tokens - len(self.rows), 1)
        done: list[Sequence] = []
        while budget > 0 and self.queue:
            chosen = self._choose(budget)
            if not chosen:
                break
            trees = _trees(chosen)
            budget -= len(trees) * max(sum(c for _, c in row) for row in trees)
            complete = self._forward(trees)
            self._note_kv()
            for item in complete:
                done += self._complete(item)
        return done

    def _choose(self, budget: int) -> list[tuple[Prefill, int]]:
        """The queued prompts to forward now and how many tokens of each (FIFO; rows padded to the
        widest, within the budget). With a prefix cache, a prompt that shares a block or more beyond
        its cached prefix, or half of what it would compute, with a prompt heading a row of this
        forward follows it (`_lead`: computed in that row from where they fork); a prompt that
        shares that much more with another being prefilled waits, and reuses that part after the
        other's forward (in this iteration while the budget lasts)."""
        chosen: list[tuple[Prefill, int]] = []
        rows: dict[Prefill, list[int]] = {}  # a row's first prompt → [its chunk, the row's length]
        width = 0
        started = [p for p in self.queue if p.started]
        blocked = False  # a prompt waits for blocks: so do the ones behind it
        for item in self.queue:
            lead = None
            if not item.started:
                if blocked:
                    continue
                cached = item.lookup(self.prefix)
                lead, fork = self._lead(item, rows, cached)
                base = max(fork, cached)  # what it would not compute now
                if self.prefix is not None and any(  # (what it would reuse after the other's forward)
                        p is not lead and self._worth_waiting(item, p.shares(item) - base, base) for p in started):
                    continue
                spare = 0 if item.resume is not None or self.roomy else len(self.rows)
                if self.cache.blocks_for(len(item.ids)) + spare > self._available():
                    blocked = True
                    continue
            if lead is not None:
                c, row = len(item.ids) - fork, rows[lead]
                if len(rows) * max(width, row[1] + c) > budget or row[1] + c > self.cache.capacity:
                    continue  # (it waits for the next forward)
                item.follow(lead, fork, self.top_k, self.prefill)
                started.append(item)
                row[1] += c
                width = max(width, row[1])
                chosen.append((item, c))
                continue
            c = min(item.remaining - (0 if item.started else item.reuse), budget)
            if (len(rows) + 1) * max(width, c) > budget:
                if not rows or (len(rows) + 1) * width > budget:
                    break
                c = width  # a chunk of it, as wide as the others
            if not item.started:
                item.start(self.cache, self.prefix, self.top_k, self.prefill)
                started.append(item)
            chosen.append((item, c))
            rows[item] = [c, c]
            width = max(width, c)
        return chosen

    def _lead(self, item: Prefill, rows: dict[Prefill, list[int]], cached: int) -> tuple[Prefill | None, int]:
        """The prompt heading a row of this forward that `item` shares the longest prefix with, if
        worth following, and the position `item` forks from it (one before their first difference:
        that position's distribution scores `item`'s next token, not the leader's). The leader must
        have computed every position before the fork by the end of this forward."""
        if not self.packs or item.resume is not None:
            return None, 0
        best, fork = None, 0
        for lead, (c, _) in rows.items():
            f = lead.shares(item) - 1
            if (f > fork and f <= lead.done + c and lead.resume is None
                    and (lead.infos is not None or not item.echo)):
                best, fork = lead, f
        if best is None or not self._worth_waiting(item, fork - item.reuse, cached):
            return None, 0
        return best, fork

    def _available(self) -> int:
        """Free blocks not promised to the prompts prefilling (each gets all its blocks)."""
        promised = sum(self.cache.blocks_for(len(p.ids)) - self.cache.held[p.slot] for p in self.queue if p.started)
        return self.cache.free_blocks - promised

    def _worth_waiting(self, item: Prefill, gain: int, cached: int) -> bool:
        return gain > 1 and (gain >= self.prefix.block or 2 * gain >= len(item.ids) - cached)

    def _forward(self, trees: list[list[tuple[Prefill, int]]]) -> list[Prefill]:
        """One forward of the chosen chunks, a row per tree (`_trees`); log-softmax only where a
        log-probability is needed. Returns the prompts now complete."""
        chosen = [chunk for row in trees for chunk in row]
        width = max(sum(c for _, c in row) for row in trees)
        tokens = torch.zeros(len(trees), width, dtype=torch.long)
        place = []  # each chunk's (row, first column)
        for i, row in enumerate(trees):
            t = 0
            for item, c in row:
                tokens[i, t:t + c] = torch.tensor(item.ids[item.done:item.done + c])
                self.cache.grow(item.slot, item.done + c)
                place.append((item, c, i, t))
                t += c
        if len(trees) == len(chosen):  # no prompt follows another: a row each
            view = self.cache.at([item.slot for item, _ in chosen])
        else:
            view = self.cache.packed([[(item.slot, item.done, c) for item, c in row] for row in trees])
        hidden = _hidden(self.model, tokens.to(self.device), view)
        view.advance(torch.tensor([c for _, c in chosen], device=self.device))
        rows, cols, owners = [], [], []
        for item, c, i, t in place:
            for j in item.needed(c):
                rows.append(i)
                cols.append(t + j)
                owners.append((item, item.done + j))
        if rows:
            logits = _head(self.model, hidden[torch.tensor(rows, device=hidden.device),
                                              torch.tensor(cols, device=hidden.device)])
            logp = torch.log_softmax(logits.float(), dim=-1)
            Prefill.record(owners, logp, self.top_k)
        self.cache.copy([item.take_shared() for item, _ in chosen if item.leader is not None])
        complete = []
        for item, c in chosen:
            item.done += c
            if item.resume is None:
                self.prefill.computed_tokens += c
            else:
                self.prefill.recomputed_tokens += c
            if item.done == len(item.ids):
                complete.append(item)
        return complete

    def _complete(self, item: Prefill) -> list[Sequence]:
        """A prompt fully computed: into the prefix cache, then its slot joins the running rows."""
        self.queue.remove(item)
        if self.prefix is not None and item.resume is None:
            splits = tuple(item.shares(p) for p in self.queue)  # (where the prompts still to come part from it)
            item.store(self.prefix, self.cache, splits)
        if item.resume is None:
            item.finish_prompt()
        target = len(self.rows)
        other = next((p for p in self.queue if p.slot == target), None)
        if other is not None:
            self.cache.swap(item.slot, target)
            other.slot = item.slot
        elif item.slot != target:
            self.cache.move(item.slot, target)
            self.cache.reset(item.slot)
        if item.resume is None:
            self._joined += 1
        self.rows.append(item.resume or _Row(item.seq, self.eos_id, self.decode, self._joined))
        self.pending.append(item.next_logp)
        if item.resume is None and item.seq.params.max_tokens <= 0:
            item.seq.finish_reason = "length"
            self._release([len(self.rows) - 1])
            return [item.seq]
        return []

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One token for every running sequence; returns the sequences that finished."""
        finished = [i for i, r in enumerate(self.rows) if r.push(self.pending[i])]
        done = [self.rows[i].seq for i in finished]
        self._release(finished)
        self._grow_rows()
        if self.rows:
            view = self.cache.rows(0, len(self.rows))
            next_ids = torch.tensor([[r.seq.tokens[-1].id] for r in self.rows], device=self.device)
            logp = torch.log_softmax(self.model(next_ids, view)[:, -1].float(), dim=-1).cpu()
            view.advance(1)
            self.pending = list(logp)
            self._note_kv()
        return done

    def _grow_rows(self) -> None:
        """A block for every row whose next position starts one; the rows that joined last are
        preempted while the free blocks (not promised to a prefill) do not suffice."""
        cache = self.cache
        while self.rows:
            lengths = cache.lengths[:len(self.rows)].tolist()
            need = [i for i, n in enumerate(lengths) if n >= cache.held[i] * cache.block]
            if len(need) <= self._available():
                for i in need:
                    cache.grow(i, lengths[i] + 1)
                return
            last = len(self.rows) - 1  # its slot, once it leaves the rows, is the queue's
            newest = max(range(len(self.rows)), key=lambda i: self.rows[i].order)
            if newest != last:  # the newest request gives way (vLLM's order): moved into the last slot
                cache.swap(newest, last)
                for rows in (self.rows, self.pending):
                    rows[newest], rows[last] = rows[last], rows[newest]
            row = self.rows.pop()
            self.pending.pop()
            cache.reset(last)
            self.queue.insert(0, Prefill(row.seq, last, resume=row))
            self.preempted += 1

    def _note_kv(self) -> None:
        held = sum(len(r.seq.prompt_ids) + len(r.seq.tokens) for r in self.rows) + sum(p.done for p in self.queue)
        self.kv_peak_tokens = max(self.kv_peak_tokens, held)
        self.kv_peak_blocks = max(self.kv_peak_blocks, self.cache.n_blocks - self.cache.free_blocks)

    def abort(self, seqs: list[Sequence]) -> list[Sequence]:
        """Let `seqs` go wherever they are (queued for prefill or running); returns those that were
        here, their finish_reason "abort" unless they had one."""
        ids = {id(s) for s in seqs}
        gone = [p.seq for p in self.queue if id(p.seq) in ids]
        for p in self.queue:
            if id(p.seq) in ids:
                self.cache.reset(p.slot)
        self.queue = [p for p in self.queue if id(p.seq) not in ids]
        rows = [i for i, r in enumerate(self.rows) if id(r.seq) in ids]
        gone += [self.rows[i].seq for i in rows]
        self._release(rows)
        for s in gone:
            s.finish_reason = s.finish_reason or "abort"
        return gone

    def drop_queue(self) -> list[Sequence]:
        """Drop the prompts queued for prefill (after a failed forward); returns their sequences."""
        gone = [p.seq for p in self.queue]
        for p in self.queue:
            self.cache.reset(p.slot)
        self.queue.clear()
        return gone

    def clear(self) -> None:
        """Drop every sequence (after a failed forward); the prefix cache keeps what it holds."""
        self.rows.clear()
        self.pending.clear()
        self.queue.clear()
        self.cache.clear()

    def _release(self, rows: list[int]) -> None:
        """Free the slots of `rows`: the last running row (its KV and pending token) moves into each
        freed slot, highest first, and the slot it leaves is reset, so the running rows stay 0..n-1."""
        for i in sorted(rows, reverse=True):
            last = len(self.rows) - 1
            self.cache.move(last, i)
            self.rows[i], self.pending[i] = self.rows[last], self.pending[last]
            self.rows.pop()
            self.pending.pop()
            self.cache.reset(last)


def _trees(chosen: list[tuple[Prefill, int]]) -> list[list[tuple[Prefill, int]]]:
    """The rows of a forward: each prompt that follows no other, then those that follow it."""
    rows: dict[int, list[tuple[Prefill, int]]] = {}
    for item, c in chosen:
        rows.setdefault(id(item if item.leader is None else item.leader), []).append((item, c))
    return list(rows.values())


def _hidden(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """The final normed hidden states (batch, seq, dim) of a forward, without the output head."""
    if not hasattr(model, "head"):
        return model(tokens, cache)
    model.hidden_out = True
    try:
        return model(tokens, cache)
    finally:
        model.hidden_out = False


def _head(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.head(hidden) if hasattr(model, "head") else hidden


def run_batch(model, seqs: list[Sequence], eos_id: int, decode: Callable[[list[int]], str]) -> list[Sequence]:
    """Generate for every sequence at once; returns them filled in (tokens, text, finish_reason)."""
    capacity = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs)
    engine = Engine(model, eos_id, decode, slots=len(seqs), capacity=capacity)
    engine.admit(seqs)
    while engine.rows:
        engine.step()
    return seqs
