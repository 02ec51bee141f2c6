"""Stage `shard`: the trainer's token shards and Parquet shards of the cleaned text.

Output directory layout (the same as `ultratron.data.prepare`, so the trainer can point
`--data.path` at it): `tokenizer.json`, `train/` and `val/` token shard sets (documents are
held out by a hash of their id, `shard.held_out_fraction`), `parquet/part-NNNNN.parquet`
(columns id, text, n_tokens, split) for streaming readers, and the usual JSONL parts (without
the token lists).
"""

from __future__ import annotations

import json
from pathlib import Path

from ultratron.atomic import atomic_path
from ultratron.curation.frame import StageContext, count_tokens, iter_records, unpack_tokens
from ultratron.curation.stages.tokenize import TOKENIZER_FILE
from ultratron.data.sources import held_out
from ultratron.errors import DataError

SHARD_META = "meta.json"


def _split(doc_id: str, fraction: float) -> str:
    return "val" if held_out(doc_id, fraction) else "train"


def _write_parquet(args: tuple[str, str, float]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    in_path, out_path, fraction = args
    if Path(out_path).is_file():
        return out_path
    rows = {"id": [], "text": [], "n_tokens": [], "split": []}
    for _, record, _problem in iter_records(Path(in_path)):
        if record is None:
            continue
        rows["id"].append(record["id"])
        rows["text"].append(record["text"])
        rows["n_tokens"].append(count_tokens(record.get("tokens")))
        rows["split"].append(_split(record["id"], fraction))
    schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("n_tokens", pa.int64()), ("split", pa.string())])
    with atomic_path(out_path) as tmp:
        pq.write_table(pa.table(rows, schema=schema), str(tmp))
    return out_path


def _write_token_shards(ctx: StageContext, tokenizer) -> dict:
    from ultratron.data.shards import ShardWriter

    fraction = ctx.cfg.shard.held_out_fraction
    vocab_size = tokenizer.vocab_size
    result = {}
    for split in ("train", "val"):
        split_dir = ctx.out_dir / split
        if (split_dir / SHARD_META).is_file():  # finished on an earlier run
            result[split] = json.loads((split_dir / SHARD_META).read_text())
            continue
        writer = ShardWriter(split_dir, vocab_size=vocab_size, eos_id=tokenizer.eos_id,
                             tokenizer_sha256=tokenizer.sha256,
                             tokens_per_shard=ctx.cfg.shard.tokens_per_shard)
        n_bytes = 0
        for part in ctx.parts():
            for line_no, record, _problem in iter_records(part):
                if record is None or _split(record["id"], fraction) != split:
                    continue
                if "tokens" in record:
                    try:
                        tokens = unpack_tokens(record["tokens"])
                    except DataError as err:
                        raise DataError(f"{part}:{line_no}: {err}") from None
                    if len(tokens) and int(tokens.max()) >= vocab_size:
                        raise DataError(f"{part}:{line_no}: token id {int(tokens.max())} is outside the "
                                        f"tokenizer's vocabulary of {vocab_size}")
                else:
                    tokens = tokenizer.encode(record["text"])
                writer.add(tokens)
                n_bytes += len(record["text"].encode("utf-8"))
        result[split] = writer.close({"n_bytes": n_bytes})
    return result


def make_doc_fn(cfg, side):
    fraction = cfg.shard.held_out_fraction

    def fn(record: dict, index: int):
        out = {k: v for k, v in record.items() if k != "tokens"}
        out["split"] = _split(record["id"], fraction)
        return out, None, None, None

    return fn


def run(ctx: StageContext) -> dict:
    from ultratron.data.tokenizer import Tokenizer

    source = ctx.input if ctx.input.is_dir() else ctx.input.parent
    if not (source / TOKENIZER_FILE).is_file():
        raise DataError(f"{source}: no {TOKENIZER_FILE}; run the 'tokenize' stage first "
                        "and give its output as --input")
    if not (ctx.out_dir / TOKENIZER_FILE).is_file():  # with its tokenizer_config.json, if it has one
        Tokenizer.load(source / TOKENIZER_FILE).save(ctx.out_dir / TOKENIZER_FILE)
    tokenizer = Tokenizer.load(ctx.out_dir / TOKENIZER_FILE)
    parts = ctx.parts()
    parquet_files = []
    if ctx.cfg.shard.parquet:
        (ctx.out_dir / "parquet").mkdir(exist_ok=True)
        parquet_files = ctx.executor.map(
            _write_parquet, [(str(p), str(ctx.out_dir / "parquet" / f"{p.stem}.parquet"),
                              ctx.cfg.shard.held_out_fraction) for p in parts], desc="parquet")
    shards = _write_token_shards(ctx, tokenizer)
    ctx.map_parts(make_doc_fn)
    counts = {split: {k: meta[k] for k in ("n_documents", "n_tokens", "n_bytes")}
              for split, meta in shards.items()}
    return {"token_shards": counts, "parquet_files": len(parquet_files),
            "trainer_data_path": str(ctx.out_dir)}
