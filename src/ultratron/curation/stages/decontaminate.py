"""Stage `decontaminate`: documents that repeat an evaluation item are removed, or the repeated spans cut.

The items are those of every task `decontaminate.tasks` names (the same spelling as the trainer's
`eval.tasks`: `builtin`, built-in task names, task files); the evaluation layer turns them into
texts and hands them in (`run_stage(..., task_texts=...)`, which `ultratron data` passes), since
curation does not import evaluation. In the driver their word n-grams (`curation/contamination.py`:
13 words after lowercasing and stripping punctuation, unspaced scripts segmented) are hashed into
`_index/eval_ngrams.npz`; per part, a document with any of them is removed as
`contaminated:TASK` (`decontaminate.mode = "remove"`), or (`"cut"`) loses the spans those n-grams
cover and is kept as modified with that reason, removed if fewer than `decontaminate.min_doc_chars`
characters are left. TASK is the task with the most matching n-grams (the first listed on a tie);
the decision's detail counts them per task.
"""

from __future__ import annotations

import numpy as np

from ultratron.curation.contamination import build_index, load_index, matched_spans
from ultratron.curation.frame import StageContext
from ultratron.errors import DataError

INDEX_FILE = "eval_ngrams.npz"


def make_doc_fn(cfg, side: str):
    """side: the index file."""
    d = cfg.decontaminate
    index = load_index(side)

    def fn(record: dict, i: int):
        starts, owners = index.matches(record["text"])
        if not len(starts):
            return record, None, None, None
        counts = np.bincount(owners, minlength=len(index.tasks))
        detail = {index.tasks[t]: int(c) for t, c in enumerate(counts) if c}
        reason = f"contaminated:{index.tasks[int(np.argmax(counts))]}"
        if d.mode == "remove":
            return None, reason, None, detail
        text, kept, at = record["text"], [], 0
        for begin, end in matched_spans(text, starts, index.n):
            kept.append(text[at:begin])
            at = end
        text = "".join(kept) + text[at:]
        if len(text.strip()) < d.min_doc_chars:
            return None, reason, None, detail
        return {**record, "text": text}, reason, None, detail

    return fn


def run(ctx: StageContext) -> dict:
    d = ctx.cfg.decontaminate
    if ctx.task_texts is None:
        raise DataError("stage 'decontaminate' needs the evaluation tasks' texts: run it through `ultratron data`, "
                        "or pass run_stage(..., task_texts=ultratron.evaluation.builtin.task_texts)")
    items = ctx.task_texts(d.tasks, d.held_out_fraction)
    index, counts = build_index(items, d.ngram)
    path = ctx.index_dir / INDEX_FILE
    index.save(path)  # the same for every run with these tasks: parts done earlier used this one
    ctx.map_parts(make_doc_fn, {p.stem: str(path) for p in ctx.parts()})
    return {"decontaminate_tasks": counts, "decontaminate_mode": d.mode, "decontaminate_ngram": d.ngram}


def format_tasks(summary: dict) -> str:
    """report.md's table: per task, its items and n-grams, and the documents it removed or cut."""
    rows = ["| task | items | items < n words | n-grams | documents removed | documents cut |",
            "|---|---:|---:|---:|---:|---:|"]
    for task, c in sorted(summary["decontaminate_tasks"].items()):  # (a resumed summary's keys come sorted)
        reason = f"contaminated:{task}"
        rows.append(f"| {task} | {c['items']} | {c['items_too_short']} | {c['ngrams']} | "
                    f"{summary['removed'].get(reason, 0)} | {summary['modified'].get(reason, 0)} |")
    return "\n".join(rows)
