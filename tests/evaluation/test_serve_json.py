"""Structured output by constrained decoding: with `response_format` json_object even a random
model's completion is one JSON object (or, cut by max_tokens, the beginning of one), with
json_schema one that conforms to the schema; the byte grammars accept exactly those; a schema
keyword the grammar cannot enforce is a 400 naming its path."""

import json
import random

import pytest

from ultratron.serving.json_mode import START, run

from .serving import call, corpus_tokenizer, running_server, small_model


def _complete(text: str) -> bool:
    state = run(START, text.encode())
    return state is not None and state[1] == "done"


def test_the_automaton_accepts_json_objects_and_refuses_the_rest():
    good = ['{}', '{"a": 1}', '{ "k" : [ ] }', '{"é": "ü\\u00e9\\n\\"\\\\"}',
            '{"a":[1,2.5e-3,-0,1E+2,true,false,null,"x"],"b":{"c":{}}}']
    bad = ['[]', '1', '"s"', 'null', '{"a":01}', '{"a":1,}', '{,}', '{"a" 1}', '{"a":tru}', '{"a":-}', '{"a":1.}',
           '{"a":"\\x"}', '{}}', '{"a":[1}', '{"a":"\t"}', '{"a":1} ', '{a:1}', "{'a':1}", '{"a":1e}', '{"a":.5}']
    for text in good:
        assert isinstance(json.loads(text), dict) and _complete(text), text
        assert all(run(START, text.encode()[:i]) is not None for i in range(len(text.encode())))  # every prefix
    for text in bad:
        assert not _complete(text), text
    rng = random.Random(0)

    def value(depth):
        kind = "leaf" if depth > 3 else rng.choices(["leaf", "object", "array"], weights=[30, 35, 35])[0]
        if kind == "leaf":
            return rng.choice([0, -12, 3.5e-7, 1e22, True, False, None, "x", 'é"\\\n', ""])
        if kind == "object":
            return {f"k{i}": value(depth + 1) for i in range(rng.randint(0, 3))}
        return [value(depth + 1) for _ in range(rng.randint(0, 3))]

    for _ in range(500):  # whatever json.dumps writes, compact or indented, ASCII-escaped or not
        obj = {f"k{i}": value(1) for i in range(rng.randint(0, 4))}
        for indent in (None, 2):
            assert _complete(json.dumps(obj, indent=indent, ensure_ascii=rng.choice([True, False])))


def test_each_states_mask_is_every_token_the_automaton_accepts_whole():
    """The cached masks (a walk over the tokens in byte order, and the in-string shortcut) against
    running every token's bytes through the automaton, on a vocabulary of random pieces."""
    import torch

    from ultratron.serving.json_mode import JsonVocabulary

    rng = random.Random(0)
    alphabet = b'ab"\\{}[],: 0123456789-.eEtrufalsn\x01\xc3\xa9\t\n'
    pieces = [bytes([b]) for b in range(256)] + [bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
                                                 for _ in range(3000)] + [None, b"ab"]
    eos = len(pieces) - 2
    vocab = JsonVocabulary(pieces, eos)
    for text in ['{', '{"', '{"ab', '{"a":"x', '{"a":"\\', '{"a": [1, "', '{"a": 12', '{"a":[', '{"a":tr',
                 '{"a":"\\u00', '{"a":1}']:
        state = run(START, text.encode())
        want = torch.tensor([bool(p) and run(state, p) is not None for p in pieces])
        if state[1] == "done":
            want = torch.arange(len(pieces)) == eos
        assert torch.equal(vocab.allowed(state), want), text


@pytest.fixture(scope="module")
def http(small_corpus):
    with running_server(small_model(), corpus_tokenizer(small_corpus), max_batch_rows=8) as (url, server):
        yield url, server


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_json_mode_makes_a_random_models_completion_a_json_object(http, path):
    url, _ = http
    body = {"model": "ultratron", "max_tokens": 160, "n": 8, "temperature": 1.0, "seed": 5,
            "response_format": {"type": "json_object"}}
    body |= {"prompt": "data = "} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, out = call(url, path, body)
    assert status == 200, out
    texts = [(c["text"] if "text" in c else c["message"]["content"], c["finish_reason"]) for c in out["choices"]]
    complete = [t for t, finish in texts if finish == "stop"]
    for text, finish in texts:
        assert run(START, text.encode()) is not None, text  # every completion is a JSON object's beginning
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
    assert complete, texts  # and some closed their object within max_tokens
    status, plain = call(url, path, {k: v for k, v in body.items() if k != "response_format"})
    assert not all(_complete(c.get("text") or c.get("message", {}).get("content", "")) for c in plain["choices"])
    print(f"{path}: {len(complete)} of 8 complete JSON objects, e.g. {complete[0]!r}")


SCHEMA = {"type": "object", "title": "person", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}, "score": {"type": "number"}, "none": {"type": "null"},
    "sub": {"type": "object", "properties": {"k": {"const": 3}}}}, "required": ["name", "age"],
    "additionalProperties": False}


def _conforms(value, schema) -> bool:
    """`value` against the schema subset the server supports (every property present, in order)."""
    if "enum" in schema or "const" in schema:
        return value in schema.get("enum", [schema.get("const")])
    kind = schema["type"]
    if kind == "object":
        return isinstance(value, dict) and list(value) == list(schema["properties"]) and all(
            _conforms(value[k], s) for k, s in schema["properties"].items())
    if kind == "array":
        return isinstance(value, list) and all(_conforms(v, schema["items"]) for v in value)
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None)}
    return isinstance(value, types[kind]) and (kind in ("boolean",) or not isinstance(value, bool))


def test_the_schema_grammar_accepts_conforming_json_and_nothing_else():
    from ultratron.serving.json_schema import schema_grammar

    grammar = schema_grammar(SCHEMA)
    good = {"name": "é\"x", "age": -3, "tags": ["a", ""], "ok": True, "kind": "dog", "score": 1.5e3, "none": None,
            "sub": {"k": 3}}
    text = json.dumps(good, separators=(",", ":"))
    assert grammar.run(grammar.start, text.encode()) == ()  # complete
    assert all(grammar.run(grammar.start, text.encode()[:i]) for i in range(len(text.encode())))
    for change in ({"age": 3.5}, {"kind": "cow"}, {"tags": [1]}, {"ok": "yes"}, {"sub": {"k": 4}}, {"none": 0},
                   {"name": None}):
        bad = json.dumps(good | change, separators=(",", ":"))
        assert not _conforms(json.loads(bad), SCHEMA) and grammar.run(grammar.start, bad.encode()) != (), change
    for text in ('{"age":1}', '{"name": "a"}', json.dumps(good)):  # another order, whitespace
        assert grammar.run(grammar.start, text.encode()) is None, text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_json_schema_makes_a_random_models_completion_conform(http, path):
    url, _ = http
    body = {"model": "ultratron", "max_tokens": 200, "n": 8, "temperature": 1.0, "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    body |= {"prompt": "p = "} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "p"}]}
    status, out = call(url, path, body)
    assert status == 200, out
    texts = [(c["text"] if "text" in c else c["message"]["content"], c["finish_reason"]) for c in out["choices"]]
    complete = [json.loads(t) for t, finish in texts if finish == "stop"]
    assert complete and all(_conforms(v, SCHEMA) for v in complete), texts
    assert all(t.startswith('{"name":"') for t, _ in texts)  # the keys are forced, in order
    print(f"{path}: {len(complete)} of 8 conform, e.g. {complete[0]}")


@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}, "properties.a.pattern"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}}, "properties.a.anyOf"),
    ({"type": "object", "properties": {"a": {"type": ["string", "null"]}}}, "properties.a.type"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "minItems": 2}}},
     "properties.a.minItems"),
    ({"type": "object", "properties": {"a": {"enum": [1, 12]}}}, "properties.a.enum"),
    ({"type": "array", "items": {"type": "string"}}, ""),
])
def test_a_schema_keyword_the_grammar_cannot_enforce_is_a_400_naming_its_path(http, schema, where):
    url, _ = http
    status, answer = call(url, "/v1/completions", {"model": "ultratron", "prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    param = "response_format.json_schema.schema" + (f".{where}" if where else "")
    assert status == 400 and answer["error"]["param"] == param, answer


def test_json_mode_with_ignore_eos_or_a_malformed_response_format_is_a_400(http):
    url, _ = http
    for response_format, param in (({"type": "json_object"}, "ignore_eos"),
                                   ({"type": "json_schema"}, "response_format.json_schema"),
                                   ({"type": "json_schema", "json_schema": {"schema": 3}},
                                    "response_format.json_schema")):
        status, answer = call(url, "/v1/completions", {"model": "ultratron", "prompt": "a", "ignore_eos": True,
                                                       "response_format": response_format})
        assert status == 400 and answer["error"]["param"] == param, answer
