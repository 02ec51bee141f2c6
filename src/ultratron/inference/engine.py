"""Batched generation with a KV cache of per-sequence slots: prompts are prefilled (reusing what
the prefix cache holds, a token budget at a time), then every running sequence gets one token per
step, and sequences join and leave between steps.

Used by the HTTP server (continuous batching: `Engine` under serving's Batcher) and by the local
evaluation backend (`run_batch`). Each row keeps its own sampling settings (temperature, top-p,
seed), stop strings and logprob requests; finished rows leave at once, so the rest run on a
smaller batch or make room for a waiting sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ultratron.inference.kv_cache import SlotCache
from ultratron.inference.prefill import Prefill, PrefillStats
from ultratron.inference.prefix_cache import PrefixCache
from ultratron.models.registry import model_args
from ultratron.models.sampling import keep_top_k


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # how many top alternatives to report per token; None: no logprobs
    echo: bool = False  # also report the prompt's tokens (with logprobs if asked)
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling (OpenAI's logit_bias)
    frequency_penalty: float = 0.0  # less per earlier occurrence of the token in the completion
    presence_penalty: float = 0.0  # less once the token has occurred in the completion
    top_k: int = 0  # sample among the k most likely tokens only; 0 or -1: all
    # constrained decoding: (generated ids, scores) -> scores with the tokens not allowed next at -inf
    constrain: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None


@dataclass
class TokenInfo:
    id: int
    logprob: float | None  # None for the first prompt token, which has no context
    top: list[tuple[int, float]] | None = None


@dataclass
class Sequence:
    """One prompt's generation: filled in by `run_batch`."""

    prompt_ids: list[int]
    params: SamplingParams
    on_text: Callable[[Sequence, str], None] | None = None  # streaming: called with each new piece of text
    prompt_tokens: list[TokenInfo] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    _emitted: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]


def _top(logp: torch.Tensor, k: int | None) -> list[tuple[int, float]] | None:
    if not k:
        return None
    values, ids = logp.topk(min(k, logp.shape[-1]))
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def _adjusted(logp: torch.Tensor, params: SamplingParams, generated: list[int]) -> torch.Tensor:
    """The scores sampling draws from: OpenAI's definition, logit[j] − c[j]·frequency_penalty −
    [c[j] > 0]·presence_penalty + logit_bias[j], c[j] the count of token j in the completion so far.
    (A constant shift of every logit leaves the softmax alone, so log-probabilities serve as logits.)"""
    if not (params.logit_bias or params.frequency_penalty or params.presence_penalty):
        return logp
    scores = logp.clone()
    if generated and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(generated), minlength=scores.shape[-1]).to(scores.dtype)
        scores -= counts * params.frequency_penalty + (counts > 0).to(scores.dtype) * params.presence_penalty
    for token, bias in (params.logit_bias or {}).items():
        scores[token] += bias
    return scores


def _sample(logp: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.temperature <= 0:
        return int(logp.argmax())
    probs = torch.softmax(keep_top_k(logp / params.temperature, params.top_k), dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # keeps at least the top token
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters might still become a stop string (or are half a character)."""
    hold = 1 if text.endswith("\ufffd") else 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


class _Row:
    def __init__(self, seq: Sequence, eos_id: int, decode: Callable[[list[int]], str]):
        self.seq, self.eos_id, self.decode = seq, eos_id, decode
        seed = seq.params.seed
        self.generator = None
        if seq.params.temperature > 0:
            self.generator = torch.Generator().manual_seed(seed if seed is not None else
                                                           int(torch.randint(0, 2**62, (1,))))

    def push(self, logp: torch.Tensor) -> bool:
        """Sample the next token from log-probabilities `logp` (vocab,); True when the row is done."""
        seq, params = self.seq, self.seq.params
        scores = _adjusted(logp.cpu(), params, seq.token_ids)
        if params.constrain is not None:
            scores = params.constrain(seq.token_ids, scores)
        token = _sample(scores, params, self.generator)
        if token == self.eos_id and not params.ignore_eos:
            seq.finish_reason = "stop"
        else:
            seq.tokens.append(TokenInfo(token, float(logp[token]), _top(logp, params.logprobs)))
            text = self.decode(seq.token_ids)
            cut = min((i for i in (text.find(s) for s in params.stop if s) if i >= 0), default=-1)
            if cut >= 0:
                seq.text, seq.finish_reason = text[:cut], "stop"
            else:
                seq.text = text
                if len(seq.tokens) >= params.max_tokens:
                    seq.finish_reason = "length"
        done = seq.finish_reason is not None
        self._emit(done)
        return done

    def _emit(self, done: bool) -> None:
        seq = self.seq
        if seq.on_text is None:
            return
        upto = len(seq.text) if done else len(seq.text) - _held_back(seq.text, seq.params.stop)
        if upto > seq._emitted:
            piece, seq._emitted = seq.text[seq._emitted:upto], upto
            seq.on_text(seq, piece)


class Engine:
    """Continuous batching: sequences join and leave the running batch at token boundaries.

    Each admitted sequence owns a slot of the KV cache. `admit` queues new sequences for prefill
    and runs prefill forwards of at most `max_batched_tokens` tokens (less the running rows' one
    each): a prompt longer than that is prefilled in chunks over several calls, the running rows
    stepping in between. With a prefix cache (`prefix_cache_tokens` > 0) a prompt's longest cached
    prefix is copied into its slot and only the rest computed; a prompt that shares an uncached
    prefix with one being prefilled waits for it and then reuses it. `step` samples every running
    sequence's next token, lets the finished ones go (their slots are reused at once) and forwards
    the rest by one token. A scheduler around it (serving's Batcher) decides who is admitted when;
    `run_batch` admits everything and steps until done.

    Counters for monitoring (`stats()`, also plain attributes): `prefill.prompt_tokens` (prompt
    tokens of the sequences admitted), `prefill.computed_tokens` (those the model computed; the
    rest came from the prefix cache), `prefill.cached_tokens`; the prefix cache's `bytes`,
    `budget_bytes`, `lookups`, `hit_lookups`; the KV slots' `kv_tokens` (positions held now) and
    `kv_peak_tokens` (the most held after any forward) against `kv_capacity` (slots × positions).
    """

    def __init__(self, model, eos_id: int, decode: Callable[[list[int]], str], slots: int, capacity: int, *,
                 prefix_cache_tokens: int = 0, cache_top_k: int = 20, max_batched_tokens: int | None = None,
                 block: int = 16):
        self.model, self.eos_id, self.decode = model, eos_id, decode
        self.device = next(model.parameters()).device
        self.cache = SlotCache(model, slots, min(capacity, model_args(model).max_seq_len))
        self.top_k = min(cache_top_k, model_args(model).vocab_size)  # alternatives kept per prompt position
        self.prefix = PrefixCache(model, prefix_cache_tokens, self.top_k, block) if prefix_cache_tokens > 0 else None
        self.max_batched_tokens = max_batched_tokens or slots * self.cache.capacity
        self.rows: list[_Row] = []  # row i occupies slot i
        self.pending: list[torch.Tensor] = []  # row i's log-probabilities for its next token
        self.queue: list[Prefill] = []  # admitted, prompt not computed yet; each holds a slot past the rows
        self.prefill = PrefillStats()
        self.kv_peak_tokens = 0

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
        return self.cache.slots * self.cache.capacity

    def stats(self) -> dict:
        """Counters for /metrics: prompt tokens admitted and computed, prefix-cache use, KV use."""
        out = {**vars(self.prefill), "kv_tokens": self.kv_tokens, "kv_peak_tokens": self.kv_peak_tokens,
               "kv_capacity": self.kv_capacity,
               "running": len(self.rows), "prefilling": len(self.queue)}
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix.stats()
        return out

    @torch.no_grad()
    def admit(self, seqs: list[Sequence]) -> list[Sequence]:
        """Queue `seqs` for prefill, each in a free slot, and prefill within the token budget;
        returns the sequences finished already (max_tokens 0)."""
        if len(seqs) > self.free:
            raise ValueError(f"{len(seqs)} sequences do not fit the {self.free} free slots")
        if any(not s.prompt_ids for s in seqs):
            raise ValueError("every prompt needs at least one token")
        longest = max((len(s.prompt_ids) for s in seqs), default=0)
        if longest > self.cache.capacity:
            raise ValueError(f"a prompt of {longest} tokens exceeds the cache capacity {self.cache.capacity}")
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
            budget -= max(c for _, c in chosen) * len(chosen)
            complete = self._forward(chosen)
            self._note_kv()
            for item in complete:
                done += self._complete(item)
        return done

    def _choose(self, budget: int) -> list[tuple[Prefill, int]]:
        """The queued prompts to forward now and how many tokens of each (FIFO; padded to the widest,
        within the budget). With a prefix cache, a prompt waits for one being prefilled that shares
        with it a block or more beyond its cached prefix, or half of what it would compute: it
        reuses that part after the other's forward (in this iteration while the budget lasts)."""
        chosen: list[tuple[Prefill, int]] = []
        width = 0
        started = [p for p in self.queue if p.started]
        for item in self.queue:
            if not item.started:
                cached = item.lookup(self.prefix)
                if self.prefix is not None and any(self._worth_waiting(item, p.shares(item) - cached, cached)
                                                   for p in started):
                    continue
            c = min(item.remaining - (0 if item.started else item.reuse), budget)
            if (len(chosen) + 1) * max(width, c) > budget:
                if not chosen or (len(chosen) + 1) * width > budget:
                    break
                c = width  # a chunk of it, as wide as the others
            if not item.started:
                item.start(self.cache, self.prefix, self.top_k, self.prefill)
                started.append(item)
            chosen.append((item, c))
            width = max(width, c)
        return chosen

    def _worth_waiting(self, item: Prefill, gain: int, cached: int) -> bool:
        return gain > 1 and (gain >= self.prefix.block or 2 * gain >= len(item.seq.prompt_ids) - cached)

    def _forward(self, chosen: list[tuple[Prefill, int]]) -> list[Prefill]:
        """One forward of the chosen chunks; log-softmax only where a log-probability is needed.
        Returns the prompts now complete."""
        width = max(c for _, c in chosen)
        tokens = torch.zeros(len(chosen), width, dtype=torch.long)
        for i, (item, c) in enumerate(chosen):
            tokens[i, :c] = torch.tensor(item.seq.prompt_ids[item.done:item.done + c])
        view = self.cache.at([item.slot for item, _ in chosen])
        hidden = _hidden(self.model, tokens.to(self.device), view)
        view.advance(torch.tensor([c for _, c in chosen], device=self.device))
        rows, cols, owners = [], [], []
        for i, (item, c) in enumerate(chosen):
            for j in item.needed(c):
                rows.append(i)
                cols.append(j)
                owners.append((item, item.done + j))
        if rows:
            logits = _head(self.model, hidden[torch.tensor(rows, device=hidden.device),
                                              torch.tensor(cols, device=hidden.device)])
            logp = torch.log_softmax(logits.float(), dim=-1)
            Prefill.record(owners, logp, self.top_k)
        complete = []
        for item, c in chosen:
            item.done += c
            self.prefill.computed_tokens += c
            if item.done == len(item.seq.prompt_ids):
                complete.append(item)
        return complete

    def _complete(self, item: Prefill) -> list[Sequence]:
        """A prompt fully computed: into the prefix cache, then its slot joins the running rows."""
        self.queue.remove(item)
        if self.prefix is not None:
            splits = tuple(item.shares(p) for p in self.queue if not p.started)
            item.store(self.prefix, self.cache, splits)
        item.finish_prompt(TokenInfo)
        target = len(self.rows)
        other = next((p for p in self.queue if p.slot == target), None)
        if other is not None:
            self.cache.swap(item.slot, target)
            other.slot = item.slot
        elif item.slot != target:
            self.cache.move(item.slot, target)
            self.cache.reset(item.slot)
        self.rows.append(_Row(item.seq, self.eos_id, self.decode))
        self.pending.append(item.next_logp)
        if item.seq.params.max_tokens <= 0:
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
        if self.rows:
            view = self.cache.rows(0, len(self.rows))
            next_ids = torch.tensor([[r.seq.tokens[-1].id] for r in self.rows], device=self.device)
            logp = torch.log_softmax(self.model(next_ids, view)[:, -1].float(), dim=-1).cpu()
            view.advance(1)
            self.pending = list(logp)
            self._note_kv()
        return done

    def _note_kv(self) -> None:
        held = sum(len(r.seq.prompt_ids) + len(r.seq.tokens) for r in self.rows) + sum(p.done for p in self.queue)
        self.kv_peak_tokens = max(self.kv_peak_tokens, held)

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
        self.cache.lengths.zero_()

    def _release(self, rows: list[int]) -> None:
        """Free the slots of `rows`: the last running row moves into each freed slot, and a prompt
        being prefilled in the slot past the new last row moves down (the slots past the rows
        are the prefill queue's, anywhere)."""
        for i in sorted(rows, reverse=True):
            last = len(self.rows) - 1
            self.cache.move(last, i)
            self.rows[i], self.pending[i] = self.rows[last], self.pending[last]
            self.rows.pop()
            self.pending.pop()
            self.cache.reset(last)


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
