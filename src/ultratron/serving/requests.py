"""The JSON bodies the server accepts, validated before any work starts (a bad one is a 400)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# torch.Generator takes seeds in [-2**63, 2**64); n > 1 adds up to max_n - 1 to the request's seed.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _valid_text(value):
    """Text must be encodable Unicode: JSON's "\\ud800" escape yields a lone surrogate, which no
    tokenizer can encode (it would fail deep inside generation, as a server error)."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(text, dict):  # a chat content part, {"type": "text", "text": ...}
            text = text.get("text")
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"contains a lone surrogate ({text[err.start]!r} at character {err.start}), "
                                 "which is not valid Unicode text") from None
    return value


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields (user, penalties...) are accepted


class CompletionRequest(_Open):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past the end-of-text token
    text_is_unicode = field_validator("prompt", "stop")(_valid_text)


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict]  # a string, or parts [{"type": "text", "text": ...}] (others: 400, in the server)
    text_is_unicode = field_validator("content")(_valid_text)


class ChatRequest(_Open):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past the end-of-text token
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    text_is_unicode = field_validator("stop")(_valid_text)


class TokenizeRequest(_Open):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    text_is_unicode = field_validator("prompt")(_valid_text)


class DetokenizeRequest(_Open):
    model: str | None = None
    tokens: list[int]
