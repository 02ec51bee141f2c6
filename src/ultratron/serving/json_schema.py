"""`response_format: {"type": "json_schema", ...}` for the subset of JSON Schema that OpenAI's strict
structured outputs use, compiled into a byte grammar for `serving/json_mode.py`'s masks.

Supported: `type` object (with `properties`; every property is written, in the schema's order, so
any `required` list and `additionalProperties` are satisfied), array (`items`), string, number,
integer, boolean, null; `enum` and `const` of values no one of which is a prefix of another once
written as JSON; `description` and `title` anywhere. Anything else (`anyOf`, `$ref`, `pattern`,
`minItems`, a list of types, ...) is a `SchemaError` naming its path, which the server answers
with a 400: a keyword the grammar does not enforce could be violated by the output.

The output is compact JSON (no whitespace): the keys, colons and commas are forced, and the model
chooses only the values. A state is a stack (a tuple, top last) of frames:
("lit", bytes left), ("val", node), ("str", None | "esc" | ("u", hex digits left)),
("num", integer?, grammar state), ("enum", the options' bytes left), ("arr", node, "first" | "after").
"""

from __future__ import annotations

import json

from ultratron.serving.json_mode import DIGITS, HEX, Grammar, _number

NOTES = {"description", "title", "$schema"}
KEYWORDS = {"object": {"type", "properties", "required", "additionalProperties"}, "array": {"type", "items"},
            "string": {"type"}, "number": {"type"}, "integer": {"type"}, "boolean": {"type"}, "null": {"type"}}


class SchemaError(ValueError):
    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def schema_grammar(schema, path: str = "response_format.json_schema.schema") -> Grammar:
    nodes: list[tuple] = []
    root = _compile(schema, path, nodes)
    if nodes[root][0] != "object":
        raise SchemaError("the schema's top level must be an object (\"type\": \"object\")", path)
    frozen = tuple(nodes)
    return Grammar("schema:" + json.dumps(schema, sort_keys=True), (("val", root),),
                   lambda state, byte: _step(frozen, state, byte), lambda state: not state,
                   lambda state: bool(state) and state[-1] == ("str", None))


def _compile(schema, path: str, nodes: list) -> int:
    if not isinstance(schema, dict):
        raise SchemaError("a schema must be an object", path)
    known = NOTES | {"enum", "const"} | set().union(*KEYWORDS.values())
    unknown = sorted(set(schema) - known)
    if unknown:
        raise SchemaError(f"{unknown[0]!r} is not supported: the output could violate it", f"{path}.{unknown[0]}")
    if "enum" in schema or "const" in schema:
        extra = set(schema) - NOTES - {"enum", "const", "type"}
        if extra:
            raise SchemaError(f"{sorted(extra)[0]!r} is not supported beside enum/const", f"{path}.{sorted(extra)[0]}")
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise SchemaError("enum must be a non-empty list", f"{path}.enum")
        options = tuple(dict.fromkeys(json.dumps(v, separators=(",", ":")).encode() for v in values))
        if any(a != b and b.startswith(a) for a in options for b in options):
            raise SchemaError("enum values one of which begins another (1 and 12) are not supported", f"{path}.enum")
        return _add(nodes, ("enum", options))
    kind = schema.get("type")
    if not isinstance(kind, str) or kind not in KEYWORDS:
        raise SchemaError(f"type must be one of {', '.join(KEYWORDS)} (a list of types is not supported), not "
                          f"{kind!r}", f"{path}.type")
    extra = set(schema) - NOTES - KEYWORDS[kind]
    if extra:
        name = sorted(extra)[0]
        raise SchemaError(f"{name!r} is not supported for type {kind}: the output could violate it", f"{path}.{name}")
    if kind == "object":
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise SchemaError("properties must be an object", f"{path}.properties")
        missing = set(schema.get("required", [])) - set(properties)
        if missing:
            raise SchemaError(f"required names {sorted(missing)[0]!r}, which properties lacks", f"{path}.required")
        fields = tuple((json.dumps(k).encode(), _compile(v, f"{path}.properties.{k}", nodes))
                       for k, v in properties.items())
        return _add(nodes, ("object", fields))
    if kind == "array":
        if "items" not in schema:
            raise SchemaError("an array needs items", f"{path}.items")
        return _add(nodes, ("array", _compile(schema["items"], f"{path}.items", nodes)))
    if kind in ("boolean", "null"):
        return _add(nodes, ("enum", (b"true", b"false") if kind == "boolean" else (b"null",)))
    return _add(nodes, (kind,))


def _add(nodes: list, node: tuple) -> int:
    nodes.append(node)
    return len(nodes) - 1


def _expand(nodes: tuple, node: int) -> tuple:
    """The frames a value of `node` starts as (pushed in reverse: the first to match is last)."""
    kind = nodes[node]
    if kind[0] == "object":
        if not kind[1]:
            return (("lit", b"{}"),)
        frames, sep = [], b"{"
        for key, child in kind[1]:
            frames += [("lit", sep + key + b":"), ("val", child)]
            sep = b","
        frames.append(("lit", b"}"))
        return tuple(reversed(frames))
    if kind[0] == "array":
        return (("arr", kind[1], "first"), ("lit", b"["))
    if kind[0] == "string":
        return (("str", None), ("lit", b'"'))
    if kind[0] in ("number", "integer"):
        return (("num", kind[0] == "integer", "start"),)
    return (("enum", kind[1]),)


def _step(nodes: tuple, state: tuple, byte: int):
    if not state:
        return None
    rest, top = state[:-1], state[-1]
    kind = top[0]
    if kind == "val":
        return _step(nodes, rest + _expand(nodes, top[1]), byte)
    if kind == "lit":
        if byte != top[1][0]:
            return None
        return rest if len(top[1]) == 1 else rest + (("lit", top[1][1:]),)
    if kind == "enum":
        left = tuple(o[1:] for o in top[1] if o[0] == byte)
        if not left:
            return None
        return rest if b"" in left else rest + (("enum", left),)
    if kind == "str":
        mode = top[1]
        if mode is None:
            if byte == ord('"'):
                return rest
            if byte == ord("\\"):
                return rest + (("str", "esc"),)
            return None if byte < 0x20 else state
        if mode == "esc":
            if byte == ord("u"):
                return rest + (("str", ("u", 4)),)
            return rest + (("str", None),) if byte in b'"\\/bfnrt' else None
        if byte not in HEX:
            return None
        return rest + (("str", None if mode[1] == 1 else ("u", mode[1] - 1)),)
    if kind == "num":
        integer, at = top[1], top[2]
        if at == "start":
            nxt = "-" if byte == ord("-") else ("0" if byte == ord("0") else ("int" if byte in DIGITS else None))
        elif integer and byte in b".eE":
            nxt = None
        else:
            nxt = _number(at, byte)
        if nxt is not None:
            return rest + (("num", integer, nxt),)
        if at not in ("0", "int", "frac", "exp"):
            return None
        return _step(nodes, rest, byte)  # the number ended: the byte is the next frame's
    # "arr"
    child, phase = top[1], top[2]
    if byte == ord("]"):
        return rest
    if phase == "first":
        return _step(nodes, rest + (("arr", child, "after"), ("val", child)), byte)
    return rest + (("arr", child, "after"), ("val", child)) if byte == ord(",") else None
