"""The bodies the server answers with: OpenAI's logprobs objects, usage, and server-sent event
streams, whose generation is cancelled when the client goes away mid-stream."""

from __future__ import annotations

import asyncio
import json

import orjson
from fastapi.responses import JSONResponse

from ultratron.inference.engine import Sequence, TokenInfo
from ultratron.inference.sequence import PromptTokens
from ultratron.serving.openai_fields import error_body


def completion_logprobs(token_text, prompt: list[TokenInfo] | PromptTokens, generated: list[TokenInfo],
                        offsets: list[int]) -> dict:
    """The legacy completions' logprobs of the echoed `prompt` (or none) and the `generated` tokens."""
    ids, lps, tops = (a + b for a, b in zip(_columns(prompt), _columns(generated), strict=True))
    return {
        "tokens": [token_text(i) for i in ids],
        "token_logprobs": lps,
        "top_logprobs": [None if top is None else {token_text(i): lp for i, lp in top} for top in tops],
        "text_offset": offsets,
    }


def _columns(infos: list[TokenInfo] | PromptTokens) -> tuple[list, list, list]:
    if isinstance(infos, PromptTokens):
        return infos.columns()
    return [t.id for t in infos], [t.logprob for t in infos], [t.top for t in infos]


def chat_logprobs(token_text, infos: list[TokenInfo]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in (t.top or [])]}
                        for t in infos]}


def usage(prompt_tokens: int, seqs: list[Sequence]) -> dict:
    completion_tokens = sum(len(s.tokens) for s in seqs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class BodyResponse(JSONResponse):
    """A completion's body through orjson: an echoed scoring answer is mostly floats, which the
    standard library's encoder wrote 18× slower (33 ms against 1.8 ms for 64 prompts of ~130 tokens,
    on both sides of `benchmarks/serve_eval.py`). A NaN or infinity would be written as null, where
    the standard encoder (allow_nan=False) failed the response."""

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def response(rid, obj, created, model, choices, prompts, seqs) -> dict:
    """A completion's or chat completion's body, of JSON's own types only: the server answers it with
    `BodyResponse` as it is, without FastAPI's `jsonable_encoder`, which walks every echoed token."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage(sum(len(ids) for ids, _ in prompts), seqs)}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def stream(server, seqs: list[Sequence], rid: str, created: int, model: str, obj: str,
           prompt_tokens: int | None = None):
    """Submit now (so a full queue is still a 429 response), then stream the events; with
    `prompt_tokens` (stream_options.include_usage) a last chunk carries the usage, as OpenAI's does."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    for s in seqs:
        s.on_text = lambda seq, piece: loop.call_soon_threadsafe(events.put_nowait, ("text", seq, piece))
    job = server.submit(seqs, lambda error: loop.call_soon_threadsafe(events.put_nowait, ("done", error, None)))
    return _events(server.batcher, job, seqs, events, (rid, created, model, obj), prompt_tokens)


async def _events(batcher, job, seqs, events: asyncio.Queue, head: tuple, prompt_tokens: int | None):
    rid, created, model, obj = head
    chat = obj == "chat.completion.chunk"
    index = {id(s): i for i, s in enumerate(seqs)}
    extra = {} if prompt_tokens is None else {"usage": None}

    def chunk(i: int, piece: str | None, finish: str | None, first: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": i, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], **extra}

    finished = False
    try:
        if chat:
            for i in range(len(seqs)):
                yield sse(chunk(i, None, None, first=True))
        while True:
            kind, a, b = await events.get()
            if kind == "text":
                yield sse(chunk(index[id(a)], b, None))
                continue
            finished = True
            if a is not None:
                yield sse(error_body(f"generation failed: {a}", "server_error"))
            else:
                for i, s in enumerate(seqs):
                    yield sse(chunk(i, None, s.finish_reason))
                if prompt_tokens is not None:
                    yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                               "usage": usage(prompt_tokens, seqs)})
            yield sse("[DONE]")
            return
    finally:  # the client left (the stream was cancelled or closed): stop generating for it
        if not finished:
            batcher.cancel(job)
