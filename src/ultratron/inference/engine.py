"""Batched generation with a KV cache of per-sequence slots: prompts are prefilled, then every
running sequence gets one token per step, and sequences join and leave between steps.

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
from ultratron.models.registry import model_args


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
    probs = torch.softmax(logp / params.temperature, dim=-1)
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
        token = _sample(_adjusted(logp.cpu(), params, seq.token_ids), params, self.generator)
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

    Each running sequence owns a slot of the KV cache. `admit` prefills new sequences into free
    slots (one forward over their prompts) while the others wait one step; `step` samples every
    running sequence's next token, lets the finished ones go (their slots are reused at once) and
    forwards the rest by one token. A scheduler around it (serving's Batcher) decides who is
    admitted when; `run_batch` admits everything and steps until done.
    """

    def __init__(self, model, eos_id: int, decode: Callable[[list[int]], str], slots: int, capacity: int):
        self.model, self.eos_id, self.decode = model, eos_id, decode
        self.device = next(model.parameters()).device
        self.cache = SlotCache(model, slots, min(capacity, model_args(model).max_seq_len))
        self.rows: list[_Row] = []  # row i occupies slot i
        self.pending: list[torch.Tensor] = []  # row i's log-probabilities for its next token

    @property
    def free(self) -> int:
        return self.cache.slots - len(self.rows)

    @torch.no_grad()
    def admit(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill `seqs` into free slots; returns those finished already (max_tokens 0)."""
        if len(seqs) > self.free:
            raise ValueError(f"{len(seqs)} sequences do not fit the {self.free} free slots")
        lengths = [len(s.prompt_ids) for s in seqs]
        if not seqs or min(lengths) == 0:
            if seqs:
                raise ValueError("every prompt needs at least one token")
            return []
        if max(lengths) > self.cache.capacity:
            raise ValueError(f"a prompt of {max(lengths)} tokens exceeds the cache capacity {self.cache.capacity}")
        lo = len(self.rows)
        for slot in range(lo, lo + len(seqs)):
            self.cache.reset(slot)
        view = self.cache.rows(lo, lo + len(seqs))
        tokens = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : lengths[i]] = torch.tensor(s.prompt_ids)
        logp = torch.log_softmax(self.model(tokens.to(self.device), view).float(), dim=-1).cpu()
        view.advance(torch.tensor(lengths, device=self.device))
        for i, s in enumerate(seqs):
            if s.params.echo:
                s.prompt_tokens = [TokenInfo(s.prompt_ids[0], None, None)] + [
                    TokenInfo(tok, float(logp[i, t - 1, tok]), _top(logp[i, t - 1], s.params.logprobs))
                    for t, tok in enumerate(s.prompt_ids) if t > 0]
            self.rows.append(_Row(s, self.eos_id, self.decode))
            self.pending.append(logp[i, lengths[i] - 1])
        done = [r.seq for r in self.rows[lo:] if r.seq.params.max_tokens <= 0]
        for s in done:
            s.finish_reason = "length"
        self._release([i for i in range(lo, len(self.rows)) if self.rows[i].seq.finish_reason is not None])
        return done

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
        return done

    def _release(self, rows: list[int]) -> None:
        """Free the slots of `rows`: the last running row moves into each freed slot."""
        for i in sorted(rows, reverse=True):
            last = len(self.rows) - 1
            self.cache.move(last, i)
            self.rows[i], self.pending[i] = self.rows[last], self.pending[last]
            self.rows.pop()
            self.pending.pop()


def run_batch(model, seqs: list[Sequence], eos_id: int, decode: Callable[[list[int]], str]) -> list[Sequence]:
    """Generate for every sequence at once; returns them filled in (tokens, text, finish_reason)."""
    capacity = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs)
    engine = Engine(model, eos_id, decode, slots=len(seqs), capacity=capacity)
    engine.admit(seqs)
    while engine.rows:
        engine.step()
    return seqs
