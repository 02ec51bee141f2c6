"""The OpenAI request details eval clients send: any number of stop strings (lm-eval's local-completions
payloads, emulated byte for byte), top_k and seed honoured, stream_options.include_usage, and every
field the server does not implement either harmless or a 400 naming it, never silently ignored."""

import json
import urllib.request

import pytest
import torch

from .serving import call, corpus_tokenizer, running_server, small_model


@pytest.fixture(scope="module")
def http(small_corpus):
    model, tokenizer = small_model(), corpus_tokenizer(small_corpus)
    with running_server(model, tokenizer, max_batch_rows=8) as (url, server):
        yield url, server, tokenizer


def _completion(url, **body):
    status, out = call(url, "/v1/completions", {"model": "ultratron", **body})
    assert status == 200, out
    return out


def test_lm_evals_requests_with_eight_stop_strings_get_200s_and_stop_at_the_first(http):
    """lm-eval's local-completions sends, for generate_until, {"prompt", "model", "max_tokens",
    "temperature", "stop", "seed"} with the task's whole `until` list plus the end-of-text string
    (HumanEval's is 8 long); for loglikelihood a batch of token-id prompts with max_tokens 1, echo,
    logprobs 1, temperature 0 and a seed. The server answered 400 above 4 stop strings."""
    url, _, tokenizer = http
    full = _completion(url, prompt="def f(x):\n", max_tokens=40, temperature=0, seed=1234,
                       ignore_eos=True)["choices"][0]["text"]
    assert len(full) > 12, full
    cut = full[8:11]  # a stop string that occurs, among seven that do not (and one empty, which is no stop)
    stops = ["\nclass\x00", "\ndef\x00", "\n#\x00", "\nif\x00", cut, "\nprint\x00", "", "<|endoftext|>"]
    out = _completion(url, prompt=["def f(x):\n"], model="ultratron", max_tokens=40, temperature=0, stop=stops,
                      seed=1234, ignore_eos=True)
    assert out["choices"][0]["text"] == full[: full.find(cut)] and out["choices"][0]["finish_reason"] == "stop"
    many = _completion(url, prompt="def f(x):\n", max_tokens=40, temperature=0, stop=[f"@{i}@" for i in range(64)],
                       ignore_eos=True)
    assert many["choices"][0]["text"] == full, "64 stop strings that never occur change nothing"
    batch = [tokenizer.encode(f"x = {i}\ny = x + 1\n") for i in range(8)]
    scored = _completion(url, prompt=batch, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
    assert len(scored["choices"]) == 8
    assert all(len(c["logprobs"]["token_logprobs"]) >= len(ids) for c, ids in zip(scored["choices"], batch,
                                                                                      strict=True))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fields_that_would_change_the_output_are_a_400_naming_them_and_harmless_ones_pass(http, path):
    url, _, _ = http
    base = {"model": "ultratron", "max_tokens": 2, "temperature": 0}
    base |= {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused = [("response_format", {"type": "yaml"}), ("tools", [tool]), ("tool_choice", "required"),
               ("functions", [tool["function"]]), ("repetition_penalty", 1.3), ("min_tokens", 3), ("best_of", 3),
               ("suffix", "}"), ("guided_json", {"type": "object"}), ("logit_scale", 2)]
    for field, value in refused:
        status, answer = call(url, path, base | {field: value})
        assert status == 400, (field, value, answer)
        error = answer["error"]
        assert error["param"] == field and field in error["message"] and error["code"] == "unsupported_field", error
    plain = call(url, path, base)[1]["choices"][0]
    accepted = [("user", "alice"), ("metadata", {"run": "7"}), ("store", False), ("service_tier", "auto"),
                ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"),
                ("parallel_tool_calls", True), ("repetition_penalty", 1.0), ("min_tokens", 0), ("best_of", 1),
                ("skip_special_tokens", True)]
    for field, value in accepted:
        status, answer = call(url, path, base | {field: value})
        assert status == 200, (field, value, answer)
        assert answer["choices"][0] == plain, (field, value)  # harmless: the same output
    status, answer = call(url, path, base | {"stream_options": {"include_usage": True}})
    assert status == 400 and answer["error"]["param"] == "stream_options", answer


def test_top_k_and_seed_are_honoured(http):
    """top_k 1 at temperature 1 is greedy decoding; with top_k 3 every sampled token is among the 3
    most likely (logprobs 3 lists them); the same seed gives the same text, and n > 1 gives each choice
    its own seed (seed + index)."""
    url, _, _ = http
    greedy = _completion(url, prompt="import ", max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]
    top1 = _completion(url, prompt="import ", max_tokens=12, temperature=1.0, top_k=1, seed=3,
                       ignore_eos=True)["choices"][0]
    assert top1["text"] == greedy["text"]
    draws = _completion(url, prompt="import ", max_tokens=16, temperature=2.0, top_k=3, seed=11, n=4, logprobs=3,
                        ignore_eos=True)["choices"]
    for choice in draws:
        lp = choice["logprobs"]
        assert all(token in top for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)), lp
    unfiltered = _completion(url, prompt="import ", max_tokens=16, temperature=2.0, seed=11, n=4, logprobs=3,
                             ignore_eos=True)["choices"]
    outside = sum(t not in top for c in unfiltered for t, top in zip(c["logprobs"]["tokens"],
                                                                      c["logprobs"]["top_logprobs"], strict=True))
    assert outside > 0, "at temperature 2 a random model samples outside its top 3: top_k made the difference"
    again = _completion(url, prompt="import ", max_tokens=16, temperature=2.0, top_k=3, seed=11, n=4,
                        ignore_eos=True)["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in draws] and len({c["text"] for c in draws}) > 1
    for bad in (-2, 1.5, "3"):
        status, answer = call(url, "/v1/completions", {"model": "ultratron", "prompt": "a", "top_k": bad})
        assert status == 400 and answer["error"]["param"] == "top_k", (bad, answer)


def test_keep_top_k_keeps_ties_and_means_all_when_off():
    from ultratron.models.sampling import keep_top_k

    scores = torch.tensor([0.5, 2.0, 1.0, 2.0, -1.0])
    assert torch.isinf(keep_top_k(scores, 2)).tolist() == [True, False, True, False, True]
    assert torch.isinf(keep_top_k(scores, 3)).tolist() == [True, False, False, False, True]
    for off in (0, -1, None, 5, 9):
        assert torch.equal(keep_top_k(scores, off), scores)


def _events(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [line.decode().strip() for line in resp]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_include_usage_ends_the_stream_with_the_usage(http, path):
    url, _, _ = http
    body = {"model": "ultratron", "max_tokens": 7, "temperature": 0, "n": 2, "ignore_eos": True}
    body |= {"prompt": "def "} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    plain = call(url, path, body)[1]
    chunks = _events(url, path, body | {"stream": True, "stream_options": {"include_usage": True}})
    *content, last = chunks
    assert last["choices"] == [] and last["usage"] == plain["usage"], (last, plain["usage"])
    assert all(c["usage"] is None for c in content)
    assert all("usage" not in c for c in _events(url, path, body | {"stream": True}))
    status, answer = call(url, path, body | {"stream": True, "stream_options": {"include_usage": "yes"}})
    assert status == 400 and answer["error"]["param"] == "stream_options.include_usage", answer
