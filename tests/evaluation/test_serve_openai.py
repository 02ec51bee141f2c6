"""`ultratron serve` on loopback, driven by the official openai client and raw HTTP."""

import http.client
import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
import torch


def _client(served, key=None):
    url, good = served
    return openai.OpenAI(base_url=url + "/v1", api_key=key or good, max_retries=0, timeout=60)


def _raw(served, path, body, key=None, method="POST"):
    url, good = served
    data = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if key is not False:
        headers["Authorization"] = f"Bearer {key or good}"
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_models_completions_and_logprobs_match_the_checkpoint(served, trained_checkpoint):
    client = _client(served)
    assert [m.id for m in client.models.list().data] == ["ultratron"]
    out = client.completions.create(model="ultratron", prompt=["def ", "import "], max_tokens=8, temperature=0,
                                    logprobs=3)
    assert len(out.choices) == 2 and all(c.finish_reason in ("length", "stop") for c in out.choices)
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    # greedy text agrees with the local model, and the reported logprobs are the model's
    from ultratron.checkpoint.inference import load_for_inference as load_model
    from ultratron.models.sampling import generate

    loaded = load_model(trained_checkpoint)
    tok = loaded.tokenizer
    ids = generate(loaded.model, tok.encode("def "), 8, temperature=0, stop_id=tok.eos_id)
    assert out.choices[0].text == tok.decode(ids)
    lp = out.choices[0].logprobs
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-5)
               for i, top in enumerate(lp.top_logprobs))
    # echo + logprobs over a token-id prompt, max_tokens=0: what lm-eval's loglikelihood uses
    prompt_ids = tok.encode("for i in range(10):\n    print(i)\n")
    echo = client.completions.create(model="ultratron", prompt=[prompt_ids], max_tokens=0, echo=True, logprobs=1,
                                     temperature=0)
    got = echo.choices[0].logprobs.token_logprobs
    with torch.no_grad():
        ref = torch.log_softmax(loaded.model(torch.tensor([prompt_ids])), -1)[0]
    want = [None] + [float(ref[t - 1, prompt_ids[t]]) for t in range(1, len(prompt_ids))]
    assert got[0] is None and max(abs(a - b) for a, b in zip(got[1:], want[1:], strict=True)) < 1e-4
    assert echo.choices[0].text == tok.decode(prompt_ids)


def test_chat_plain_and_streamed_agree(served):
    client = _client(served)
    messages = [{"role": "user", "content": "Write a Python function."}]
    plain = client.chat.completions.create(model="ultratron", messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=2)
    msg = plain.choices[0].message
    assert msg.role == "assistant" and plain.choices[0].finish_reason in ("length", "stop")
    assert len(plain.choices[0].logprobs.content) == plain.usage.completion_tokens
    stream = client.chat.completions.create(model="ultratron", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    pieces, finish = [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        pieces.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == msg.content and finish == plain.choices[0].finish_reason


def test_seeded_sampling_stop_and_tokenizer_endpoints(served):
    client = _client(served)
    a, b = (client.completions.create(model="ultratron", prompt="class ", max_tokens=10, temperature=1.0, seed=5)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    status, toks = _raw(served, "/tokenize", {"prompt": "def f(x):", "add_special_tokens": False})
    assert status == 200 and toks["count"] == len(toks["tokens"]) > 0
    status, back = _raw(served, "/detokenize", {"tokens": toks["tokens"]})
    assert status == 200 and back["prompt"] == "def f(x):"
    status, info = _raw(served, "/tokenizer_info", None, method="GET")
    assert status == 200 and info["eos_token"] == "<|endoftext|>"
    full = client.completions.create(model="ultratron", prompt="def ", max_tokens=12, temperature=0).choices[0].text
    assert len(full) >= 5, full  # 12 greedy tokens of a trained model: text to cut
    cut = full[3:5]
    stopped = client.completions.create(model="ultratron", prompt="def ", max_tokens=12, temperature=0,
                                        stop=[cut]).choices[0]
    assert stopped.text == full[: full.find(cut)] and stopped.finish_reason == "stop"


def test_concurrent_requests_are_batched_and_answered(served):
    """Six requests sent together share decode steps (the server's /stats counts the sequences of
    each step) and each answer is what the request gets alone."""
    client = _client(served)
    tokens = 96  # with `ignore_eos` exactly this many: each request alone holds the worker for 96 steps

    def ask(prompt):
        return client.completions.create(model="ultratron", prompt=prompt, max_tokens=tokens, temperature=0,
                                         extra_body={"ignore_eos": True})

    results = [None] * 6
    barrier = threading.Barrier(6)

    def concurrent(i):
        barrier.wait()  # released together, so none waits for another to be answered before sending
        results[i] = ask(f"x{i} = ")

    before = _raw(served, "/stats", None, method="GET")[1]["rows_per_step"]
    threads = [threading.Thread(target=concurrent, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = _raw(served, "/stats", None, method="GET")[1]["rows_per_step"]
    steps = {int(n): count - before.get(n, 0) for n, count in after.items() if count > before.get(n, 0)}
    assert all(r.usage.completion_tokens == tokens for r in results)
    # every generated token is counted once: the steps of this window hold the six requests' tokens
    assert sum(n * count for n, count in steps.items()) == 6 * tokens
    # and steps held several of them: run one at a time, every step would hold one sequence. (Only
    # a client that sent each request after the previous one's 96 steps were over could see that.)
    assert max(steps) >= 2, steps
    print(f"concurrent requests: decode steps by batch size {dict(sorted(steps.items()))}")
    solo = ask("x3 = ")
    assert solo.choices[0].text == results[3].choices[0].text


@pytest.mark.parametrize("case", ["json", "model", "long", "nokey", "badkey", "huge", "field"])
def test_bad_requests_get_openai_shaped_4xx_and_the_server_keeps_serving(served, case):
    client = _client(served)
    if case == "json":
        status, body = _raw(served, "/v1/completions", b'{"model": "ultratron", "prompt": ')
        assert status == 400
    elif case == "model":
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="gpt-17", prompt="hi", max_tokens=1)
        status, body = err.value.status_code, err.value.body and {"error": err.value.body}
        assert body["error"]["code"] == "model_not_found"
    elif case == "long":
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="ultratron", prompt=[[5] * 200], max_tokens=1)
        status, body = 400, {"error": err.value.body}
        assert body["error"]["code"] == "context_length_exceeded" and "128" in body["error"]["message"]
    elif case == "nokey":
        status, body = _raw(served, "/v1/models", None, key=False, method="GET")
        assert status == 401
    elif case == "badkey":
        with pytest.raises(openai.AuthenticationError) as err:
            _client(served, key="wrong").models.list()
        status, body = 401, {"error": err.value.body}
    elif case == "huge":  # over --max-body-bytes (1 MiB by default): refused from its headers, body unread
        url, key = served
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
        conn.putrequest("POST", "/v1/completions")
        for name, value in (("Content-Type", "application/json"), ("Authorization", f"Bearer {key}"),
                            ("Content-Length", str((1 << 20) + 1))):
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        status, body = response.status, json.loads(response.read())
        conn.close()
        assert status == 413 and body["error"]["code"] == "request_too_large"
    else:
        status, body = _raw(served, "/v1/completions", {"model": "ultratron", "prompt": "a", "temperature": 9})
        assert status == 400 and body["error"]["param"] == "temperature"
    assert 400 <= status < 500 and body["error"]["message"] and body["error"]["type"]
    ok = client.completions.create(model="ultratron", prompt="def ", max_tokens=2, temperature=0)
    assert len(ok.choices) == 1


def test_a_lone_surrogate_or_an_oversized_seed_is_the_clients_error(served):
    """JSON may escape half a surrogate pair ("\\ud800"); Python's json gives a str no tokenizer can
    encode, and a seed beyond 64 bits overflows torch's generator. Both used to be HTTP 500."""
    bodies = [
        (b'{"model": "ultratron", "prompt": "a\\ud800b", "max_tokens": 2}', "/v1/completions", "prompt"),
        (b'{"model": "ultratron", "prompt": ["ok", "\\udfff"], "max_tokens": 2}', "/v1/completions", "prompt"),
        (b'{"model": "ultratron", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "/v1/chat/completions",
         "messages.0.content"),
        (b'{"prompt": "x\\ud800"}', "/tokenize", "prompt"),
        (json.dumps({"model": "ultratron", "prompt": "a", "max_tokens": 2, "seed": 2**70}).encode(),
         "/v1/completions", "seed"),
        (json.dumps({"model": "ultratron", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
                     "seed": -(2**70)}).encode(), "/v1/chat/completions", "seed"),
    ]
    for body, path, param in bodies:
        status, answer = _raw(served, path, body)
        assert status == 400, (path, body, answer)
        assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error", answer
    assert "lone surrogate" in _raw(served, *bodies[0][1::-1])[1]["error"]["message"]
    # the largest seed that fits still samples
    status, out = _raw(served, "/v1/completions", {"model": "ultratron", "prompt": "a", "max_tokens": 2,
                                                   "seed": 2**63 - 1, "n": 2})
    assert status == 200 and len(out["choices"]) == 2, out


BAD_SAMPLING = [  # (field, value): each one OpenAI's API refuses as well
    ("logit_bias", {"abc": 5}), ("logit_bias", {"1.5": 5}), ("logit_bias", {"999999": 5}), ("logit_bias", {"-1": 5}),
    ("logit_bias", {"3": 101}), ("logit_bias", {"3": -100.5}), ("logit_bias", {"3": "high"}),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01), ("frequency_penalty", float("inf")),
    ("frequency_penalty", float("nan")), ("presence_penalty", 3), ("presence_penalty", float("-inf")),
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")), ("top_p", float("inf")),
    ("n", 0), ("n", 1.5), ("n", "2"), ("n", True), ("max_tokens", -1), ("max_tokens", 2.5), ("max_tokens", "4"),
    ("max_tokens", False),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sampling_values_the_server_cannot_honour_are_a_400_naming_the_field(served, path):
    """Python's json module writes and reads NaN and Infinity, so the bodies below reach the server as
    a client with that bug would send them; each is refused before any work with the field named."""
    base = {"model": "ultratron", "max_tokens": 2}
    base |= {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    for field, value in BAD_SAMPLING:
        status, answer = _raw(served, path, json.dumps(base | {field: value}).encode())
        assert status == 400, (path, field, value, answer)
        assert answer["error"]["param"] == field and field in answer["error"]["message"], (field, value, answer)
        assert answer["error"]["type"] == "invalid_request_error"
    # the limits themselves are valid, and so is what was accepted before: an integral float, max_tokens 0
    edge = {"logit_bias": {"3": -100, "4": 100}, "frequency_penalty": -2, "presence_penalty": 2.0, "n": 2.0,
            "temperature": 0}
    status, out = _raw(served, path, json.dumps(base | edge).encode())
    assert status == 200 and len(out["choices"]) == 2, out
    if path == "/v1/completions":
        status, out = _raw(served, path, {**base, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert status == 200 and out["usage"]["completion_tokens"] == 0, out


def test_logit_bias_and_penalties_steer_the_sampled_tokens(served):
    """Honoured, not only accepted: a +100 bias makes greedy decoding pick that token every time (the
    model's own log-probabilities span far less than 100 nats), and the scores sampling draws from are
    OpenAI's formula, term by term, on a hand-made distribution."""
    from ultratron.inference.engine import SamplingParams, _adjusted

    body = {"model": "ultratron", "prompt": "def ", "max_tokens": 6, "temperature": 0}
    status, plain = _raw(served, "/v1/completions", body)
    status, forced = _raw(served, "/v1/completions", body | {"logit_bias": {"7": 100}, "logprobs": 0})
    assert status == 200 and forced["choices"][0]["logprobs"]["tokens"], forced
    sevens = _raw(served, "/detokenize", {"tokens": [7] * 6})[1]["prompt"]
    assert forced["choices"][0]["text"] == sevens != plain["choices"][0]["text"], (sevens, forced, plain)
    logp = torch.log_softmax(torch.tensor([0.0, 1.0, 3.0, 0.5]), dim=-1)
    params = SamplingParams(logit_bias={0: 10.0}, frequency_penalty=0.5, presence_penalty=1.0)
    got = _adjusted(logp, params, [2, 2, 1])
    want = logp + torch.tensor([10.0, -(0.5 + 1.0), -(2 * 0.5 + 1.0), 0.0])
    assert torch.equal(got, want), (got, want)
    assert torch.equal(_adjusted(logp, SamplingParams(), [2]), logp)  # nothing asked: the model's own scores
