"""Stage `tokenize`: load or train the tokenizer, audit it, add `tokens` to every document.

The tokenizer (and `audit.json`) go into the stage directory, where the `shard` stage (or
`ultratron data shard --input`) finds it. Training streams the stage input up to
`tokenize.train_bytes`; the trained tokenizer is saved before any part is encoded, so a rerun
after a crash encodes with the same tokenizer.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

from ultratron.curation.audit import audit_tokenizer
from ultratron.curation.frame import StageContext, iter_records, pack_tokens, unpack_tokens, write_json
from ultratron.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
AUDIT_FILE = "audit.json"
# The audit measures the corpus on its first 200 documents, at most ~1 MB of them, with the ids
# the stage wrote for them (decoding them back is the round-trip check).
AUDIT_SAMPLE_DOCS = 200
AUDIT_SAMPLE_BYTES = 1_000_000


def _records(parts: list[Path], max_bytes: int) -> Iterator[dict]:
    seen = 0
    for part in parts:
        for _, record, _problem in iter_records(part):
            if record is None:
                continue
            yield record
            seen += len(record["text"].encode("utf-8"))
            if max_bytes and seen >= max_bytes:
                return


def _texts(parts: list[Path], max_bytes: int) -> Iterator[str]:
    return (record["text"] for record in _records(parts, max_bytes))


def _load(path: str):
    """The tokenizer at `path`, loaded once per process and file version: the driver loads it
    before the workers fork, so they inherit it (with its fast encoder) instead of building it."""
    stat = os.stat(path)
    return _load_version(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _load_version(path: str, mtime_ns: int, size: int):
    from ultratron.data.tokenizer import Tokenizer

    return Tokenizer.load(path)


def make_batch_fn(cfg, side: str):
    """side: the tokenizer.json. Encodes `frame.BATCH_DOCS` documents per call to the tokenizer
    (threaded) and packs the ids (`frame.pack_tokens`)."""
    from ultratron.data.shards import token_dtype

    tokenizer = _load(side)
    dtype = token_dtype(tokenizer.vocab_size).name

    def fn(records: list[dict], start: int):
        encoded = tokenizer.encode_batch([r["text"] for r in records]) if records else []
        return [({**r, "tokens": pack_tokens(ids, dtype)}, None, None, None)
                for r, ids in zip(records, encoded, strict=True)]

    return fn


def run(ctx: StageContext) -> dict:
    from ultratron.data.tokenizer import Tokenizer, train_tokenizer

    t = ctx.cfg.tokenize
    parts = ctx.parts()
    path = ctx.out_dir / TOKENIZER_FILE
    train_cpu = _cpu_seconds()
    if not path.is_file():
        if t.tokenizer:
            tokenizer = Tokenizer.load(t.tokenizer)
        else:
            if next(_texts(parts, 1), None) is None:
                raise DataError(f"{ctx.input}: no documents left to train a tokenizer on")
            tokenizer = train_tokenizer(_texts(parts, t.train_bytes), t.vocab_size)
        tokenizer.save(path)
    train_cpu = _cpu_seconds() - train_cpu  # a fixed cost, bounded by tokenize.train_bytes
    tokenizer = _load(str(path))
    ctx.map_parts(make_batch_fn, {p.stem: str(path) for p in parts}, batched=True)
    written = [ctx.out_dir / f"{p.stem}.jsonl" for p in parts]
    sample = [r for _, r in zip(range(AUDIT_SAMPLE_DOCS), _records(written, AUDIT_SAMPLE_BYTES), strict=False)]
    audit = audit_tokenizer(tokenizer, [r["text"] for r in sample], t.poor_compression_ratio,
                            corpus_ids=[unpack_tokens(r["tokens"]).tolist() for r in sample])
    write_json(ctx.out_dir / AUDIT_FILE, audit)
    return {"tokenizer": str(path), "tokenizer_sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
            "audit_warnings": audit["warnings"], "audit_round_trip": audit["all_round_trip"],
            "audit_unknown_tokens": audit["unknown_tokens"], "train_cpu_seconds": train_cpu,
            "encoder": "tiktoken" if tokenizer.fast is not None else f"tokenizers ({tokenizer.fast_reason})"}


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system
