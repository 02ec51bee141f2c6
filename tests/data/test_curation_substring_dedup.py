"""Substring dedup: a planted 200-byte span goes from every document holding it, nothing else."""

from __future__ import annotations

import json
import random
import string

from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_stage
from ultratron.curation.stages.substring_dedup import remove_ranges


def _words(rng: random.Random, n: int) -> str:
    # Random letters: no two documents share 100 bytes by chance; some accented words for UTF-8.
    pool = string.ascii_lowercase
    return " ".join("".join(rng.choice(pool) for _ in range(rng.randint(2, 9))) + rng.choice(["", "", "é", "ß"])
                    for _ in range(n))


def test_planted_boilerplate_removed_and_nothing_else(tmp_path):
    rng = random.Random(3)
    boiler = "Copyright notice: " + _words(random.Random(99), 40)
    boiler = boiler.encode()[:200].decode("utf-8", "ignore")
    assert len(boiler.encode()) >= 198
    # distinct characters on each side of the planted span, so the longest repeat is the span itself
    edges = list(string.ascii_letters + string.digits)
    rng.shuffle(edges)
    docs, expected = [], {}
    for k in range(40):
        head, tail = _words(rng, 60), _words(rng, 60)
        if k % 3 == 0:
            left, right = edges.pop(), edges.pop()
            text = head + left + boiler + right + tail
            expected[f"d{k}"] = head + left + right + tail
        else:
            text = head + " " + tail
            expected[f"d{k}"] = text
        docs.append({"id": f"d{k}", "text": text, "source": "test"})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    cfg = from_dict({"pipeline": {"progress": False}, "substring_dedup": {"min_bytes": 100}})
    summary = run_stage("substring-dedup", cfg, src, tmp_path / "out")

    out = [json.loads(line) for line in (tmp_path / "out" / "in.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {d["id"]: d["text"] for d in out} == expected
    assert all(d["source"] == "test" for d in out)  # other fields carried along
    planted = sum(1 for k in range(40) if k % 3 == 0)
    assert summary["modified"] == {"substring_removed": planted}
    assert summary["repeated_bytes"] == planted * len(boiler.encode())
    assert summary["bytes_in"] - summary["bytes_out"] == planted * len(boiler.encode())


def test_ranges_widen_to_whole_characters():
    text = "aé€b"  # bytes: a, é (2), € (3), b
    assert remove_ranges(text, [(2, 4)]) == ("ab", 5)  # cuts inside é and € remove both, not halves
    assert remove_ranges(text, [(0, 1), (6, 7)]) == ("é€", 2)
