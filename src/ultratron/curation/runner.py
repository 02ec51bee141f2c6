"""Run one curation stage, or the whole pipeline, resuming whatever an earlier run finished.

`run_stage` skips a stage whose `_DONE.json` exists and otherwise runs it (its parts resume
one by one, see `frame`); `run_pipeline` runs the configured stages in order, each on the
previous one's output, then writes the report and the merged decision log.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from ultratron.config.loader import to_dict
from ultratron.curation.config import DataPipelineConfig
from ultratron.curation.executors import Executor, make_executor
from ultratron.curation.frame import (
    DONE,
    PartStats,
    Scorer,
    StageContext,
    TaskTexts,
    remove_temp_files,
    stage_dirs,
    write_json,
)
from ultratron.curation.publish import run_to_object_store
from ultratron.curation.report import write_report
from ultratron.curation.stages import RUNNERS
from ultratron.data.objstore import is_url
from ultratron.errors import DataError


def summarize(out_dir: Path) -> dict:
    """A stage's totals from its parts' stats files."""
    total = PartStats()
    seconds = 0.0
    n_parts = 0
    for path in sorted((out_dir / "_stats").glob("*.json")):
        s = json.loads(path.read_text(encoding="utf-8"))
        n_parts += 1
        for key in ("docs_in", "docs_out", "bytes_in", "bytes_out", "tokens_out"):
            setattr(total, key, getattr(total, key) + s[key])
        total.removed.update(s["removed"])
        total.modified.update(s["modified"])
        total.notes.update(s.get("notes", {}))
        for lang, row in s.get("languages", {}).items():
            mine = total.languages.setdefault(lang, [0, 0, 0, 0])
            mine[:] = [a + b for a, b in zip(mine, row, strict=True)]
        for reason, items in s["examples"].items():
            for item in items:
                total.example(reason, item["id"], item["snippet"], item.get("detail"))
        seconds += s.get("seconds", 0.0)
    return total.to_dict() | {"parts": n_parts, "part_seconds": seconds}


def run_stage(stage: str, cfg: DataPipelineConfig, input_path: str | Path, out_dir: str | Path,
              executor: Executor | None = None, scorer: Scorer | None = None,
              task_texts: TaskTexts | None = None) -> dict:
    """Run one stage (resuming any finished parts) and return its summary (also in _DONE.json).

    `scorer` is the perplexity stage's model (any callable texts → perplexities); without it
    that stage loads `perplexity.checkpoint`. `task_texts` gives the decontaminate stage the
    evaluation items (`ultratron.evaluation.builtin.task_texts`). Other stages ignore both.
    """
    if is_url(out_dir):
        raise DataError(f"{out_dir}: a single stage writes to a local directory; `ultratron data run` publishes "
                        "to an object store (pipeline.output)")
    out_dir = Path(out_dir)
    done = out_dir / DONE
    if done.is_file():
        return json.loads(done.read_text(encoding="utf-8"))
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_temp_files(out_dir)  # an interrupted earlier run's half-written parts
    own_executor = executor is None
    executor = executor or make_executor(cfg)
    started = time.perf_counter()
    source = input_path if is_url(input_path) else Path(input_path)  # a URL is no Path ("s3://" → "s3:/")
    try:
        ctx = StageContext(stage, cfg, source, out_dir, executor, scorer, task_texts)
        extra = RUNNERS[stage](ctx) or {}
    finally:
        if own_executor:
            executor.close()
    summary = {"stage": stage} | summarize(out_dir) | extra | {"wall_seconds": time.perf_counter() - started}
    write_json(done, summary)
    return summary


def run_pipeline(cfg: DataPipelineConfig, log: Callable[[str], None] = print,
                 task_texts: TaskTexts | None = None) -> dict:
    """Every configured stage in order, resuming finished work; writes the report and decision log.
    An output on an object store is staged locally and published (curation/publish.py)."""
    if is_url(cfg.pipeline.output):
        return run_to_object_store(cfg, lambda staged: run_pipeline(staged, log, task_texts), log)
    out = Path(cfg.pipeline.output)
    out.mkdir(parents=True, exist_ok=True)
    # What a kill left anywhere under the output: the stages clean their own directories, but the
    # pipeline's own files (config.json, report.json, decisions.jsonl) and a finished stage's
    # directory are never revisited by a stage.
    if removed := remove_temp_files(out):
        log(f"data: removed {len(removed)} half-written file(s) an interrupted run left (e.g. {removed[0].name})")
    write_json(out / "config.json", to_dict(cfg))
    executor = make_executor(cfg)
    summaries = []
    previous: Path | str = cfg.pipeline.input
    try:
        for stage, stage_dir in stage_dirs(cfg):
            resumed = (stage_dir / DONE).is_file()
            summary = run_stage(stage, cfg, previous, stage_dir, executor, task_texts=task_texts)
            summaries.append(summary)
            log(f"data: {stage:<16} {summary['docs_in']:>8} → {summary['docs_out']:>8} documents"
                + ("  (done earlier)" if resumed else f"  {summary['wall_seconds']:.1f}s"))
            previous = stage_dir
    finally:
        executor.close()
    return write_report(cfg, summaries, log=log)
