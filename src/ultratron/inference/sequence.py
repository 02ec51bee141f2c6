"""A sequence being generated and its sampling: the request's settings (`SamplingParams`), the
tokens it has (`Sequence`, `TokenInfo`) and the per-row sampler the engine drives (`_Row`: penalties,
logit bias, constraints, top-k/top-p, stop strings, streaming)."""

from __future__ import annotations

import functools
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ultratron.inference.stops import first_stop
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


class PromptTokens(abc.Sequence):
    """A prompt's tokens with their log-probabilities and top alternatives (echo), kept as the prefill
    left them, a tensor each, and made `TokenInfo`s only when first read: the engine's thread hands
    them over without building an object per token (~2.5 µs each, 21 ms of the critical path of a
    64-prompt echo scoring run); the thread that answers the request builds them, beside the next
    forward. `logprobs` (n,) with the first position's unused; `top_ids`/`top_values` (n, k) or None."""

    def __init__(self, ids: list[int], logprobs: torch.Tensor, top_ids: torch.Tensor | None = None,
                 top_values: torch.Tensor | None = None):
        self.ids, self._columns = ids, (logprobs, top_ids, top_values)

    def columns(self) -> tuple[list[int], list[float | None], list[list[tuple[int, float]] | None]]:
        """(ids, log-probabilities, top alternatives) as lists, without a `TokenInfo` per token (what a
        response's JSON is made of)."""
        logprobs, top_ids, top_values = self._columns
        lps = [None] + logprobs[1:].tolist()
        if top_ids is None:
            return self.ids, lps, [None] * len(self.ids)
        return self.ids, lps, [None] + [list(zip(i, v, strict=True)) for i, v in
                                        zip(top_ids[1:].tolist(), top_values[1:].tolist(), strict=True)]

    @functools.cached_property
    def _infos(self) -> list[TokenInfo]:
        return [TokenInfo(*column) for column in zip(*self.columns(), strict=True)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        return self._infos[index]

    def __iter__(self):
        return iter(self._infos)

    def __add__(self, other) -> list[TokenInfo]:
        return self._infos + list(other)

    def __radd__(self, other) -> list[TokenInfo]:
        return list(other) + self._infos


@dataclass
class Sequence:
    """One prompt's generation: filled in by `run_batch`."""

    prompt_ids: list[int]
    params: SamplingParams
    on_text: Callable[[Sequence, str], None] | None = None  # streaming: called with each new piece of text
    prompt_tokens: list[TokenInfo] | PromptTokens = field(default_factory=list)  # echo
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
    def __init__(self, seq: Sequence, eos_id: int, decode: Callable[[list[int]], str], order: int = 0):
        self.seq, self.eos_id, self.decode = seq, eos_id, decode
        self.order = order  # when it joined the running rows (the engine's count): the newest is preempted first
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
            cut = first_stop(text, params.stop)
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
