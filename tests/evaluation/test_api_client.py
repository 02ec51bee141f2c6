"""evaluation/api_client.py: what it retries, how long it waits, and what it says when it gives up."""

import http.server
import json
import socket
import threading

import pytest

from ultratron.evaluation import api_client
from ultratron.evaluation.api_client import APIError, Client


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next (status, body, headers) of `script`; records what it got."""

    script: list = []
    got: list = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        type(self).got.append((self.command, self.path, self.headers.get("Authorization"),
                               json.loads(self.rfile.read(length)) if length else None))
        status, body, headers = type(self).script.pop(0)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body if isinstance(body, bytes) else json.dumps(body).encode())

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server(monkeypatch):
    waits = []
    monkeypatch.setattr(api_client.time, "sleep", waits.append)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Scripted.got = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", waits
    httpd.shutdown()


def test_a_passing_failure_is_retried_with_growing_waits_and_the_answer_comes_back(server):
    url, waits = server
    _Scripted.script = [(503, {"error": {"message": "busy"}}, {}), (429, {"error": "slow down"}, {}),
                        (500, b"oops", {}), (200, {"choices": [{"index": 0, "text": "x"}]}, {})]
    answer = Client(url, "key", max_retries=3).post("completions", {"prompt": "a"})
    assert answer == {"choices": [{"index": 0, "text": "x"}]}
    assert waits == [0.5, 1.0, 2.0]
    assert [g[:3] for g in _Scripted.got] == [("POST", "/v1/completions", "Bearer key")] * 4
    assert _Scripted.got[0][3] == {"prompt": "a"}


def test_retry_after_is_honoured_and_giving_up_names_the_failure_with_the_servers_message(server):
    url, waits = server
    _Scripted.script = [(503, {"error": {"message": "overloaded"}}, {"Retry-After": "3"})] * 2
    with pytest.raises(APIError) as err:
        Client(url, "key", max_retries=1).get("models")
    assert err.value.kind == "InternalServerError" and err.value.status == 503
    assert str(err.value) == "Error code: 503 - overloaded"
    assert waits == [3.0]


@pytest.mark.parametrize(("status", "kind"), [(400, "BadRequestError"), (401, "AuthenticationError"),
                                              (404, "NotFoundError")])
def test_a_failure_that_will_not_pass_is_not_retried(server, status, kind):
    url, waits = server
    _Scripted.script = [(status, {"error": {"message": "no"}}, {})]
    with pytest.raises(APIError) as err:
        Client(url, "key", max_retries=3).post("completions", {})
    assert err.value.kind == kind and waits == [] and len(_Scripted.got) == 1


def test_an_answer_that_is_not_json_and_a_closed_port_are_clear(server):
    url, waits = server
    _Scripted.script = [(200, b"<html>proxy</html>", {})]
    with pytest.raises(APIError) as err:
        Client(url, "key").get("models")
    assert err.value.kind == "APIResponseValidationError"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"  # bound, not listening: refused
        with pytest.raises(APIError) as err:
            Client(closed, "key", max_retries=2).get("models")
    assert err.value.kind == "APIConnectionError" and waits == [0.5, 1.0]


def test_a_pair_that_fits_by_its_bytes_costs_no_tokenize_call():
    """EndpointBackend.loglikelihood asks /tokenize only for texts whose bytes do not show that they fit
    (a token holds at least one byte): the short pair takes the probe call alone; the long one is
    counted, and cut to the context as the local backend cuts it."""
    from ultratron.evaluation import backends

    backend = object.__new__(backends.EndpointBackend)
    backend.concurrency, backend.prompts_per_request = 1, 8
    asked = []

    def tokenize(text):
        asked.append(text)
        return list(range(len(text))), 64  # a token a character, a 64-token context

    backend._tokenize = tokenize
    echoed = []
    backend._echo = lambda texts: echoed.extend(texts) or [
        {"text_offset": list(range(len(t))), "token_logprobs": [-1.0] * len(t),
         "top_logprobs": [{c: -1.0} for c in t], "tokens": list(t)} for t in texts]
    backend.loglikelihood([("short context ", "x")])
    assert asked == ["x"]  # the probe only
    long_context = "\n".join(f"line {i}" for i in range(20)) + "\n"
    backend.loglikelihood([(long_context, "tail")])
    assert len(asked) > 2 and all(len(t) <= 63 for t in echoed[1:])  # counted, and cut to fit
    assert echoed[1].endswith("line 19\ntail")


def test_answers_are_read_fast_and_the_nan_and_infinity_some_servers_write_still_parse(server):
    """orjson reads the bodies; what it refuses (the standard library's NaN and -Infinity literals,
    which some servers write for a log-probability) falls back to the standard library."""
    url, _ = server
    _Scripted.script = [(200, b'{"choices": [{"logprobs": {"token_logprobs": [null, -Infinity, NaN, -0.5]}}]}', {}),
                        (200, b'{"data": [{"id": "m", "n": 1.25}]}', {})]
    client = Client(url, "key", max_retries=0)
    lps = client.post("completions", {"prompt": "a"})["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[0] is None and lps[1] == float("-inf") and lps[2] != lps[2] and lps[3] == -0.5
    assert client.get("models") == {"data": [{"id": "m", "n": 1.25}]}


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_task_with_more_than_four_stop_strings_is_cut_at_each_of_them(api):
    """OpenAI's API takes at most 4 stop strings: the endpoint gets the first 4, and the text is cut
    at the first of all 8 (HumanEval's list is 8 long), the stop itself left out."""
    from ultratron.evaluation import backends

    backend = object.__new__(backends.EndpointBackend)
    backend.concurrency, backend.generation_api = 1, api
    stops = ("\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```", "<|end|>", "\n\n\n")
    sent = []

    def call(path, **body):
        sent.append(body["stop"])
        text = "    return a + b\nprint(add(1, 2))\ndef more():"  # runs past the 5th stop, then the 2nd
        return {"choices": [{"message": {"content": text}}]} if api == "chat" else {"choices": [{"text": text}]}

    backend._call = call
    assert backend.generate([("def add(a, b):\n", stops, 32), ("x", ("\nprint",), 32), ("y", (), 32)]) == [
        "    return a + b", "    return a + b", "    return a + b\nprint(add(1, 2))\ndef more():"]
    assert sent == [list(stops[:4]), ["\nprint"], None]
