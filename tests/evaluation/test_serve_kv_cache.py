"""The KV-cache generator gives what recomputing the whole context gives."""

import torch

from ultratron.inference.engine import SamplingParams, Sequence, run_batch
from ultratron.inference.kv_cache import SlotCache
from ultratron.models.llama import Llama, LlamaArgs
from ultratron.models.sampling import generate


def _model(**kw):
    torch.manual_seed(0)
    args = LlamaArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=48, **kw)
    return Llama(args).eval()


def test_cached_forward_matches_full_forward_for_ragged_rows():
    model = _model()
    prompts = [[3, 5, 7, 9, 11, 2], [4, 8], [1, 2, 3, 4]]
    cache = SlotCache(model, len(prompts) + 1, 16).rows(1, len(prompts) + 1)  # slot 0 left alone
    padded = torch.tensor([p + [0] * (6 - len(p)) for p in prompts])
    with torch.no_grad():
        logits = model(padded, cache)
        cache.advance(torch.tensor([len(p) for p in prompts]))
        step = model(torch.tensor([[10], [20], [30]]), cache)
        assert cache.cache.lengths.tolist() == [0, 6, 2, 4]
        for i, p in enumerate(prompts):
            full = model(torch.tensor([p + [(10, 20, 30)[i]]]))
            assert torch.allclose(logits[i, : len(p)], full[0, : len(p)], atol=1e-5)
            assert torch.allclose(step[i, 0], full[0, -1], atol=1e-5)


def test_greedy_batch_equals_uncached_generate_and_softcap_path():
    moe = {"n_experts": 4, "n_active_experts": 2, "expert_ffn_dim": 32, "n_shared_experts": 1}  # serves as is
    window = {"sliding_window": 4, "sliding_window_pattern": 2}  # the cache keeps every key; the mask the window
    for kw in ({}, {"attn_softcap": 20.0, "qk_norm": True}, moe, window):
        model = _model(**kw)
        prompts = [[3, 5, 7], [9, 1, 4, 4, 2, 8, 6], [12]]
        seqs = [Sequence(p, SamplingParams(max_tokens=10, temperature=0, logprobs=2, echo=True)) for p in prompts]
        run_batch(model, seqs, eos_id=-1, decode=lambda ids: " ".join(map(str, ids)))
        for p, s in zip(prompts, seqs, strict=True):
            assert s.token_ids == generate(model, p, 10, temperature=0)
            assert s.finish_reason == "length" and len(s.prompt_tokens) == len(p)
            # the reported logprob is the model's log-softmax at that position
            with torch.no_grad():
                full = torch.log_softmax(model(torch.tensor([p + s.token_ids[:1]])), -1)[0]
            for t in range(1, len(p)):
                assert abs(s.prompt_tokens[t].logprob - float(full[t - 1, p[t]])) < 1e-5
            assert abs(s.tokens[0].logprob - float(full[len(p) - 1, s.token_ids[0]])) < 1e-5
            assert s.tokens[0].top[0][0] == s.token_ids[0]


def test_seeded_sampling_repeats_and_stop_strings_cut_text():
    model = _model()
    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)
    runs = []
    for _ in range(2):
        seq = Sequence([1, 2, 3], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7))
        runs.append(run_batch(model, [seq], eos_id=-1, decode=decode)[0].token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 12
    text = decode(runs[0])
    stop = text[4:6]
    pieces = []
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, stop=(stop,)),
                   on_text=lambda s, piece: pieces.append(piece))
    run_batch(model, [seq], eos_id=-1, decode=decode)
    assert seq.text == text[: text.find(stop)] and seq.finish_reason == "stop"
    assert "".join(pieces) == seq.text
