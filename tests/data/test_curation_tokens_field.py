"""The `tokens` field between the tokenize and shard stages: packed ids round-trip exactly (both
widths, every base64 padding), are counted without decoding, a plain list still works, and a
corrupt or out-of-vocabulary field stops `shard` with the part and line, not a wrong shard."""

from __future__ import annotations

import json
import random

import pytest

from ultratron.curation.config import from_dict
from ultratron.curation.frame import count_tokens, pack_tokens, unpack_tokens
from ultratron.curation.runner import run_stage
from ultratron.errors import DataError


@pytest.mark.parametrize("dtype,high", [("uint16", 2**16), ("uint32", 2**32)])
def test_packed_ids_round_trip_and_are_counted_without_decoding(dtype, high):
    rng = random.Random(0)
    for n in (0, 1, 2, 3, 4, 5, 17, 1000):  # every remainder mod 3 bytes, so every padding of base64
        ids = [rng.randrange(high) for _ in range(n)] + ([high - 1] if n else [])
        packed = pack_tokens(ids, dtype)
        assert packed.startswith(dtype + ":")
        assert unpack_tokens(packed).tolist() == ids
        assert count_tokens(packed) == len(ids)
    assert len(pack_tokens(list(range(1000)), "uint16")) < len(json.dumps(list(range(1000)))) / 1.4


def test_plain_lists_are_accepted_and_bad_fields_are_named():
    assert unpack_tokens([3, 1, 2]).tolist() == [3, 1, 2] and count_tokens([3, 1, 2]) == 3
    assert count_tokens(None) == 0 and count_tokens("not tokens") == 0
    for bad, message in [("int8:AAAA", "type 'int8'"), ("uint16:@@@@", "invalid base64"),
                         ("uint16:AAAA", "not a whole number"), ([1, -2], "list of non-negative"),
                         ([1, True], "list of non-negative"), ({"ids": [1]}, "of type dict")]:
        with pytest.raises(DataError, match=message):
            unpack_tokens(bad)


def _tokenized(tmp_path):
    rng = random.Random(1)
    words = "the river of a garden bridge morning castle".split()
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": " ".join(rng.choice(words) for _ in range(40))}) + "\n"
                           for i in range(20)), encoding="utf-8")
    cfg = from_dict({"pipeline": {"progress": False}, "tokenize": {"vocab_size": 300},
                     "shard": {"held_out_fraction": 0.0, "parquet": False}})
    run_stage("tokenize", cfg, src, tmp_path / "tok")
    return cfg, tmp_path / "tok" / "in.jsonl"


def test_shard_reads_packed_and_plain_fields_alike(tmp_path):
    cfg, part = _tokenized(tmp_path)
    records = [json.loads(line) for line in part.read_text(encoding="utf-8").splitlines()]
    run_stage("shard", cfg, tmp_path / "tok", tmp_path / "packed")
    for r in records:
        r["tokens"] = unpack_tokens(r["tokens"]).tolist()  # as another tool might write them
    part.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    run_stage("shard", cfg, tmp_path / "tok", tmp_path / "plain")
    expected = sum(len(r["tokens"]) + 1 for r in records)  # each document ends with EOS
    for name in ("packed", "plain"):
        meta = json.loads((tmp_path / name / "train" / "meta.json").read_text())
        assert meta["n_tokens"] == expected and meta["n_documents"] == 20
    packed, plain = (sorted((tmp_path / name / "train").glob("shard_*")) for name in ("packed", "plain"))
    assert len(packed) >= 2 and [p.name for p in packed] == [p.name for p in plain]  # tokens and index
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(packed, plain, strict=True))


@pytest.mark.parametrize("field,message", [("uint16:AA==", "not a whole number"),
                                           (pack_tokens([299, 300], "uint16"), "token id 300 is outside")])
def test_a_corrupt_tokens_field_stops_shard_at_its_line(tmp_path, field, message):
    cfg, part = _tokenized(tmp_path)
    lines = part.read_text(encoding="utf-8").splitlines()
    record = json.loads(lines[6])
    record["tokens"] = field
    lines[6] = json.dumps(record)
    part.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"in\.jsonl:7: .*{message}"):
        run_stage("shard", cfg, tmp_path / "tok", tmp_path / "shard")
    assert not (tmp_path / "shard" / "train" / "meta.json").exists()  # no shard set that looks finished
