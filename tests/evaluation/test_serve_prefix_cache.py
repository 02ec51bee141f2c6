"""The prefix cache changes nothing a client sees, only what is computed.

- engine: 200 random requests (shared prefixes of random lengths, echo or not, logprobs 0..5,
  max_tokens 0..3), fed in random groups, with a small cache and a small token budget (so blocks
  are evicted and long prompts prefilled in chunks): every token, prompt log-probability and top
  alternative as without the cache, and the cache's bytes never over its budget;
- server: `eval --endpoint`'s scoring (the built-in suite and a 5-shot multiple-choice file)
  against a server with the cache and one without: acc, acc_norm and greedy text identical,
  every echoed token_logprob and top_logprobs entry within PREFIX_CACHE, and the share of prompt
  tokens computed at most 0.40 (next line) and 0.10 (5-shot).
"""

import json
import random

import pytest
import torch

from tolerances import PREFIX_CACHE
from ultratron.inference.engine import Engine, SamplingParams, Sequence
from ultratron.models.llama import Llama, LlamaArgs

from .serving import call, running_server

VOCAB = 40


def _decode(ids):
    return " ".join(map(str, ids))


def _drain(engine, groups):
    """Admit each group as slots free up, stepping in between; yields after every admit and step."""
    waiting = [s for g in groups for s in g]
    while waiting or engine.busy:
        take = min(engine.free, len(waiting), random.Random(len(waiting)).randint(1, 8))
        batch, waiting = waiting[:take], waiting[take:]
        engine.admit(batch) if batch or engine.queue else None
        yield
        if engine.rows:
            engine.step()
            yield


def _random_requests(rng: random.Random, n: int) -> list[tuple[list[int], dict]]:
    # stems made of shared pieces of 8 or 16 tokens: the same tokens recur after other prefixes, on
    # block boundaries too, as in code and prose (a block must be told apart by its prefix)
    pieces = [[rng.randrange(VOCAB) for _ in range(rng.choice([8, 16]))] for _ in range(4)]
    stems = [sum((rng.choice(pieces) for _ in range(rng.randrange(1, 5))), []) for _ in range(6)]
    out = []
    for _ in range(n):
        stem = rng.choice(stems)
        prompt = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
        echo = rng.randrange(10) < 7  # 70 %
        out.append((prompt, {"max_tokens": rng.choice([0, 1, 3]), "temperature": 0, "echo": echo,
                             "logprobs": rng.choice([None, 0, 1, 5]) if echo else None}))
    return out


def test_random_workload_matches_no_cache_and_stays_within_budget():
    torch.manual_seed(0)
    model = Llama(LlamaArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB,
                            max_seq_len=96)).eval()
    requests = _random_requests(random.Random(0), 200)
    runs = {}
    for name, options in (("off", {}), ("on", {"prefix_cache_tokens": 200, "max_batched_tokens": 24})):
        engine = Engine(model, -1, _decode, slots=6, capacity=96, **options)
        seqs = [Sequence(list(p), SamplingParams(**kw)) for p, kw in requests]
        groups = [seqs[i:i + 8] for i in range(0, len(seqs), 8)]
        for _ in _drain(engine, groups):
            if engine.prefix is not None:
                prefix = engine.prefix
                assert prefix.bytes <= prefix.budget_bytes
                assert prefix.bytes == sum(prefix.nbytes(b) for b in prefix.blocks.values())
                assert prefix.tokens == sum(len(b.tokens) for b in prefix.blocks.values())
        runs[name] = (seqs, engine.stats())
    (off, _), (on, stats) = runs["off"], runs["on"]
    cache = stats["prefix_cache"]
    assert cache["evicted_blocks"] > 0 and stats["cached_tokens"] > 0  # the budget bound, and the cache served
    assert stats["prompt_tokens"] == sum(len(p) for p, _ in requests)
    worst = 0.0
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert len(a.prompt_tokens) == len(b.prompt_tokens)
        for x, y in zip(a.prompt_tokens, b.prompt_tokens, strict=True):
            assert x.id == y.id and (x.logprob is None) == (y.logprob is None)
            if x.logprob is not None:
                worst = max(worst, abs(x.logprob - y.logprob))
            assert (x.top is None) == (y.top is None)
            if x.top is not None:
                assert [i for i, _ in x.top] == [i for i, _ in y.top]
                worst = max(worst, *(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top, strict=True)))
    print(f"prefix cache on vs off: worst |logprob difference| {worst:.1e}; computed "
          f"{stats['computed_tokens']}/{stats['prompt_tokens']} prompt tokens; {cache}")
    assert worst <= PREFIX_CACHE


# ---- through the server ------------------------------------------------------------------------

SHOTS = [("def add(a, b):", " return a + b"), ("def sub(a, b):", " return a - b"),
         ("def mul(a, b):", " return a * b"), ("def neg(a):", " return -a"), ("def same(a):", " return a")]
QUESTIONS = [("def double(a):", [" return 2 * a", " return a", " return a - 2", " pass"], 0),
             ("def half(a):", [" return a + 2", " return a / 2", " return 2", " return None"], 1),
             ("def square(a):", [" return a", " return a - a", " return a * a", " return 0"], 2),
             ("def first(a):", [" return a[1]", " return a[-1]", " return len(a)", " return a[0]"], 3),
             ("def last(a):", [" return a[-1]", " return a[0]", " return a", " return 1"], 0),
             ("def size(a):", [" return 0", " return len(a)", " return a", " return a[0]"], 1),
             ("def empty(a):", [" return 1", " return a", " return not a", " return a[0]"], 2),
             ("def inc(a):", [" return a", " return a - 1", " return 0", " return a + 1"], 3)]


def five_shot_file(path) -> str:
    """An lm-eval-style multiple-choice file: the same five examples before every question."""
    shots = "".join(f"{q}\n{a}\n\n" for q, a in SHOTS)
    with open(path, "w") as f:
        for q, choices, gold in QUESTIONS:
            f.write(json.dumps({"query": f"{shots}{q}\n", "choices": [c.strip() for c in choices], "gold": gold})
                    + "\n")
    return str(path)


def _engine_counts(server) -> tuple[int, int]:
    stats = server.batcher.engine.stats()
    return stats["computed_tokens"], stats["prompt_tokens"]


@pytest.fixture(scope="module")
def two_servers(trained_checkpoint):
    """The trained weights with a 512-token context (positions past 128 untrained): in 128 tokens the
    client cuts each choice's next-line context at another line (`fit_context`), so the four prompts
    of a question would share nothing to cache (0.44 of their tokens are distinct there)."""
    import dataclasses

    from ultratron.checkpoint.inference import load_for_inference

    loaded = load_for_inference(str(trained_checkpoint), "cpu")
    model = Llama(dataclasses.replace(loaded.model.args, max_seq_len=512)).eval().requires_grad_(False)
    model.load_state_dict(loaded.model.state_dict())
    with running_server(model, loaded.tokenizer, prefix_cache_tokens=0) as off, \
            running_server(model, loaded.tokenizer, prefix_cache_tokens=32768) as on:
        yield loaded.tokenizer, {"off": off, "on": on}


def _evaluate(url, tasks):
    from ultratron.evaluation.backends import EndpointBackend
    from ultratron.evaluation.runner import evaluate

    backend = EndpointBackend(url + "/v1", "ultratron", concurrency=4, timeout=120)
    return evaluate(backend, tasks, max_examples=16, details=True)


@pytest.mark.parametrize("which", ["builtin", "five_shot"])
def test_endpoint_scores_identical_with_the_cache_and_its_computed_share(two_servers, which, tmp_path):
    from ultratron.evaluation.builtin import resolve_tasks

    tokenizer, servers = two_servers
    if which == "builtin":
        tasks = resolve_tasks("builtin_next_line,builtin_identifier_cloze,builtin_arithmetic", 0.1)
        share_task, bound = "builtin_next_line", 0.40
    else:
        tasks = resolve_tasks(five_shot_file(tmp_path / "five_shot.jsonl"))
        share_task, bound = tasks[0].name, 0.10
    results, shares = {}, {}
    for name, (url, server) in servers.items():
        results[name] = {}
        for task in tasks:
            before = _engine_counts(server)
            results[name].update(_evaluate(url, [task]))
            after = _engine_counts(server)
            shares[name, task.name] = (after[0] - before[0]) / max(after[1] - before[1], 1)
    for task in tasks:
        off, on = results["off"][task.name], results["on"][task.name]
        for key in ("acc", "acc_norm", "exact_match", "outputs"):
            assert off.get(key) == on.get(key), (task.name, key)
        for x, y in zip(off.get("loglikelihoods", []), on.get("loglikelihoods", []), strict=True):
            assert max(abs(p - q) for p, q in zip(x, y, strict=True)) <= PREFIX_CACHE * 64  # a sum of ≤ 64 terms
    print(f"{which}: prompt tokens computed / total with the cache: "
          f"{ {t: round(shares['on', t], 3) for t in (t.name for t in tasks)} }")
    assert shares["off", share_task] == 1.0
    assert shares["on", share_task] <= bound

    # every echoed entry, token ids in and five alternatives out, eight prompts a request (as lm-eval)
    task = next(t for t in tasks if t.name == share_task)
    prompts = [tokenizer.encode(ex.context + " " + c) for ex in task.examples[:4] for c in ex.choices]
    body = {"model": "ultratron", "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 5}
    answers = {name: [call(url, "/v1/completions", {**body, "prompt": prompts[i:i + 8]})
                      for i in range(0, len(prompts), 8)] for name, (url, _) in servers.items()}
    for a, b in zip(answers["off"], answers["on"], strict=True):
        assert a[0] == b[0] == 200
        for x, y in zip(a[1]["choices"], b[1]["choices"], strict=True):
            lx, ly = x["logprobs"], y["logprobs"]
            assert lx["tokens"] == ly["tokens"] and x["text"] == y["text"]
            for p, q in zip(lx["token_logprobs"], ly["token_logprobs"], strict=True):
                assert (p is None and q is None) or abs(p - q) <= PREFIX_CACHE
            for p, q in zip(lx["top_logprobs"], ly["top_logprobs"], strict=True):
                assert (p is None and q is None) or (p.keys() == q.keys() and
                                                     all(abs(p[k] - q[k]) <= PREFIX_CACHE for k in p))


def test_the_output_head_runs_only_where_a_distribution_is_needed():
    """Without echo only a prompt's last position goes through the output head (and log-softmax);
    with echo every position; a prompt longer than the token budget is prefilled in chunks."""
    torch.manual_seed(0)
    model = Llama(LlamaArgs(n_layers=1, dim=16, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=VOCAB,
                            max_seq_len=64)).eval()
    rows = []
    head = model.head
    model.head = lambda hidden: rows.append(hidden.shape[0]) or head(hidden)
    engine = Engine(model, -1, _decode, slots=2, capacity=64, max_batched_tokens=16)
    plain = Sequence([i % VOCAB for i in range(1, 41)], SamplingParams(max_tokens=0, temperature=0))
    for _ in _drain(engine, [[plain]]):
        pass
    assert rows == [1]  # 40 prompt tokens in chunks of 16, 16 and 8: the head once, on the last
    rows.clear()
    echo = Sequence([i % VOCAB for i in range(1, 41)], SamplingParams(max_tokens=0, temperature=0, echo=True))
    for _ in _drain(engine, [[echo]]):
        pass
    assert rows == [16, 16, 8] and len(echo.prompt_tokens) == 40


@pytest.mark.parametrize("window", [0, 8])
def test_prompts_that_share_a_context_are_computed_in_one_forward(window):
    """Four choices after one 21-token context, admitted together: with the cache they are forwarded
    as one tree (the first whole, the other three from where they fork, one position before their
    first own token), in one forward instead of two; a sliding-window model, whose mask a packed row
    would renumber, keeps two (the three wait for the first and reuse its cached blocks). Either way
    every echoed log-probability and top alternative is the cache-off engine's, and so are the four
    greedy tokens each then generates from the keys and values the three were given."""
    torch.manual_seed(0)
    model = Llama(LlamaArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB,
                            max_seq_len=64, sliding_window=window)).eval()
    context = [(7 * i + 3) % VOCAB for i in range(21)]
    tails = [[1, 2, 3], [4, 2], [1, 2, 5, 6], [9]]  # the third shares two more tokens with the first
    forwards = []
    forward = model.forward
    model.forward = lambda tokens, cache=None: forwards.append(tokens.shape) or forward(tokens, cache)
    runs = {}
    for name, options in (("off", {}), ("on", {"prefix_cache_tokens": 256})):
        engine = Engine(model, -1, _decode, slots=4, capacity=64, **options)
        seqs = [Sequence(context + t, SamplingParams(max_tokens=4, temperature=0, echo=True, logprobs=2))
                for t in tails]
        forwards.clear()
        engine.admit(seqs)
        admitted = list(forwards)
        while engine.busy:
            engine.step()
        runs[name] = (seqs, engine.stats(), admitted)
    (off, _, off_forwards), (on, stats, on_forwards) = runs["off"], runs["on"]
    assert len(off_forwards) == 1
    if window:
        assert len(on_forwards) == 2 and stats["packed"] == 0
    else:  # one row: the first's 24 tokens, then 3, 3 and 2 (each from one before its first own token)
        assert on_forwards == [torch.Size([1, 24 + 3 + 3 + 2])] and stats["packed"] == 3
        assert stats["computed_tokens"] == 32 and stats["cached_tokens"] == 20 + 22 + 20
    worst = 0.0
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 4
        for x, y in zip(a.prompt_tokens + a.tokens, b.prompt_tokens + b.tokens, strict=True):
            assert x.id == y.id and [i for i, _ in x.top or []] == [i for i, _ in y.top or []]
            if x.logprob is not None:
                tops = zip(x.top, y.top, strict=True)
                worst = max(worst, abs(x.logprob - y.logprob), *(abs(p - q) for (_, p), (_, q) in tops))
    assert worst <= PREFIX_CACHE
