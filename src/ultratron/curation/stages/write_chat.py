"""Stage `write-chat` (read.format = "chat"): the surviving conversations, back as chat JSONL.

Each document's `conversation` — the record exactly as `read` found it — is written, in corpus
order, to `conversations/SOURCE` in the stage directory: one file per input file, under its
relative name, so the trainer's validation per source still sees each file. That directory is
what `ultratron train --data.format chat --data.path ...` reads (the report names it as
`trainer_data_path`). The files are written once every part is done, from the stage's own parts,
each under a temporary name then renamed; a rerun writes them again.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from ultratron.atomic import atomic_open
from ultratron.curation.frame import StageContext, iter_records, list_parts

CHAT_DIR = "conversations"


def chat_file(source) -> Path | None:
    """The file (relative to conversations/) for a document's `source`: its relative name, ending in
    .jsonl as the trainer's chat reader wants; None for anything that would lead outside."""
    if not isinstance(source, str) or not source:
        return None
    path = Path(source if source.endswith(".jsonl") else source + ".jsonl")
    return None if path.is_absolute() or ".." in path.parts else path


def make_doc_fn(cfg, side):
    def fn(record: dict, index: int):
        if not isinstance(record.get("conversation"), dict) or chat_file(record.get("source")) is None:
            return None, "not_a_conversation", None, None  # parts of a text pipeline, or written by hand
        return record, None, None, None

    return fn


def run(ctx: StageContext) -> dict:
    ctx.map_parts(make_doc_fn)
    out = ctx.out_dir / CHAT_DIR
    counts: Counter = Counter()
    # `read` streams its sources one after another into parts and every stage keeps their order, so
    # each source's conversations come together: one output file open at a time
    with ExitStack() as current:
        name = None
        for part in list_parts(ctx.out_dir):
            for _, record, _problem in iter_records(part):
                source = str(chat_file(record["source"]))
                if source != name:
                    current.close()  # the previous source's file, renamed into place whole
                    name = source
                    if name in counts:
                        raise RuntimeError(f"write-chat: the conversations of {name} do not come together")
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    file = current.enter_context(atomic_open(out / name))
                file.write(json.dumps(record["conversation"], ensure_ascii=False) + "\n")
                counts[name] += 1
    return {"conversations": sum(counts.values()), "chat_files": dict(counts), "trainer_data_path": str(out)}
