"""Perplexity filter: a briefly trained tiny ultratron model keeps prose and drops gibberish."""

from __future__ import annotations

import json
import random

import pytest

from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_stage
from ultratron.curation.stages.perplexity import ModelScorer, cutoff

WORDS = ("the and of to with that river mountain garden window letter morning evening village teacher "
         "student market harbor winter summer bridge castle forest meadow").split()


def prose(rng: random.Random) -> str:
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(9)).capitalize() + "." for _ in range(6))


def gibberish(rng: random.Random) -> str:
    return " ".join("".join(rng.choice("qxzjkvwy0123456789#%&") for _ in range(rng.randint(3, 9)))
                    for _ in range(50))


@pytest.fixture(scope="module")
def scorer():
    torch = pytest.importorskip("torch")
    from ultratron.config import ModelConfig, resolve_model
    from ultratron.data.tokenizer import train_tokenizer
    from ultratron.models.registry import build_model

    torch.manual_seed(0)
    rng = random.Random(0)
    train_texts = [prose(rng) for _ in range(200)]
    tokenizer = train_tokenizer(train_texts, vocab_size=320)
    model_cfg = ModelConfig(preset="tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128,
                            vocab_size=tokenizer.vocab_size, max_seq_len=64)
    resolve_model(model_cfg)
    model = build_model(model_cfg)
    stream = [t for text in train_texts for t in tokenizer.encode(text) + [tokenizer.eos_id]]
    data = torch.tensor(stream[: (len(stream) // 65) * 65]).view(-1, 65)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _step in range(40):  # a brief training run: enough to tell prose from noise
        batch = data[torch.randint(0, len(data), (16,))]
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).transpose(1, 2), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ModelScorer(model, tokenizer, max_tokens=64, batch_size=8)


def test_percentile_keeps_prose_and_drops_gibberish(tmp_path, scorer):
    rng = random.Random(1)
    docs = [{"id": f"prose{i}", "text": prose(rng)} for i in range(10)]
    docs += [{"id": f"noise{i}", "text": gibberish(rng)} for i in range(10)]
    rng.shuffle(docs)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = from_dict({"pipeline": {"progress": False}, "perplexity": {"keep_percentile": 50}})
    summary = run_stage("perplexity", cfg, src, tmp_path / "out", scorer=scorer)
    kept = [json.loads(line) for line in (tmp_path / "out" / "in.jsonl").read_text().splitlines()]
    assert sorted(d["id"] for d in kept) == sorted(f"prose{i}" for i in range(10))
    assert summary["removed"] == {"perplexity": 10}
    assert all(d["perplexity"] <= summary["cutoff"] for d in kept)
    assert max(d["perplexity"] for d in kept) == summary["cutoff"]  # the cutoff is the 10th score, kept as is


def test_kept_and_removed_scores_are_the_exact_ones_compared(tmp_path):
    docs = [{"id": str(i), "text": "y" * (i + 1)} for i in range(4)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = from_dict({"pipeline": {"progress": False}, "perplexity": {"keep_percentile": 50}})
    summary = run_stage("perplexity", cfg, src, tmp_path / "out", scorer=lambda texts: [len(t) / 3 for t in texts])
    kept = [json.loads(line) for line in (tmp_path / "out" / "in.jsonl").read_text().splitlines()]
    assert [d["perplexity"] for d in kept] == [1 / 3, 2 / 3] and summary["cutoff"] == 2 / 3
    removed = [json.loads(line) for line in (tmp_path / "out" / "_decisions" / "in.jsonl").read_text().splitlines()
               if json.loads(line)["decision"] == "removed"]
    assert [d["detail"] for d in removed] == [1.0, 4 / 3]


def test_absolute_threshold_with_any_callable(tmp_path):
    docs = [{"id": str(i), "text": "x" * (i + 1)} for i in range(6)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = from_dict({"pipeline": {"progress": False}, "perplexity": {"max_perplexity": 30.0}})
    summary = run_stage("perplexity", cfg, src, tmp_path / "out", scorer=lambda texts: [10.0 * len(t) for t in texts])
    kept = [json.loads(line)["id"] for line in (tmp_path / "out" / "in.jsonl").read_text().splitlines()]
    assert kept == ["0", "1", "2"] and summary["removed"] == {"perplexity": 3}


def test_cutoff_rules():
    assert cutoff([5, 1, 3, 2, 4], 0, 40) == 2
    assert cutoff([5, 1, 3, 2, 4], 2.5, 80) == 2.5  # the stricter of the two wins
    assert cutoff([5, 1], 0, 0) == float("inf")
