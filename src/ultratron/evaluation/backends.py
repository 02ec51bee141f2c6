"""Where log-likelihoods and generations come from: a local checkpoint, or any OpenAI-compatible
endpoint (vLLM, ultratron serve, a hosted reference model) through `api_client` (the OpenAI API's
calls, retried as the OpenAI clients retry them).

Both backends split a (context, continuation) pair the same way: the whole string is tokenized
and the continuation's tokens are those that hold any of its characters (by character offsets),
so both agree exactly on our own server and stay meaningful for any other tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ultratron.errors import EndpointError
from ultratron.inference.stops import first_stop

TOKENS_WITHOUT_BYTES = 16  # a text of n bytes has at most n + this many tokens, under any tokenizer we know

# torch, the checkpoint loader and the engine are imported where the local backend uses them: an
# evaluation against an endpoint needs none of them (they are most of the command's start-up time)


def token_windows(ids: list[int], size: int) -> list[list[int]]:
    """Windows of `size` tokens overlapping by one, so every token but the first is scored once.
    (`size` is the context less one, leaving room for the token an endpoint must generate.)"""
    return [ids[start: start + size] for start in range(0, max(1, len(ids) - 1), size - 1)]


def fit_context(context: str, continuation: str, count_tokens, limit: int) -> str:
    """Drop the context's oldest characters (a line at a time, then a character at a time) until
    context + continuation takes at most `limit` tokens; both backends cut the same way."""
    while context and count_tokens(context + continuation) > limit:
        cut = context.find("\n")
        context = context[cut + 1:] if 0 <= cut < len(context) - 1 else context[1:]
    return context


def continuation_positions(offsets: list[int], text_len: int, context_len: int) -> list[int]:
    """Indices of tokens (given their start offsets) that contain any character past `context_len`."""
    ends = offsets[1:] + [text_len]
    return [i for i, end in enumerate(ends) if end > context_len]


class LocalBackend:
    """A model in this process: batched scoring, KV-cached batched generation."""

    def __init__(self, model, tokenizer, batch_tokens: int = 8192):
        from ultratron.models.registry import model_args

        self.model, self.tokenizer, self.batch_tokens = model, tokenizer, batch_tokens
        self.context = model_args(model).max_seq_len
        self.device = next(model.parameters()).device

    @classmethod
    def from_checkpoint(cls, checkpoint, device: str = "cpu", endpoint: str | None = None) -> LocalBackend:
        from ultratron.checkpoint.inference import load_for_inference

        loaded = load_for_inference(checkpoint, device, endpoint)
        backend = cls(loaded.model, loaded.tokenizer)
        backend.step, backend.config = loaded.step, loaded.config
        return backend

    def describe(self) -> str:
        return "local checkpoint"

    def _score(self, rows: list[list[int]]) -> list:
        """Per row: log-probabilities (len-1, vocab) of each next token, batched by length."""
        import torch

        out: list = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        start = 0
        while start < len(order):
            width = len(rows[order[start]])
            count = max(1, self.batch_tokens // max(width, 1))
            chunk = order[start: start + count]
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, i in enumerate(chunk):
                batch[j, : len(rows[i])] = torch.tensor(rows[i])
            with torch.no_grad():
                logp = torch.log_softmax(self.model(batch.to(self.device)).float(), dim=-1).cpu()
            for j, i in enumerate(chunk):
                out[i] = logp[j, : len(rows[i]) - 1]
            start += count
        return out

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        rows, targets = [], []
        count = lambda text: len(self.tokenizer.encode(text))
        for context, continuation in pairs:
            context = fit_context(context, continuation, count, self.context - 1)
            text = context + continuation
            enc = self.tokenizer.hf.encode(text, add_special_tokens=False)
            ids = enc.ids
            positions = [p for p in continuation_positions([s for s, _ in enc.offsets], len(text), len(context))
                         if p > 0]
            cut = max(0, len(ids) - self.context)  # keep the end: drop the oldest context
            rows.append(ids[cut:])
            targets.append([p - cut for p in positions if p - cut > 0])
        results = []
        for ids, logp, pos in zip(rows, self._score(rows), targets, strict=True):
            total = sum(float(logp[p - 1, ids[p]]) for p in pos)
            greedy = all(int(logp[p - 1].argmax()) == ids[p] for p in pos)
            results.append((total, greedy))
        return results

    def rolling_loglikelihood(self, texts: list[str]) -> list[tuple[float, int, int]]:
        """Per text: (sum of log-probabilities, tokens scored, bytes scored); every token but the first."""
        rows, owners = [], []
        meta = []
        for t, text in enumerate(texts):
            enc = self.tokenizer.hf.encode(text, add_special_tokens=False)
            ids = enc.ids
            first_end = enc.offsets[1][0] if len(ids) > 1 else len(text)
            meta.append((len(ids) - 1, len(text[first_end:].encode("utf-8"))))
            for window in token_windows(ids, self.context - 1):
                rows.append(window)
                owners.append(t)
        import torch

        sums = [0.0] * len(texts)
        for ids, logp, t in zip(rows, self._score(rows), owners, strict=True):
            sums[t] += float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        return [(s, n, b) for s, (n, b) in zip(sums, meta, strict=True)]

    def generate(self, requests: list[tuple[str, tuple[str, ...], int]]) -> list[str]:
        from ultratron.inference.engine import SamplingParams, Sequence, run_batch

        seqs = []
        for prompt, stop, max_tokens in requests:
            ids = self.tokenizer.encode(prompt)[-(self.context - max_tokens):]
            seqs.append(Sequence(ids, SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop)))
        for start in range(0, len(seqs), 32):
            run_batch(self.model, seqs[start: start + 32], self.tokenizer.eos_id, self.tokenizer.decode)
        return [s.text for s in seqs]


@dataclass
class UsageCounter:
    """Requests, tokens and cost of the calls made to an endpoint (thread-safe)."""

    price_per_request: float = 0.0
    price_per_1k_prompt_tokens: float = 0.0
    price_per_1k_completion_tokens: float = 0.0
    requests: int = 0
    failed_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, usage) -> None:
        with self._lock:
            self.requests += 1
            if usage:
                self.prompt_tokens += usage.get("prompt_tokens") or 0
                self.completion_tokens += usage.get("completion_tokens") or 0

    @property
    def cost(self) -> float:
        return (self.requests * self.price_per_request + self.prompt_tokens / 1000 * self.price_per_1k_prompt_tokens
                + self.completion_tokens / 1000 * self.price_per_1k_completion_tokens)

    def summary(self) -> dict:
        return {"requests": self.requests, "failed_requests": self.failed_requests,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cost": round(self.cost, 6)}


class EndpointBackend:
    """Any OpenAI-compatible API. Log-likelihood: completions with echo + logprobs (the legacy
    scoring call lm-eval uses); generation: chat completions (or completions), greedy."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, *,
                 concurrency: int = 4, timeout: float = 60.0, max_retries: int = 3, prompts_per_request: int = 8,
                 generation_api: str = "chat", usage: UsageCounter | None = None):
        from ultratron.evaluation.api_client import Client

        base = base_url.rstrip("/")
        self.client = Client(base if base.endswith("/v1") else base + "/v1", api_key or "EMPTY", timeout, max_retries)
        self.max_retries = max_retries
        self.base_url = base
        self.model = model or self._failing_clearly(lambda: self.client.get("models")["data"][0]["id"])
        self.concurrency, self.prompts_per_request = concurrency, prompts_per_request
        self.generation_api = generation_api
        self.usage = usage or UsageCounter()

    @classmethod
    def from_config(cls, e) -> EndpointBackend:
        """From endpoint settings (`ultratron.config.EndpointConfig`); the key is read from its variable."""
        usage = UsageCounter(e.price_per_request, e.price_per_1k_prompt_tokens, e.price_per_1k_completion_tokens)
        return cls(e.endpoint, e.endpoint_model, os.environ.get(e.api_key_env), concurrency=e.concurrency,
                   timeout=e.timeout, max_retries=e.max_retries, generation_api=e.generation_api, usage=usage)

    def describe(self) -> str:
        return f"endpoint {self.base_url} model {self.model}"

    def _map(self, fn, items: list) -> list:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(fn, items))

    def _failing_clearly(self, request):
        """Run a request; when the client has given up (after its retries), one line that says why."""
        from ultratron.evaluation.api_client import APIError

        try:
            return request()
        except APIError as err:
            raise EndpointError(f"endpoint {self.base_url}: {err.kind}: {str(err).splitlines()[0]} "
                                f"(after up to {self.max_retries} retries)") from None
        except (KeyError, IndexError, TypeError) as err:
            raise EndpointError(f"endpoint {self.base_url}: an answer without the OpenAI API's fields "
                                f"({type(err).__name__}: {err})") from None

    def _call(self, path: str, **body) -> dict:
        """POST `body` (with the model) to completions or chat/completions, counting its usage."""
        try:
            response = self._failing_clearly(lambda: self.client.post(path, {"model": self.model, **body}))
        except EndpointError:
            with self.usage._lock:
                self.usage.failed_requests += 1
            raise
        self.usage.add(response.get("usage"))
        return response

    def _echo(self, texts: list[str]) -> list:
        """Logprobs of every prompt token of each text (in groups of prompts per request)."""
        groups = [texts[i: i + self.prompts_per_request] for i in range(0, len(texts), self.prompts_per_request)]

        def score(group):
            response = self._call("completions", prompt=group, max_tokens=1, temperature=0, echo=True, logprobs=1)
            return sorted(response["choices"], key=lambda c: c["index"])

        return [choice["logprobs"] for chunk in self._map(score, groups) for choice in chunk]

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        probe = self._tokenize("x")
        if probe is not None:  # the server can count tokens: fit every pair into its context
            limit = probe[1] - 1

            def count(text: str) -> int:
                """The text's tokens, or a bound that shows it fits without asking: a token holds at
                least one byte, and `TOKENS_WITHOUT_BYTES` allows for markers (a SentencePiece
                word start) that hold none."""
                bound = len(text.encode("utf-8")) + TOKENS_WITHOUT_BYTES
                return bound if bound <= limit else len(self._tokenize(text)[0])

            # each pair's /tokenize calls, `concurrency` pairs at a time (one by one they were most of the time)
            pairs = self._map(lambda pair: (fit_context(pair[0], pair[1], count, limit), pair[1]), pairs)
        texts = [c + x for c, x in pairs]
        results = []
        for (context, _), text, lp in zip(pairs, texts, self._echo(texts), strict=True):
            n = sum(1 for off in lp["text_offset"] if off < len(text))  # the echoed prompt, not the new token
            offsets = list(lp["text_offset"][:n])
            positions = [p for p in continuation_positions(offsets, len(text), len(context)) if p > 0]
            total = sum(lp["token_logprobs"][p] for p in positions)
            top, tokens = lp["top_logprobs"], lp["tokens"]
            greedy = all(top[p] and max(top[p], key=top[p].get) == tokens[p] for p in positions)
            results.append((float(total), greedy))
        return results

    def _tokenize(self, text: str) -> tuple[list[int], int] | None:
        """Token ids and context length from the vLLM-style /tokenize extension, if the server has it."""
        import urllib.request

        root = self.base_url.removesuffix("/v1")
        req = urllib.request.Request(root + "/tokenize", data=json.dumps({"prompt": text, "add_special_tokens": False,
                                                                          "model": self.model}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.client.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                body = json.loads(resp.read())
            return body["tokens"], int(body["max_model_len"])
        except (OSError, ValueError, KeyError):
            return None

    def rolling_loglikelihood(self, texts: list[str]) -> list[tuple[float, int, int]]:
        tokenized = [self._tokenize(t) for t in texts]
        if all(t is not None for t in tokenized):
            return [self._rolling_tokens(text, ids, context) for text, (ids, context) in zip(texts, tokenized,
                                                                                            strict=True)]
        out = []
        for text, lp in zip(texts, self._echo(texts), strict=True):
            n = sum(1 for off in lp["text_offset"] if off < len(text))
            scored = [x for x in lp["token_logprobs"][1:n] if x is not None]
            first_end = lp["text_offset"][1] if n > 1 else len(text)
            out.append((float(sum(scored)), len(scored), len(text[first_end:].encode("utf-8"))))
        return out

    def _rolling_tokens(self, text: str, ids: list[int], context: int) -> tuple[float, int, int]:
        windows = token_windows(ids, context - 1)
        groups = [windows[i: i + self.prompts_per_request] for i in range(0, len(windows), self.prompts_per_request)]

        def score(group):
            response = self._call("completions", prompt=group, max_tokens=1, temperature=0, echo=True, logprobs=0)
            return [c["logprobs"] for c in sorted(response["choices"], key=lambda c: c["index"])]

        total, count, first = 0.0, 0, None
        for window, lp in zip(windows, [x for chunk in self._map(score, groups) for x in chunk], strict=True):
            first = lp["tokens"][0] if first is None else first
            values = lp["token_logprobs"][1: len(window)]
            total += float(sum(values))
            count += len(values)
        return total, count, len(text.encode("utf-8")) - len(first.encode("utf-8"))

    def generate(self, requests: list[tuple[str, tuple[str, ...], int]]) -> list[str]:
        """Greedy completions. OpenAI's API takes at most 4 stop strings: the first 4 go to the
        endpoint, and the text is cut at the first of all of them here (as the endpoint would have
        stopped there: the text before it is the same greedy text)."""
        def one(req):
            prompt, stops, max_tokens = req
            stop = list(stops)[:4] or None
            if self.generation_api == "chat":
                r = self._call("chat/completions", messages=[{"role": "user", "content": prompt}],
                               max_tokens=max_tokens, temperature=0, stop=stop)
                return cut_at_stop(r["choices"][0]["message"]["content"] or "", stops)
            r = self._call("completions", prompt=prompt, max_tokens=max_tokens, temperature=0, stop=stop)
            return cut_at_stop(r["choices"][0]["text"], stops)

        return self._map(one, requests)


def cut_at_stop(text: str, stops) -> str:
    """`text` up to the first occurrence of any of `stops` (which is left out, as OpenAI leaves it)."""
    cut = first_stop(text, stops)
    return text[:cut] if cut >= 0 else text


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    return nll_nats / math.log(2) / max(n_bytes, 1)
