"""The OpenAI request fields the server does not implement, and what it does with each.

A request body may carry fields beyond the ones `serving/requests.py` types (pydantic keeps them
as extras). Each one is sorted here into one of three kinds, so that nothing that would change the
output is silently ignored:

- harmless: bookkeeping that changes no token (`user`, `metadata`, `store`, `service_tier`, ...);
- neutral at its default: a feature the server lacks, accepted only at the value that means "off"
  (`tools: []`, `response_format: {"type": "text"}`, vLLM's `repetition_penalty: 1`, ...), and JSON
  mode, which the server does;
- anything else, including a field no list names: a 400 whose `param` names the field.

`response_format` json_object and json_schema are honoured by constrained decoding
(`serving/json_mode.py`, `serving/json_schema.py`); a schema keyword the grammar does not
enforce is a 400 naming its path, rather than JSON that may not match the schema. `tools` are
refused (no tool-call parser).
"""

from __future__ import annotations

from ultratron.serving.json_mode import OBJECT, Grammar
from ultratron.serving.json_schema import SchemaError, schema_grammar


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"})

# field -> the values that leave the output as if the field were absent (None always does)
NEUTRAL: dict[str, tuple] = {
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "suffix": ("",), "best_of": (1,), "modalities": (["text"],),
    # vLLM's sampling extensions, at their defaults
    "min_tokens": (0,), "repetition_penalty": (1, 1.0), "min_p": (0, 0.0), "length_penalty": (1, 1.0),
    "use_beam_search": (False,), "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "prompt_logprobs": (0,),
}
CHAT_NEUTRAL: dict[str, tuple] = {"add_generation_prompt": (True,), "echo": (False,)}

WHY = {
    "response_format": "the types are text, json_object and json_schema",
    "tools": "tool calling is not supported by this server; send no tools",
    "functions": "function calling is not supported by this server; send no functions",
    "tool_choice": "tool calling is not supported by this server; tool_choice may only be \"none\" or \"auto\"",
    "function_call": "function calling is not supported by this server; function_call may only be \"none\" or "
                     "\"auto\"",
    "suffix": "insertion (suffix) is not supported by this server",
    "best_of": "best_of > 1 is not supported by this server; use n",
}


def check_extras(extras: dict, chat: bool) -> None:
    """A 400 naming the first extra field that would change the output if it were honoured."""
    neutral = NEUTRAL | CHAT_NEUTRAL if chat else NEUTRAL
    for name, value in extras.items():
        if name in HARMLESS or value is None or value in neutral.get(name, ()) or \
                (name == "response_format" and structured(value)):
            continue
        if name in WHY:
            raise APIError(400, f"{name}={_short(value)}: {WHY[name]}", param=name, code="unsupported_field")
        if name in neutral:
            raise APIError(400, f"{name}={_short(value)} is not supported by this server (only "
                                f"{' or '.join(_short(v) for v in neutral[name])}, which changes nothing)",
                           param=name, code="unsupported_field")
        raise APIError(400, f"unknown field {name!r}: this server does not implement it, and ignoring it could "
                            "change the output; remove it", param=name, code="unsupported_field")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def structured(value) -> bool:
    return isinstance(value, dict) and value.get("type") in ("json_object", "json_schema")


def output_grammar(req) -> Grammar | None:
    """The grammar `response_format` asks the output to follow (json_object, json_schema), or None."""
    value = (getattr(req, "model_extra", None) or {}).get("response_format")
    if not structured(value):
        return None
    if value["type"] == "json_object":
        return OBJECT
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(400, "response_format json_schema needs json_schema: {\"name\": ..., \"schema\": {...}}",
                       param="response_format.json_schema")
    try:
        return schema_grammar(spec["schema"])
    except SchemaError as err:
        raise APIError(400, f"{err.path}: {err}", param=err.path, code="unsupported_field") from None


def stops(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's stop strings, any number of them (lm-eval sends a task's whole list), empty ones
    dropped and duplicates once."""
    if stop is None:
        return ()
    found = (stop,) if isinstance(stop, str) else tuple(stop)
    return tuple(dict.fromkeys(s for s in found if s))


def stream_usage(req) -> bool:
    """Whether a streamed response ends with a usage chunk (`stream_options.include_usage`); the options
    are OpenAI's and only valid with `stream`."""
    options = getattr(req, "stream_options", None)
    if options is None:
        return False
    if not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise APIError(400, "stream_options must be an object with include_usage (bool)", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool) or options.get("continuous_usage_stats"):
        raise APIError(400, "stream_options.include_usage must be true or false (continuous_usage_stats is not "
                            "supported)", param="stream_options.include_usage")
    return include
