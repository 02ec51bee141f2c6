"""The tokenize stage encodes in batches: tokens equal one-at-a-time encoding (with the
tokenizer's offset-tracking `encode`, not the batch path under test), the decision log keeps
input order with malformed lines between and across batches, and the audit samples ≤ its byte cap."""

from __future__ import annotations

import json
import random

from ultratron.curation import frame
from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_stage
from ultratron.curation.stages import tokenize
from ultratron.data.tokenizer import Tokenizer


def test_batched_tokenize_matches_single_encoding_and_keeps_order(tmp_path, monkeypatch):
    monkeypatch.setattr(frame, "BATCH_DOCS", 4)  # several batches in a 13-document part
    monkeypatch.setattr(tokenize, "AUDIT_SAMPLE_BYTES", 500)  # the audit samples the first docs up to 500 B
    rng = random.Random(0)
    words = "the river of a garden café 東京 мир 3.14 {x: y}".split()
    lines = [json.dumps({"id": f"d{i}", "text": " ".join(rng.choice(words) for _ in range(30)), "n": i},
                        ensure_ascii=False) for i in range(13)]
    for at in (0, 5, 9, 15):
        lines.insert(at, '{"id": "broken", "text": ')
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = from_dict({"pipeline": {"progress": False}, "tokenize": {"vocab_size": 300}})
    summary = run_stage("tokenize", cfg, src, tmp_path / "out")

    assert summary["docs_in"] == 17 and summary["docs_out"] == 13 and summary["removed"] == {"malformed_jsonl": 4}
    tokenizer = Tokenizer.load(tmp_path / "out" / "tokenizer.json")
    out = [json.loads(line) for line in (tmp_path / "out" / "in.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["n"] for r in out] == list(range(13))
    assert all(r["tokens"].startswith("uint16:") for r in out)  # packed (frame.pack_tokens), a 300-token vocabulary
    assert all(frame.unpack_tokens(r["tokens"]).tolist() == tokenizer.hf.encode(r["text"], add_special_tokens=False).ids
               for r in out)
    assert tokenizer.encode_batch(["", "a <|endoftext|> b"]) == [[], tokenizer.hf.encode("a <|endoftext|> b").ids]
    sizes = [len(r["text"].encode("utf-8")) for r in out]
    n_sampled = next(k for k in range(1, 14) if sum(sizes[:k]) >= 500)  # the document that reaches the cap is in
    audit = json.loads((tmp_path / "out" / "audit.json").read_text(encoding="utf-8"))
    assert audit["corpus"]["bytes"] == sum(sizes[:n_sampled])
    assert audit["corpus"]["tokens"] == sum(len(frame.unpack_tokens(r["tokens"])) for r in out[:n_sampled])
    assert audit["corpus"]["round_trip"] and audit["corpus"]["unknown_tokens"] == 0
    assert summary["tokens_out"] == sum(len(frame.unpack_tokens(r["tokens"])) for r in out)
    decisions = [json.loads(line)["decision"]
                 for line in (tmp_path / "out" / "_decisions" / "in.jsonl").read_text(encoding="utf-8").splitlines()]
    expected = ["kept"] * 13
    for at in (0, 5, 9, 15):
        expected.insert(at, "removed")
    assert decisions == expected
