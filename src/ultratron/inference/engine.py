"""Batched generation with a KV cache: prefill every prompt at once, then one token per step.

Used by the HTTP server (many requests share one batch) and by the local evaluation backend.
Each row keeps its own sampling settings (temperature, top-p, seed), stop strings and logprob
requests; finished rows leave the batch so the rest run on a smaller one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ultratron.inference.kv_cache import KVCache


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
        token = _sample(logp.cpu(), params, self.generator)
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


@torch.no_grad()
def run_batch(model, seqs: list[Sequence], eos_id: int, decode: Callable[[list[int]], str]) -> list[Sequence]:
    """Generate for every sequence at once; returns them filled in (tokens, text, finish_reason)."""
    device = next(model.parameters()).device
    lengths = [len(s.prompt_ids) for s in seqs]
    if min(lengths) == 0:
        raise ValueError("every prompt needs at least one token")
    capacity = max(n + s.params.max_tokens for n, s in zip(lengths, seqs, strict=True))
    cache = KVCache(model, len(seqs), min(capacity, model.args.max_seq_len))
    tokens = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : lengths[i]] = torch.tensor(s.prompt_ids)
    logp = torch.log_softmax(model(tokens.to(device), cache).float(), dim=-1).cpu()
    cache.advance(torch.tensor(lengths, device=device))
    for i, s in enumerate(seqs):
        if s.params.echo:
            s.prompt_tokens = [TokenInfo(s.prompt_ids[0], None, None)] + [
                TokenInfo(tok, float(logp[i, t - 1, tok]), _top(logp[i, t - 1], s.params.logprobs))
                for t, tok in enumerate(s.prompt_ids) if t > 0]
    last = logp[torch.arange(len(seqs)), torch.tensor(lengths) - 1]
    rows = [_Row(s, eos_id, decode) for s in seqs]
    for r in rows:
        if r.seq.params.max_tokens <= 0:
            r.seq.finish_reason = "length"
    live = [i for i, r in enumerate(rows) if r.seq.finish_reason is None]
    if len(live) < len(rows):
        cache.keep(live)
        last = last[live]
        rows = [rows[i] for i in live]
    while rows:
        done = [r.push(last[j]) for j, r in enumerate(rows)]
        keep = [j for j, d in enumerate(done) if not d]
        if not keep:
            break
        if len(keep) < len(rows):
            cache.keep(keep)
            rows = [rows[j] for j in keep]
        next_ids = torch.tensor([[r.seq.tokens[-1].id] for r in rows], device=device)
        last = torch.log_softmax(model(next_ids, cache)[:, -1].float(), dim=-1).cpu()
        cache.advance(1)
    return seqs
