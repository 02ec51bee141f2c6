"""The JSON bodies the server accepts, validated before any work starts (a bad one is a 400)."""

from __future__ import annotations

import math
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
    # unknown fields are kept: the endpoints sort them into harmless ones and 400s (serving/openai_fields.py)
    model_config = ConfigDict(extra="allow")


def _whole_number(value):
    """OpenAI's integer fields: JSON numbers without a fraction. pydantic's lax mode would also take
    "3" and true; a client that sends those has a bug the server should name, not guess around."""
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            (isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise ValueError(f"must be an integer, not {value!r}")
    return int(value)


def _finite(value):
    """JSON has no NaN or Infinity, but Python's parser accepts both; neither means anything here."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, not {value!r}")
    return value


def _token_bias(value):
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}; ids are checked against the vocabulary by
    the server, which knows it."""
    if value is None:
        return value
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.strip().lstrip("-").isdigit()):
            raise ValueError(f"key {key!r} is not a token id")
        if isinstance(number, bool) or not isinstance(number, int | float) or not -100 <= number <= 100:
            raise ValueError(f"bias {number!r} of token {key} must be a number in [-100, 100]")
        bias[int(key)] = float(number)
    return bias


class _Sampling(_Open):
    """The sampling fields the completion and chat endpoints share, checked as OpenAI checks them."""

    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's: the k most likely tokens only; -1, 0 or absent: all
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    # OpenAI's penalties: a token's logit less frequency_penalty per earlier occurrence in the completion
    # and presence_penalty once it has occurred; logit_bias is added to the logits before sampling
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, object] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past the end-of-text token
    stream: bool = False
    stop: str | list[str] | None = None
    finite = field_validator("temperature", "top_p", "frequency_penalty", "presence_penalty",
                             mode="before")(_finite)
    integral = field_validator("n", "seed", "max_tokens", "top_k", mode="before", check_fields=False)(_whole_number)
    bias_by_token = field_validator("logit_bias")(_token_bias)


class CompletionRequest(_Sampling):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 stays valid here: with echo it scores a prompt without generating (lm-eval's log-likelihoods)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs_integral = field_validator("logprobs", mode="before")(_whole_number)
    text_is_unicode = field_validator("prompt", "stop")(_valid_text)


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict]  # a string, or parts [{"type": "text", "text": ...}] (others: 400, in the server)
    text_is_unicode = field_validator("content")(_valid_text)


class ChatRequest(_Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_integral = field_validator("max_completion_tokens", "top_logprobs", mode="before")(_whole_number)
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
