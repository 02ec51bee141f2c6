"""A client that goes away stops its generation: a streamed or plain request whose connection a real
HTTP client closes, and a plain one past --request-timeout, free their slot within one decode step
of the server noticing. And the server's /metrics (Prometheus text) and /health (a one-token forward)."""

import http.client
import json
import re
import threading
import time

import pytest

from .serving import call, corpus_tokenizer, running_server, small_model

STEP_SECONDS = 0.05  # each forward sleeps this long: a generation of 100 tokens takes 5 s


@pytest.fixture(scope="module")
def parts(small_corpus):
    return small_model(), corpus_tokenizer(small_corpus)


@pytest.fixture
def slow(parts):
    model, tokenizer = parts
    hook = model.register_forward_pre_hook(lambda module, args: time.sleep(STEP_SECONDS))
    yield model, tokenizer
    hook.remove()


def _watch(server):
    """Record the worker's step count when the batcher is told to cancel and when the engine aborts."""
    seen = {}
    batcher, engine = server.batcher, server.batcher.engine
    cancel, abort = batcher.cancel, engine.abort

    def on_cancel(job):
        seen.setdefault("cancel", (batcher.steps_run, time.monotonic()))
        cancel(job)

    def on_abort(seqs):
        aborted = abort(seqs)
        if aborted:
            seen["abort"] = (batcher.steps_run, time.monotonic(), aborted)
        return aborted

    batcher.cancel, engine.abort = on_cancel, on_abort
    return seen


def _send(url, body, stream):
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "ultratron", "prompt": "def ", "temperature": 0,
                                                        "ignore_eos": True, "stream": stream, **body}),
                 {"Content-Type": "application/json"})
    return conn


def _running_sequence(server, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = list(server.batcher.engine.rows)
        if rows and rows[0].seq.tokens:
            return rows[0].seq
        time.sleep(0.005)
    raise AssertionError("no sequence started")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot_within_one_decode_step(slow, stream):
    with running_server(*slow, max_batch_rows=2) as (url, server):
        seen = _watch(server)
        conn = _send(url, {"max_tokens": 100}, stream)
        if stream:
            response = conn.getresponse()
            assert response.status == 200 and response.readline().startswith(b"data: ")  # the stream runs
        seq = _running_sequence(server)
        closed = time.monotonic()
        conn.sock.shutdown(2)  # the client goes away mid-generation
        conn.close()
        while "abort" not in seen and time.monotonic() < closed + 10:
            time.sleep(0.005)
        cancel_step, cancelled = seen["cancel"]
        abort_step, aborted, seqs = seen["abort"]
        assert seqs == [seq] and seq.finish_reason == "abort" and not server.batcher.engine.rows
        assert abort_step - cancel_step <= 1, (cancel_step, abort_step)  # before the next step at the latest
        assert len(seq.tokens) < 100
        print(f"{'stream' if stream else 'plain'}: disconnect noticed after {1e3 * (cancelled - closed):.0f} ms, "
              f"slot freed {1e3 * (aborted - closed):.0f} ms after the close, {abort_step - cancel_step} steps "
              f"after the cancel (one step: {1e3 * STEP_SECONDS:.0f} ms + compute)")
        assert call(url, "/v1/completions", {"model": "ultratron", "prompt": "a", "max_tokens": 2})[0] == 200


def test_a_waiting_request_whose_client_leaves_never_runs_and_a_slow_one_times_out(slow):
    with running_server(*slow, max_batch_rows=1, request_timeout=0.5) as (url, server):
        long = _send(url, {"max_tokens": 60}, stream=True)
        assert long.getresponse().status == 200
        _running_sequence(server)
        queued = _send(url, {"max_tokens": 5}, stream=False)
        while server.batcher.waiting < 1:
            time.sleep(0.005)
        queued.sock.shutdown(2)
        queued.close()
        deadline = time.monotonic() + 5
        while server.batcher.waiting and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server.batcher.waiting == 0 and len(server.batcher.engine.rows) == 1  # it left the queue
        long.close()
        started = time.monotonic()
        status, answer = call(url, "/v1/completions", {"model": "ultratron", "prompt": "x", "max_tokens": 100,
                                                       "ignore_eos": True})
        assert status == 504 and answer["error"]["code"] == "request_timeout", answer
        assert time.monotonic() - started < 5  # answered at the timeout, not after 100 steps
        deadline = time.monotonic() + 5

        def aborted() -> float:  # (the worker counts an aborted sequence just after it leaves the rows)
            return _metric(call(url, "/metrics")[1], "ultratron_sequences_aborted_total")

        while (server.batcher.engine.rows or aborted() < 2) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not server.batcher.engine.rows
        assert aborted() == 2  # the queued one never ran


def _metric(text: str, name: str, labels: str = "") -> float:
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert found, (name, labels, text)
    return float(found.group(1))


def test_metrics_count_requests_tokens_and_latencies_in_prometheus_text(parts):
    with running_server(*parts, max_batch_rows=4) as (url, server):
        usages = []
        for prompt, max_tokens in (("def ", 5), ("import os\n", 1), ("class A:\n", 9)):
            status, out = call(url, "/v1/completions", {"model": "ultratron", "prompt": prompt, "temperature": 0,
                                                        "max_tokens": max_tokens, "ignore_eos": True})
            usages.append(out["usage"])
        assert call(url, "/v1/completions", {"model": "ultratron", "prompt": "a", "temperature": 7})[0] == 400
        status, text = call(url, "/metrics")
        assert status == 200
        for line in text.splitlines():  # the exposition format: comments, or `name{labels} value`
            assert line.startswith(("# HELP ", "# TYPE ")) or re.fullmatch(r"[a-z_]+(\{[^}]*\})? \S+", line), line
        assert _metric(text, "ultratron_requests_total", '{endpoint="/v1/completions",status="200"}') == 3
        assert _metric(text, "ultratron_requests_total", '{endpoint="/v1/completions",status="400"}') == 1
        assert _metric(text, "ultratron_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
        assert _metric(text, "ultratron_generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 15
        assert _metric(text, "ultratron_time_to_first_token_seconds_count") == 3
        assert _metric(text, "ultratron_time_per_output_token_seconds_count") == 2  # one request had one token
        assert _metric(text, "ultratron_time_to_first_token_seconds_bucket", '{le="+Inf"}') == 3
        assert _metric(text, "ultratron_waiting_sequences") == 0 == _metric(text, "ultratron_running_sequences")
        assert _metric(text, "ultratron_kv_cache_usage_ratio") == 0
        # whatever the engine reports in stats() is exported (nested dicts flattened), and its KV and
        # prompt-token counts become the KV gauge and the computed ratio
        server.batcher.engine.stats = lambda: {"prompt_tokens": 400, "computed_tokens": 40, "kv_tokens": 64,
                                               "kv_capacity": 256, "prefix_cache": {"hit_lookups": 7}}
        text = call(url, "/metrics")[1]
        assert _metric(text, "ultratron_engine_prefix_cache_hit_lookups") == 7
        assert _metric(text, "ultratron_engine_computed_tokens") == 40
        assert _metric(text, "ultratron_prompt_tokens_computed_ratio") == 0.1
        assert _metric(text, "ultratron_kv_cache_usage_ratio") == 0.25
        assert _metric(text, "ultratron_requests_total", '{endpoint="/metrics",status="200"}') == 1


def test_health_runs_a_one_token_forward_and_answers_503_with_the_reason(parts):
    model, tokenizer = parts
    with running_server(model, tokenizer, health_timeout=0.3) as (url, server):
        assert call(url, "/health") == (200, "ok")

        def broken(module, args):
            raise RuntimeError("CUDA error: an illegal memory access")

        hook = model.register_forward_pre_hook(broken)
        try:
            status, text = call(url, "/health")
        finally:
            hook.remove()
        assert status == 503 and "RuntimeError" in text and "illegal memory access" in text, text
        release = threading.Event()
        hook = model.register_forward_pre_hook(lambda module, args: release.wait(10))
        try:
            status, text = call(url, "/health")
            assert status == 503 and "did not finish within 0.3 s" in text, text
            status, text = call(url, "/health")  # the stuck forward is not started twice
            assert status == 503 and "has not finished" in text, text
        finally:
            release.set()
            hook.remove()
        time.sleep(0.1)
        assert call(url, "/health") == (200, "ok")
