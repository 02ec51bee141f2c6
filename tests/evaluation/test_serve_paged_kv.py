"""The paged KV cache (inference/paged_kv.py): memory follows the tokens held, outputs do not change.

- one forward: a paged view gives bitwise the logits a slot view gives, for ragged rows and a decode step;
- engine: a random workload (ragged prompts, completions up to 40 tokens, echo) on a pool far smaller
  than slots × context: after every admit and step no block is in two tables, every row holds the
  blocks its length needs, the blocks in use never exceed the pool and the pool's bytes never exceed
  the budget; prompts waited for blocks and rows were preempted, and every token, prompt
  log-probability and completion log-probability is what a pool that never runs short gives (greedy
  tokens identical, log-probabilities within PAGED_KV); with the default pool (slots × context)
  nothing waits or is preempted and they are bitwise equal to the slot engine's;
- short sequences: a pool the size of 4 slots runs 16 short sequences at once;
- a sequence longer than the whole pool is refused (engine: ValueError; server: 400), while one that
  fits but must wait for blocks is served (batcher, no hang).
"""

import random
import threading

import pytest
import torch

from tolerances import PAGED_KV
from ultratron.inference.engine import Engine, SamplingParams, Sequence, run_batch
from ultratron.inference.kv_cache import SlotCache
from ultratron.inference.paged_kv import PagedCache
from ultratron.models.llama import Llama, LlamaArgs
from ultratron.serving.batcher import Batcher

from .serving import call, running_server

VOCAB = 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Llama(LlamaArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB,
                           max_seq_len=96)).eval().requires_grad_(False)


def _decode(ids):
    return " ".join(map(str, ids))


def test_a_paged_view_gives_the_slot_views_logits_bitwise(model):
    prompts = [[3, 5, 7, 9, 11, 2] * 4, [4, 8], [1, 2, 3, 4] * 5]  # 24 tokens: past a block of 16
    padded = torch.tensor([p + [0] * (24 - len(p)) for p in prompts])
    outs = []
    for cache in (SlotCache(model, 4, 64), PagedCache(model, 4, 64, tokens=128, block=16)):
        if isinstance(cache, PagedCache):
            cache.grow(3, 5)  # slot 3 takes block 0: the rows' blocks are not 0, 1, 2 in order
            for slot, p in zip((1, 0, 2), prompts, strict=True):
                cache.grow(slot, len(p) + 1)
        view = cache.at([1, 0, 2])
        logits = model(padded, view)
        view.advance(torch.tensor([len(p) for p in prompts]))
        step = model(torch.tensor([[10], [20], [30]]), view)
        outs.append((logits, step))
    (slot_logits, slot_step), (paged_logits, paged_step) = outs
    for i, p in enumerate(prompts):  # padded positions are garbage either way: only real ones compared
        assert torch.equal(paged_logits[i, :len(p)], slot_logits[i, :len(p)])
    assert torch.equal(paged_step, slot_step)


def _requests(seed: int, n: int):
    rng = random.Random(seed)
    stem = [rng.randrange(VOCAB) for _ in range(20)]  # a shared start: the prefix cache serves it
    out = []
    for _ in range(n):
        prompt = stem[:rng.randrange(0, 20)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        echo = rng.randrange(2) == 1  # half of them
        out.append((prompt, {"max_tokens": rng.choice([1, 5, 20, 40]), "temperature": 0, "echo": echo,
                             "logprobs": 2}))
    return out


def _check_pool(model, cache: PagedCache, budget_tokens: int) -> None:
    tables = [b for s in range(cache.slots) for b in cache.table[s, :cache.held[s]].tolist()]
    assert len(tables) == len(set(tables)) and not set(tables) & set(cache._free)  # no block in two places
    assert len(tables) + cache.free_blocks == cache.n_blocks
    for s in range(cache.slots):
        assert cache.held[s] >= cache.blocks_for(int(cache.lengths[s]))
    assert cache.nbytes <= PagedCache.bytes_needed(model, budget_tokens)


def _run(model, requests, **options):
    engine = Engine(model, -1, _decode, slots=6, capacity=96, **options)
    seqs = [Sequence(list(p), SamplingParams(**kw)) for p, kw in requests]
    waiting, most_running = list(seqs), 0
    budget = options.get("kv_cache_tokens") or 6 * 96
    while waiting or engine.busy:
        take = min(engine.free, len(waiting), random.Random(len(waiting)).randint(1, 4))
        batch, waiting = waiting[:take], waiting[take:]
        if batch or engine.queue:
            engine.admit(batch)
            _check_pool(model, engine.cache, budget)
        if engine.rows:
            engine.step()
            _check_pool(model, engine.cache, budget)
        most_running = max(most_running, len(engine.rows))
    return seqs, engine


def _logprobs(seq):
    return [t.logprob for t in seq.prompt_tokens[1:]] + [t.logprob for t in seq.tokens]


def test_a_small_pool_bounds_memory_and_changes_no_output(model):
    requests = _requests(0, 60)
    full, full_engine = _run(model, requests, prefix_cache_tokens=64)
    assert full_engine.preempted == 0 and full_engine.prefill.recomputed_tokens == 0
    small, engine = _run(model, requests, prefix_cache_tokens=64, kv_cache_tokens=128, max_batched_tokens=32)
    stats = engine.stats()
    assert stats["kv_capacity"] == 128 and stats["kv_peak_blocks"] == 8  # the whole pool was used, no more
    assert engine.cache.nbytes == PagedCache.bytes_needed(model, 128) == 128 * 2 * 2 * 2 * 8 * 4
    assert stats["preempted"] > 0 and stats["recomputed_tokens"] > 0  # the pool ran short: rows gave way
    assert full_engine.stats()["kv_peak_blocks"] > 8  # the same work, unbounded, held more
    gaps = []
    for a, b in zip(full, small, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "length"
        assert [t.id for t in a.prompt_tokens] == [t.id for t in b.prompt_tokens]
        assert [[i for i, _ in t.top or []] for t in a.tokens] == [[i for i, _ in t.top or []] for t in b.tokens]
        gaps += [abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b), strict=True)]
    assert max(gaps) <= PAGED_KV


def test_the_default_pool_matches_the_whole_context_forward(model):
    """With the default pool (slots × context, what the slots reserved) nothing waits for blocks and
    nothing is preempted; every greedy token is the uncached whole-context forward's argmax and every
    log-probability (echoed prompt, completion) within PAGED_KV of its log-softmax."""
    requests = _requests(1, 12)
    seqs, engine = _run(model, requests)
    assert engine.roomy and engine.preempted == 0 and engine.cache.free_blocks == engine.cache.n_blocks == 6 * 96 // 16
    for seq in seqs:
        ids = seq.prompt_ids + seq.token_ids
        with torch.no_grad():
            full = torch.log_softmax(model(torch.tensor([ids])), -1)[0]
        n = len(seq.prompt_ids)
        assert seq.token_ids == [int(full[t - 1].argmax()) for t in range(n, len(ids))]
        want = [float(full[t - 1, ids[t]]) for t in range(1 if seq.params.echo else n, len(ids))]
        got = _logprobs(seq)
        assert len(got) == len(want) and max(abs(g - w) for g, w in zip(got, want, strict=True)) <= PAGED_KV


def test_short_sequences_run_more_at_once_than_slots_would(model):
    """A pool of 4 × 96 positions is what 4 slots of the 96-position context reserve; sequences of
    9 positions take one 16-position block each, so all 16 run in the same steps."""
    engine = Engine(model, -1, _decode, slots=16, capacity=96, kv_cache_tokens=4 * 96)
    seqs = [Sequence([i % VOCAB, 3, 5, 7, 9], SamplingParams(max_tokens=4, temperature=0)) for i in range(16)]
    engine.admit(seqs)
    assert len(engine.rows) == 16 and engine.cache.n_blocks - engine.cache.free_blocks == 16
    steps = 0
    while engine.rows:
        engine.step()
        steps += 1
    assert steps == 4 and all(len(s.tokens) == 4 for s in seqs)
    assert engine.cache.free_blocks == engine.cache.n_blocks == 24  # every block back in the pool


def test_a_sequence_longer_than_the_pool_is_refused_and_one_that_fits_waits(model):
    engine = Engine(model, -1, _decode, slots=4, capacity=96, kv_cache_tokens=48)
    with pytest.raises(ValueError, match="exceeds the KV cache of 48 tokens"):
        engine.admit([Sequence(list(range(30)), SamplingParams(max_tokens=19))])
    assert not engine.busy and engine.cache.free_blocks == 3
    # four requests of 40 positions each on a 48-position pool: one at a time, all served, as alone
    batcher = Batcher(model, eos_id=-1, decode=_decode, max_rows=4, capacity=96, kv_cache_tokens=48)
    seqs = [Sequence([i, 1, 2, 3] * 5, SamplingParams(max_tokens=20, temperature=0)) for i in range(4)]
    done = threading.Semaphore(0)
    errors = []
    for s in seqs:
        batcher.submit([s], lambda err: (errors.append(err), done.release()))
    for _ in seqs:
        assert done.acquire(timeout=120)
    batcher.close()
    assert errors == [None] * 4 and batcher.stats()["engine"]["kv_peak_blocks"] <= 3
    for s in seqs:
        alone = Engine(model, -1, _decode, slots=1, capacity=96)
        ref = Sequence(list(s.prompt_ids), SamplingParams(max_tokens=20, temperature=0))
        alone.admit([ref])
        while alone.rows:
            alone.step()
        assert s.token_ids == ref.token_ids


def test_the_server_answers_400_for_a_request_longer_than_its_pool(model):
    class Tok:
        eos_id = 0

        @staticmethod
        def decode(ids):
            return _decode(ids)

    with running_server(model, Tok(), max_batch_rows=4, kv_cache_tokens=32) as (url, server):
        status, body = call(url, "/v1/completions", {"model": "ultratron", "prompt": list(range(20)),
                                                     "max_tokens": 13})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert "KV cache holds 32 tokens" in body["error"]["message"]
        status, body = call(url, "/v1/completions", {"model": "ultratron", "prompt": list(range(20)),
                                                     "max_tokens": 12, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 12
        assert server.batcher.kv_tokens == 32


def test_the_request_that_joined_last_is_preempted_not_the_last_row(model):
    """A, B and C join in that order, one block each, and fill a 3-block pool. A ends after one token
    and C moves into its slot, so the rows are [C, B]; both need a block and one is free: C, the
    newest, gives way (as vLLM preempts), not B, the last row. Both finish with their own tokens."""
    engine = Engine(model, -1, _decode, slots=3, capacity=96, kv_cache_tokens=48)
    a, b, c = (Sequence(list(p), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
               for p, n in (([3] * 8, 1), ([4] * 16, 8), ([5] * 16, 8)))
    engine.admit([a, b, c])
    assert [r.seq for r in engine.rows] == [a, b, c] and engine.cache.free_blocks == 0
    engine.step()
    assert a.finish_reason == "length" and engine.preempted == 1
    assert [r.seq for r in engine.rows] == [b] and [p.seq for p in engine.queue] == [c]
    while engine.busy:
        if engine.queue:
            engine.admit([])
        engine.step()
    for seq in (b, c):
        alone = Sequence(seq.prompt_ids, seq.params)
        run_batch(model, [alone], -1, _decode)
        assert seq.token_ids == alone.token_ids and len(seq.tokens) == 8
