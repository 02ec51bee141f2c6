"""Stage `tokenize`: load or train the tokenizer, audit it, add `tokens` to every document.

The tokenizer (and `audit.json`) go into the stage directory, where the `shard` stage (or
`ultratron data shard --input`) finds it. Training streams the stage input up to
`tokenize.train_bytes`, leaving out the documents the shard stage will hold out (by the same hash
of their id), so that figures measured on those are not measured on training text; the trained
tokenizer is saved before any part is encoded, so a rerun after a crash encodes with the same
tokenizer.

Languages (records with a `language`, from the `language` stage): the training text can be
balanced (`tokenize.language_alpha` < 1 or `tokenize.language_weights`): each language gets a share
of `train_bytes` ∝ its share of the corpus^alpha (or its weight), its documents repeated when it has
less text than that — so a small language earns merges of its own. The summary's
`tokenizer_languages` table gives, per language, bytes per token and tokens per word on the
held-out documents (all of them when a language has none held out) and whether decoding gave
every document back.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

from ultratron.curation import languages
from ultratron.curation.audit import audit_tokenizer
from ultratron.curation.frame import StageContext, iter_records, pack_tokens, unpack_tokens, write_json
from ultratron.data.sources import held_out
from ultratron.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
AUDIT_FILE = "audit.json"
# The audit measures the corpus on its first 200 documents, at most ~1 MB of them, with the ids
# the stage wrote for them (decoding them back is the round-trip check).
AUDIT_SAMPLE_DOCS = 200
AUDIT_SAMPLE_BYTES = 1_000_000


LANGUAGE_SAMPLE_BYTES = 1_000_000  # per language, for its bytes/token figures
MAX_REPEATS = 50  # a language balanced up repeats its text at most this often


def _records(parts: list[Path], max_bytes: int, held_out_fraction: float = 0.0) -> Iterator[dict]:
    """The parts' records, up to `max_bytes` of text; without the held-out ones when a fraction is given."""
    seen = 0
    for part in parts:
        for _, record, _problem in iter_records(part):
            if record is None or (held_out_fraction and held_out(record["id"], held_out_fraction)):
                continue
            yield record
            seen += len(record["text"].encode("utf-8"))
            if max_bytes and seen >= max_bytes:
                return


def _texts(parts: list[Path], max_bytes: int, held_out_fraction: float = 0.0) -> Iterator[str]:
    return (record["text"] for record in _records(parts, max_bytes, held_out_fraction))


def language_shares(byte_counts: dict[str, int], alpha: float, weights: dict[str, float]) -> dict[str, float]:
    """Each language's share of the training text: explicit weights (languages without one get 0),
    or the corpus share q raised to alpha and renormalised (alpha 1 leaves the corpus as it is)."""
    raw = {lang: float(weights.get(lang, 0.0)) for lang in byte_counts} if weights else \
          {lang: (n / sum(byte_counts.values())) ** alpha for lang, n in byte_counts.items() if n}
    total = sum(raw.values())
    if total <= 0:
        raise DataError(f"tokenize.language_weights gives every language of the corpus ({sorted(byte_counts)}) "
                        "a weight of 0")
    return {lang: w / total for lang, w in raw.items()}


def _balanced_texts(parts: list[Path], t, fraction: float) -> tuple[list[str], dict]:
    """Training text drawn per language by `language_shares`; (texts, the plan per language)."""
    by_language: dict[str, list[str]] = {}
    for record in _records(parts, 0, fraction):
        by_language.setdefault(str(record.get("language", "und")), []).append(record["text"])
    have = {lang: sum(len(x.encode("utf-8")) for x in texts) for lang, texts in by_language.items()}
    shares = language_shares(have, t.language_alpha, t.language_weights)
    # the most text that meets every share without repeating any language's more than MAX_REPEATS times
    budget = min([t.train_bytes] + [have[lang] * MAX_REPEATS / share for lang, share in shares.items() if share])
    texts, plan = [], {}
    for lang, share in sorted(shares.items()):
        target, taken, docs = share * budget, 0, by_language[lang]
        if not target:
            continue
        for i in range(len(docs) * MAX_REPEATS):
            if taken >= target:
                break
            text = docs[i % len(docs)]
            texts.append(text)
            taken += len(text.encode("utf-8"))
        plan[lang] = {"corpus_bytes": have[lang], "share": round(share, 4), "train_bytes": taken}
    return texts, plan


def language_table(tokenizer, records: list[dict]) -> dict[str, dict]:
    """Per language: documents, bytes per token, tokens per word (its own words) and the round trip."""
    rows: dict[str, dict] = {}
    for record in records:
        lang = str(record.get("language", "und"))
        row = rows.setdefault(lang, {"docs": 0, "bytes": 0, "tokens": 0, "words": 0, "round_trip": True})
        ids = unpack_tokens(record["tokens"]).tolist()
        row["docs"] += 1
        row["bytes"] += len(record["text"].encode("utf-8"))
        row["tokens"] += len(ids)
        row["words"] += len(languages.words(record["text"], lang))
        row["round_trip"] &= tokenizer.decode(ids) == record["text"]
    for row in rows.values():
        row["bytes_per_token"] = round(row["bytes"] / max(row["tokens"], 1), 3)
        row["tokens_per_word"] = round(row["tokens"] / max(row["words"], 1), 3)
    return rows


def format_language_table(table: dict[str, dict]) -> str:
    lines = ["| language | docs | bytes/token | tokens/word | round trip | measured on |",
             "|---|---:|---:|---:|---|---|"]
    for lang, row in sorted(table.items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(f"| {lang} | {row['docs']} | {row['bytes_per_token']} | {row['tokens_per_word']} | "
                     f"{'yes' if row['round_trip'] else 'NO'} | {row.get('measured_on', '')} |")
    return "\n".join(lines)


def format_domain_table(domains: dict[str, dict]) -> str:
    """The audit's probe texts (`curation/audit.py`: prose per script, code, mathematics) per domain."""
    lines = ["| domain (probe text) | bytes | bytes/token | tokens/word | round trip |", "|---|---:|---:|---:|---|"]
    for name, row in sorted(domains.items()):  # (sorted: a resumed stage's summary has its keys sorted)
        lines.append(f"| {name} | {row['bytes']} | {row['bytes_per_token']} | {row['tokens_per_word']} | "
                     f"{'yes' if row['round_trip'] else 'NO'} |")
    return "\n".join(lines)


def _language_sample(parts: list[Path], fraction: float) -> tuple[list[dict], dict[str, str]]:
    """Encoded records per language for its figures: the held-out ones, or all of a language that
    has none held out; at most LANGUAGE_SAMPLE_BYTES of each. (records, language → which split)."""
    chosen: dict[str, list[dict]] = {}
    spare: dict[str, list[dict]] = {}
    sizes: dict[tuple[str, bool], int] = {}
    for record in _records(parts, 0):
        if "language" not in record:
            return [], {}
        lang, is_held = record["language"], bool(fraction) and held_out(record["id"], fraction)
        if sizes.get((lang, is_held), 0) < LANGUAGE_SAMPLE_BYTES:
            (chosen if is_held else spare).setdefault(lang, []).append(record)
            sizes[lang, is_held] = sizes.get((lang, is_held), 0) + len(record["text"].encode("utf-8"))
    split = {lang: "held-out" if chosen.get(lang) else "all (none held out)" for lang in set(chosen) | set(spare)}
    return [r for lang in split for r in chosen.get(lang) or spare[lang]], split


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
    fraction = ctx.cfg.shard.held_out_fraction
    parts = ctx.parts()
    path = ctx.out_dir / TOKENIZER_FILE
    train_cpu = _cpu_seconds()
    if not path.is_file():
        if t.tokenizer:
            tokenizer = Tokenizer.load(t.tokenizer)
        else:
            if next(_texts(parts, 1, fraction), None) is None:
                if next(_texts(parts, 1), None) is None:
                    raise DataError(f"{ctx.input}: no documents left to train a tokenizer on")
                fraction = 0.0  # everything is held out (a tiny corpus): train on it all
            if t.language_alpha < 1 or t.language_weights:
                texts, plan = _balanced_texts(parts, t, fraction)
                write_json(ctx.out_dir / "language_plan.json", plan)
            else:
                texts = _texts(parts, t.train_bytes, fraction)
            tokenizer = train_tokenizer(texts, t.vocab_size)
        tokenizer.save(path)
    train_cpu = _cpu_seconds() - train_cpu  # a fixed cost, bounded by tokenize.train_bytes
    tokenizer = _load(str(path))
    ctx.map_parts(make_batch_fn, {p.stem: str(path) for p in parts}, batched=True)
    written = [ctx.out_dir / f"{p.stem}.jsonl" for p in parts]
    sample = [r for _, r in zip(range(AUDIT_SAMPLE_DOCS), _records(written, AUDIT_SAMPLE_BYTES), strict=False)]
    audit = audit_tokenizer(tokenizer, [r["text"] for r in sample], t.poor_compression_ratio,
                            corpus_ids=[unpack_tokens(r["tokens"]).tolist() for r in sample])
    sample, split = _language_sample(written, ctx.cfg.shard.held_out_fraction)
    table = language_table(tokenizer, sample) if sample else {}
    for lang, row in table.items():
        row["measured_on"] = split[lang]
    audit["languages"] = table
    write_json(ctx.out_dir / AUDIT_FILE, audit)
    return {"tokenizer_languages": table, "tokenizer_domains": audit["domains"],
            "tokenizer": str(path), "tokenizer_sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
            "audit_warnings": audit["warnings"], "audit_round_trip": audit["all_round_trip"],
            "audit_unknown_tokens": audit["unknown_tokens"], "train_cpu_seconds": train_cpu,
            "encoder": "tiktoken" if tokenizer.fast is not None else f"tokenizers ({tokenizer.fast_reason})"}


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system
