"""One prompt's prefill as the engine schedules it: what the prefix cache gives it, which positions
still need computing (in chunks), which of them need a log-softmax, and the prompt's
log-probabilities as they are filled in (from the cache, then from the forwards)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ultratron.inference.prefix_cache import PrefixCache, common_prefix
from ultratron.inference.sequence import PromptTokens


@dataclass
class PrefillStats:
    """Counters since the start (monitoring): prompts admitted and their tokens; of those tokens,
    how many the model computed and how many were copied from the prefix cache. (A prompt whose
    whole length is cached still computes its last position, for the next token's distribution.)"""

    prompts: int = 0
    prompts_hit: int = 0  # prompts that reused a cached prefix
    prompt_tokens: int = 0
    computed_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0  # positions computed again for sequences preempted (paged KV cache full)
    packed: int = 0  # prompts computed in the forward of another that shares their prefix, from where they fork


class Prefill:
    """A prompt to prefill; or, with `resume` (the sequence's row), a running sequence that was
    preempted: its prompt and the tokens it generated are computed again, without echo, and the
    row goes on sampling from the last position's distribution."""

    def __init__(self, seq, slot: int, resume=None):
        self.seq, self.slot, self.resume = seq, slot, resume
        self.ids: list[int] = seq.prompt_ids if resume is None else seq.prompt_ids + seq.token_ids
        self.echo = seq.params.echo and resume is None
        self.done = 0  # prompt positions in the slot (copied from the cache or computed)
        self.started = False
        self.chain: list = []  # the cached blocks found by the last lookup
        self._looked_up: int | None = None  # the prefix cache's version at that lookup
        self.reuse = 0  # positions to copy from them
        # echo: per prompt position, its token's log-probability (nan for the first) and the top
        # alternatives of the distribution it came from
        self.infos: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.next_logp: torch.Tensor | None = None  # the distribution of the first generated token
        # computed in the same forward as `leader`, from position `fork` on: the positions before it
        # are the leader's (the same tokens), copied into this slot after that forward (`take_shared`)
        self.leader: Prefill | None = None
        self.fork = 0

    @property
    def remaining(self) -> int:
        return len(self.ids) - self.done

    def lookup(self, prefix: PrefixCache | None) -> int:
        """The length of the prompt's cached prefix. All but its last position will be copied: that
        one is computed again, since the distribution it gives is needed and not kept. A prompt
        that waits is looked up again only once the cache has changed (`PrefixCache.version`)."""
        if prefix is not None and self._looked_up == prefix.version:
            return sum(len(b.tokens) for b in self.chain)
        self.chain = [] if prefix is None else prefix.match(self.ids, logprobs=self.echo)
        self._looked_up = None if prefix is None else prefix.version
        cached = sum(len(b.tokens) for b in self.chain)
        self.reuse = min(cached, len(self.ids)) - 1 if cached else 0
        return cached

    def shares(self, other: Prefill) -> int:
        return common_prefix(self.ids, other.ids)

    def start(self, cache, prefix: PrefixCache | None, top_k: int, stats: PrefillStats) -> None:
        """Copy the cached prefix found by `lookup` into the slot; from here on the prompt is computed."""
        n = len(self.ids)
        self.started = True
        if self.echo:
            self.infos = (torch.full((n,), math.nan), torch.zeros(n, top_k, dtype=torch.int32),
                          torch.zeros(n, top_k))
        if self.reuse and self.leader is None:
            cache.write(self.slot, 0, torch.cat([b.kv for b in self.chain], dim=2)[:, :, :self.reuse])
            cache.lengths[self.slot] = self.reuse
            if self.infos is not None:  # (a chain holds at most the prompt's tokens)
                fields = zip(*((b.logprob, b.top_ids, b.top_values) for b in self.chain), strict=True)
                for mine, theirs in zip(self.infos, fields, strict=True):
                    joined = torch.cat(theirs)
                    mine[:len(joined)] = joined
        self.done = self.reuse
        self.chain = []
        if self.resume is not None:
            return
        stats.prompts += 1
        stats.prompts_hit += bool(self.reuse)
        stats.prompt_tokens += n
        stats.cached_tokens += self.reuse

    def follow(self, leader: Prefill, fork: int, top_k: int, stats: PrefillStats) -> None:
        """Start as `leader`'s follower: computed in its forward from `fork` on (a packed tree,
        `PagedCache.packed`), nothing copied from the prefix cache."""
        self.leader, self.fork, self.reuse = leader, fork, fork
        self.start(None, None, top_k, stats)
        stats.packed += 1

    def take_shared(self) -> tuple[int, int, int, int]:
        """After the leader's forward: the log-probabilities of the tokens before the fork (echo; token
        t's comes from position t − 1, the leader's for t ≤ fork); returns the keys/values to copy
        into this slot, (leader's slot, this slot, 0, fork), which the engine copies with the other
        followers' in one `PagedCache.copy`."""
        if self.infos is not None:
            for mine, theirs in zip(self.infos, self.leader.infos, strict=True):
                mine[1:self.fork + 1] = theirs[1:self.fork + 1]
        leader, self.leader = self.leader, None
        return (leader.slot, self.slot, 0, self.fork)

    def needed(self, c: int) -> range:
        """Which of the next `c` positions need their distribution: with echo all (each gives the next
        prompt token's log-probability); else only the prompt's last (the first generated token)."""
        if self.echo:
            return range(c)
        return range(c - 1, c) if self.done + c == len(self.ids) else range(0)

    @staticmethod
    def record(owners: list[tuple[Prefill, int]], logp: torch.Tensor, top_k: int) -> None:
        """Distribute a forward's log-probabilities: row i of `logp` is the distribution after
        position p of owners[i] = (prefill, p)."""
        top = logp.topk(top_k) if any(item.infos is not None for item, _ in owners) else None
        targets = torch.tensor([item.ids[p + 1] if p + 1 < len(item.ids) else 0
                                for item, p in owners], device=logp.device)
        token_logp = logp.gather(1, targets[:, None])[:, 0].cpu()
        top_values, top_ids = (None, None) if top is None else (top.values.cpu(), top.indices.cpu())
        i = 0
        while i < len(owners):
            item, p = owners[i]
            j = i
            while j + 1 < len(owners) and owners[j + 1][0] is item:
                j += 1
            n = len(item.ids)
            last = owners[j][1]
            if last == n - 1:
                item.next_logp = logp[j].cpu()
            k = min(j + 1, i + (n - 1 - p))  # rows whose next position is a prompt token
            if item.infos is not None and k > i:
                lp, ids, values = item.infos
                lp[p + 1:p + 1 + k - i] = token_logp[i:k]
                ids[p + 1:p + 1 + k - i] = top_ids[i:k].to(torch.int32)
                values[p + 1:p + 1 + k - i] = top_values[i:k]
            i = j + 1

    def finish_prompt(self) -> None:
        """The prompt is computed: report its tokens' log-probabilities (echo; `PromptTokens`)."""
        if self.infos is None:
            return
        k = self.seq.params.logprobs
        lp, top_ids, top_values = self.infos
        tops = (top_ids[:, :k], top_values[:, :k]) if k else (None, None)
        self.seq.prompt_tokens = PromptTokens(self.seq.prompt_ids, lp, *tops)

    def store(self, prefix: PrefixCache, cache, splits: tuple[int, ...]) -> None:
        # the keys/values from the first new block to the prompt's end, gathered from the pool once
        # (new full blocks come in order; a tail stored at a split before them is read alone)
        tail: list = []

        def read(a: int, b: int) -> torch.Tensor:
            if not tail:
                tail.extend((a, cache.read(self.slot, a, len(self.seq.prompt_ids))))
            start, kv = tail
            if a < start:
                return cache.read(self.slot, a, b)
            return kv[:, :, a - start:b - start].clone()  # (its own storage: a block may outlive the rest)

        prefix.store(self.seq.prompt_ids, read, self.infos, splits)
