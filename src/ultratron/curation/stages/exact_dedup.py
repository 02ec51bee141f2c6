"""Stage `exact-dedup`: documents whose (normalized) text is byte-identical to an earlier one go.

Three phases: (1) per part, in parallel and resumable, a 128-bit blake2b digest per document;
(2) in the driver, over all digests in corpus order (part name, then position), the first
document with a digest survives and every later one is a duplicate of it; (3) per part, in
parallel, drop them. The result does not depend on the number of workers or on the executor.

Memory in phase (2): one 16-byte digest per distinct document in a dict (~100 bytes/doc with
Python overhead).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ultratron.curation.frame import StageContext, iter_records, write_json


def text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _exact_index(args: tuple[str, str]) -> str:
    in_path, out_path = args
    if not Path(out_path).is_file():
        ids, digests = [], []
        for _, record, _problem in iter_records(Path(in_path)):
            if record is not None:
                ids.append(record["id"])
                digests.append(text_digest(record["text"]).hex())
        write_json(Path(out_path), {"ids": ids, "digests": digests})
    return out_path


def run(ctx: StageContext) -> dict:
    parts = ctx.parts()
    tasks = [(str(p), str(ctx.index_dir / f"{p.stem}.json")) for p in parts]
    index_paths = ctx.executor.map(_exact_index, tasks, desc="exact-dedup index")
    first: dict[str, str] = {}
    sides: dict[str, dict[int, str]] = {}
    for part, path in zip(parts, index_paths, strict=True):
        index = json.loads(Path(path).read_text(encoding="utf-8"))
        drop = {}
        for i, (doc_id, digest) in enumerate(zip(index["ids"], index["digests"], strict=True)):
            survivor = first.get(digest)
            if survivor is None:  # by position, not by id: two inputs may carry the same id
                first[digest] = doc_id
            else:
                drop[i] = survivor
        sides[part.stem] = drop
    ctx.map_parts(make_doc_fn, sides)
    return {"distinct_documents": len(first)}


def make_doc_fn(cfg, side: dict[int, str] | None):
    """side: document index → the id of the earlier document it duplicates."""
    side = side or {}

    def exact(record: dict, index: int):
        survivor = side.get(index)
        if survivor is None:
            return record, None, None, None
        return None, "exact_duplicate", survivor, None

    return exact
