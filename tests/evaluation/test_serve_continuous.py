"""Continuous batching: a short request that arrives while a 512-token generation runs finishes
first (and the fixed-group policy, for contrast, makes it wait); joining and leaving leave every
sequence's tokens as they would be alone; a full queue answers 429; the tokenizer's chat template."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from ultratron.inference.engine import SamplingParams, Sequence, run_batch
from ultratron.models.llama import Llama, LlamaArgs
from ultratron.serving.batcher import Batcher

from .serving import running_server

LONG = 512


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    args = LlamaArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=300,
                     max_seq_len=LONG + 16)
    return Llama(args).eval()


def _decode(ids):
    return " ".join(map(str, ids))


def _race(model, continuous: bool):
    """Start a 512-token generation, send a short request once it runs; the order they finish in."""
    batcher = Batcher(model, eos_id=0, decode=_decode, max_rows=4, continuous=continuous)
    order, finished = [], threading.Event()
    long = Sequence([1, 2, 3], SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True))
    short = Sequence([7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    batcher.submit([long], lambda err: (order.append(("long", err, len(short.tokens))), finished.set()))
    while len(long.tokens) < 8:  # the long generation is running
        time.sleep(0.001)
    batcher.submit([short], lambda err: order.append(("short", err, len(long.tokens))))
    assert finished.wait(120)
    deadline = time.monotonic() + 60
    while len(order) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    batcher.close()
    return order, long, short, batcher.rows_per_step


def test_a_short_request_finishes_while_a_long_generation_runs(model):
    order, long, short, rows_per_step = _race(model, continuous=True)
    (first, err1, long_tokens_then), (second, err2, _) = order
    assert (first, second) == ("short", "long") and err1 is None and err2 is None
    assert len(short.tokens) == 4 and len(long.tokens) == LONG and long_tokens_then < LONG
    # it joined at a token boundary: each of its 4 tokens came from a step it shared with the long
    # generation, which took no step more than its 512 tokens
    assert rows_per_step[:3] == [0, LONG - 4, 4] and sum(rows_per_step) == LONG
    # joining and leaving the batch changed nobody's tokens: each equals its generation alone
    alone = [Sequence(s.prompt_ids, s.params) for s in (long, short)]
    for seq in alone:
        run_batch(model, [seq], eos_id=0, decode=_decode)
    assert alone[0].token_ids == long.token_ids and alone[1].token_ids == short.token_ids


def test_fixed_groups_make_the_short_request_wait(model):
    order, long, short, rows_per_step = _race(model, continuous=False)
    assert [name for name, _, _ in order] == ["long", "short"]
    assert order[1][2] == LONG  # the short one started only after the long one ended
    assert rows_per_step[:3] == [0, LONG + 4, 0]  # the two never shared a step


def test_rows_leave_and_join_in_any_order(model):
    """Many sequences of mixed lengths through 3 slots: every one equals its solo generation."""
    batcher = Batcher(model, eos_id=0, decode=_decode, max_rows=3)
    seqs = [Sequence([i + 1, 2 * i + 3], SamplingParams(max_tokens=3 + (7 * i) % 11, temperature=0.8, seed=i,
                                                      ignore_eos=True)) for i in range(10)]
    done = threading.Semaphore(0)
    for s in seqs:
        batcher.submit([s], lambda err: done.release())
    for _ in seqs:
        assert done.acquire(timeout=60)
    batcher.close()
    for s in seqs:
        alone = Sequence(s.prompt_ids, s.params)
        run_batch(model, [alone], eos_id=0, decode=_decode)
        assert alone.token_ids == s.token_ids and len(s.tokens) == s.params.max_tokens


# ---- over HTTP ------------------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def http(model, small_corpus):
    """An in-process server with one slot and room for one waiting sequence; its tokenizer has a
    chat template (as an imported model's does)."""
    from ultratron.data.tokenizer import Tokenizer, train_tokenizer

    texts = [p.read_text() for p in sorted(small_corpus.glob("*.py"))[:4]]
    base = train_tokenizer(texts, 300)
    tokenizer = Tokenizer(base.hf, chat_template=TEMPLATE)
    with running_server(model, tokenizer, max_batch_rows=1, max_queue=1) as (url, server):
        yield url, server, tokenizer


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_full_queue_answers_429_and_the_queued_requests_still_finish(http):
    url, server, _ = http
    body = {"model": "ultratron", "prompt": "def f(", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    results = {}
    run = threading.Thread(target=lambda: results.setdefault("running", _post(url, "/v1/completions", body)))
    run.start()
    while not server.batcher.engine.rows:
        time.sleep(0.002)
    queued = threading.Thread(target=lambda: results.setdefault(
        "queued", _post(url, "/v1/completions", {**body, "max_tokens": 3})))
    queued.start()
    while server.batcher.waiting < 1:
        time.sleep(0.002)
    status, text = _post(url, "/v1/completions", {**body, "max_tokens": 2})
    assert status == 429 and json.loads(text)["error"]["code"] == "queue_full"
    status, _ = _post(url, "/v1/completions", {**body, "max_tokens": 2, "stream": True})
    assert status == 429  # a stream is refused before it starts, not mid-way
    run.join(120)
    queued.join(120)
    assert results["running"][0] == 200 and results["queued"][0] == 200
    assert json.loads(results["running"][1])["usage"]["completion_tokens"] == 400
    assert _post(url, "/v1/completions", {**body, "max_tokens": 2})[0] == 200  # room again


def test_the_tokenizers_chat_template_is_used(http):
    url, _, tokenizer = http
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add"}]
    status, text = _post(url, "/tokenize", {"messages": messages})
    assert status == 200
    want = tokenizer.encode("<|system|>Be brief.<|user|>def add<|assistant|>")
    assert json.loads(text)["tokens"] == want
    status, text = _post(url, "/v1/chat/completions", {"model": "ultratron", "messages": messages, "max_tokens": 5,
                                                       "temperature": 0})
    reply = json.loads(text)
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(want)
    info = json.loads(urllib.request.urlopen(url + "/tokenizer_info", timeout=10).read())
    assert info["chat_template"] == TEMPLATE


def test_content_as_text_parts_is_the_string_and_other_parts_are_a_400_naming_them(http):
    url, _, tokenizer = http
    as_string = [{"role": "user", "content": "def add"}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "def "}, {"type": "text", "text": "add"}]}]
    tokens = [json.loads(_post(url, "/tokenize", {"messages": m})[1])["tokens"] for m in (as_string, as_parts)]
    assert tokens[0] == tokens[1] == tokenizer.encode("<|user|>def add<|assistant|>")
    status, text = _post(url, "/v1/chat/completions", {"model": "ultratron", "messages": as_parts, "max_tokens": 2,
                                                       "temperature": 0})
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == len(tokens[0])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    status, text = _post(url, "/v1/chat/completions", {"model": "ultratron", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this"}, image, {"type": "input_audio"}]}]})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "messages"
    assert "image_url" in error["message"] and "input_audio" in error["message"]


def test_a_template_that_raises_is_a_400_and_no_template_is_the_plain_one():
    from ultratron.serving.chat import TemplateError, chat_prompt

    class Tok:
        chat_template = "{{ raise_exception('roles must alternate') }}"
        bos_token, eos_token = None, "</s>"

    with pytest.raises(TemplateError, match="roles must alternate"):
        chat_prompt([{"role": "user", "content": "x"}], Tok())
    Tok.chat_template = None
    assert chat_prompt([{"role": "user", "content": "x"}], Tok()) == "### User\nx\n\n### Assistant\n"
    assert chat_prompt([{"role": "user", "content": "x"}]) == "### User\nx\n\n### Assistant\n"  # no tokenizer
    # an earlier answer ends with the end-of-text token, as the model was trained on it (data/chat.py)
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
               {"role": "user", "content": "z"}]
    assert chat_prompt(history, Tok()) == "### User\nx\n\n### Assistant\ny</s>\n\n### User\nz\n\n### Assistant\n"
    # the default template written out by an export and read back by an import is still the default
    from ultratron.serving.chat import CHAT_STOP, DEFAULT_CHAT_TEMPLATE, chat_stops

    assert chat_stops(Tok()) == (CHAT_STOP,)
    Tok.chat_template = DEFAULT_CHAT_TEMPLATE
    assert chat_stops(Tok()) == (CHAT_STOP,) and chat_prompt(history, Tok()).endswith("### Assistant\n")
    Tok.chat_template = "{{ messages[0]['content'] }}"
    assert chat_stops(Tok()) == ()


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(model):
    from ultratron.errors import ConfigError
    from ultratron.serving.batcher import check_kv_memory
    from ultratron.serving.server import Server, ServerLimits

    assert check_kv_memory(model, 4 * 100) == 2 * 2 * 4 * 2 * 100 * 8 * 4  # K and V, layers, positions, kv heads, dim
    assert check_kv_memory(model, 4 * 100 + 15) == check_kv_memory(model, 4 * 100)  # whole blocks of 16, within
    with pytest.raises(ConfigError, match="KV cache of 52800000000 tokens needs .* lower --kv-cache-tokens"):
        check_kv_memory(model, 10**8 * (LONG + 16))

    class Tok:
        eos_id, decode = 0, staticmethod(_decode)

    server = Server(model, Tok(), limits=ServerLimits(max_batch_rows=2, max_model_len=64))
    assert server.context == 64 and server.batcher.engine.cache.capacity == 64
    server.batcher.close()


@pytest.mark.parametrize("rows", [1, 8])
def test_max_batch_bounds_the_sequences_generated_together(model, rows):
    """`--max-batch` (the KV-cache slots): eight 6-token sequences queued at once take 6 engine steps
    of 8 sequences each with 8 slots (they run together) and 48 of one with 1 slot (one after
    another), with the same tokens."""
    batcher = Batcher(model, eos_id=0, decode=_decode, max_rows=rows)
    seqs = [Sequence([5 + i, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for i in range(8)]
    done = threading.Semaphore(0)
    batcher.submit(seqs, lambda err: done.release())
    assert done.acquire(timeout=120)
    rows_per_step = batcher.rows_per_step
    batcher.close()
    alone = [Sequence([5 + i, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for i in range(8)]
    for seq in alone:
        run_batch(model, [seq], eos_id=0, decode=_decode)
    assert [[t.id for t in s.tokens] for s in seqs] == [[t.id for t in s.tokens] for s in alone]
    assert rows_per_step == ([0] * 8 + [6] if rows == 8 else [0, 8 * 6])


def test_a_prefill_forward_that_fails_fails_its_prompts_and_the_worker_serves_on(model, monkeypatch):
    """An error raised inside a prefill forward (a ValueError, as the KV cache raises, not a prompt
    the engine refuses before queueing it) fails the prompts that were prefilling, leaves the
    engine's queue and blocks empty, and the next request is served; a refused prompt fails alone."""
    batcher = Batcher(model, eos_id=0, decode=_decode, max_rows=4)
    engine, real = batcher.engine, batcher.engine._forward
    calls = []

    def forward(chosen):
        calls.append(len(chosen))
        if len(calls) == 1:
            raise ValueError("the forward broke")
        return real(chosen)

    monkeypatch.setattr(engine, "_forward", forward)
    answers, done = [], threading.Semaphore(0)

    def submit(seqs):
        batcher.submit(seqs, lambda err: (answers.append(err), done.release()))
        assert done.acquire(timeout=60)
        return answers[-1]

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    err = submit([Sequence([3, 4, 5], params), Sequence([3, 4, 6], params)])
    assert isinstance(err, ValueError) and "the forward broke" in str(err)
    assert not engine.queue and not engine.rows and engine.cache.free_blocks == engine.cache.n_blocks
    assert "prompt of 600 tokens" in str(submit([Sequence([5] * 600, params)]))  # refused: longer than the cache
    ok = Sequence([3, 4, 5], params)
    assert submit([ok]) is None and len(ok.tokens) == 2 and batcher.alive
    batcher.close()
