"""`EndpointConfig` in a module of its own, so that the evaluation client imports these few fields
without the training config (its model presets and layout rules)."""

from __future__ import annotations

from dataclasses import dataclass

from ultratron.fields import option


@dataclass
class EndpointConfig:
    """How to reach an OpenAI-compatible API: shared by `ultratron eval` and periodic evaluation."""

    endpoint: str | None = option(None, "base URL of an OpenAI-compatible API (…/v1)")
    endpoint_model: str | None = option(None, "the endpoint's model id (default: the first /v1/models lists)",
                                        flags=("--model",))
    api_key_env: str = option("OPENAI_API_KEY", "environment variable holding the endpoint's key")
    concurrency: int = option(4, "requests in flight to the endpoint")
    timeout: float = option(60.0, "seconds per request")
    max_retries: int = option(3, "retries per request, with exponential backoff")
    generation_api: str = option("chat", "API used for generation tasks", choices=("chat", "completions"))
    price_per_request: float = option(0.0, "cost counter: price of one request")
    price_per_1k_prompt_tokens: float = option(0.0, "cost counter: price per 1,000 prompt tokens")
    price_per_1k_completion_tokens: float = option(0.0, "cost counter: price per 1,000 completion tokens")
