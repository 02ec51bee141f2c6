"""The run's report (`report.json` and `report.md`) and the merged per-document decision log.

`decisions.jsonl` holds, for every document that any stage removed or changed, one line per
such stage (`stage`, `decision`, `reason`, `cluster`, `detail`), and one `kept` line for each
document in the final output, so that every input document's fate can be looked up by id.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ultratron import atomic
from ultratron.curation.frame import list_parts, stage_dirs, write_json


def format_table(summaries: list[dict]) -> str:
    header = ("| stage | docs in | docs out | MB in | MB out | tokens out | removed (top reasons) |\n"
              "|---|---:|---:|---:|---:|---:|---|")
    rows = []
    for s in summaries:
        # most frequent first, ties by name: a stage summary read back from _DONE.json (a resumed
        # run) has its reasons in key order, a fresh one in the order they were first met
        reasons = sorted(s["removed"].items(), key=lambda kv: (-kv[1], kv[0]))
        top = ", ".join(f"{r} {n}" for r, n in reasons[:4]) + (" …" if len(reasons) > 4 else "")
        modified = sum(s["modified"].values())
        if modified:
            top += f"{'; ' if top else ''}modified {modified}"
        rows.append(f"| {s['stage']} | {s['docs_in']} | {s['docs_out']} | {s['bytes_in'] / 1e6:.2f} | "
                    f"{s['bytes_out'] / 1e6:.2f} | {s['tokens_out']} | {top} |")
    return "\n".join([header, *rows])


def format_languages(summaries: list[dict]) -> str:
    """Documents and MB left per language after each stage (records with a `language` field:
    from the `language` stage on); '' when no stage counted any."""
    stages = [s for s in summaries if s.get("languages")]
    if not stages:
        return ""
    first = stages[0]["languages"]
    langs = sorted({lang for s in stages for lang in s["languages"]}, key=lambda lang: (-first.get(lang, [0])[0], lang))
    header = "| language | " + " | ".join(f"{s['stage']} docs / MB" for s in stages) + " |\n|---|" + \
             "---:|" * len(stages)
    rows = []
    for lang in langs:
        cells = []
        for s in stages:
            _, docs_out, _, bytes_out = s["languages"].get(lang, [0, 0, 0, 0])
            cells.append(f"{docs_out} / {bytes_out / 1e6:.2f}")
        in_docs, _, in_bytes, _ = first.get(lang, [0, 0, 0, 0])
        rows.append(f"| {lang} ({in_docs} in, {in_bytes / 1e6:.2f} MB) | " + " | ".join(cells) + " |")
    return "\n".join([header, *rows])


def merge_decisions(cfg, out_path: Path) -> int:
    """Write the merged decision log; returns its number of lines."""
    lines = 0
    dirs = stage_dirs(cfg)
    with atomic.atomic_open(out_path) as out:
        for stage, stage_dir in dirs:
            for path in sorted((stage_dir / "_decisions").glob("*.jsonl")):
                with open(path, encoding="utf-8") as fh:
                    for line in fh:
                        entry = json.loads(line)
                        if entry["decision"] == "kept":
                            continue
                        out.write(json.dumps({"stage": stage, **entry}, ensure_ascii=False) + "\n")
                        lines += 1
        if dirs:
            _, last_dir = dirs[-1]
            for part in list_parts(last_dir):
                with open(part, encoding="utf-8") as fh:
                    for line in fh:
                        doc_id = json.loads(line)["id"]
                        out.write(json.dumps({"stage": "final", "id": doc_id, "decision": "kept",
                                             "reason": None, "cluster": None}) + "\n")
                        lines += 1
    return lines


def write_report(cfg, summaries: list[dict], log: Callable[[str], None] = print) -> dict:
    out = Path(cfg.pipeline.output)
    report = {"input": cfg.pipeline.input, "stages": summaries,
              "final": {k: summaries[-1][k] for k in ("docs_out", "bytes_out")} if summaries else {},
              "decisions": str(out / "decisions.jsonl")}
    for s in summaries:
        if s["stage"] in ("shard", "write-chat"):
            report["trainer_data_path"] = s["trainer_data_path"]
        if s["stage"] == "tokenize":
            report["tokenizer_audit_warnings"] = s["audit_warnings"]
    report["decision_lines"] = merge_decisions(cfg, out / "decisions.jsonl")
    sections = [format_table(summaries)]
    if by_language := format_languages(summaries):
        sections.append(f"## By language\n\n{by_language}")
    for s in summaries:
        if s["stage"] == "decontaminate":
            from ultratron.curation.stages.decontaminate import format_tasks

            sections.append(f"## Decontamination ({s['decontaminate_ngram']}-grams, {s['decontaminate_mode']})\n\n"
                            + format_tasks(s))
        if s["stage"] == "pii":
            sections.append(f"## Personal data replaced ({s['modified'].get('pii', 0)} documents changed)\n\n"
                            "| kind | replaced |\n|---|---:|\n"
                            + "\n".join(f"| {k} | {n} |" for k, n in sorted(s["pii_replaced"].items())))
        if s["stage"] == "tokenize" and s.get("tokenizer_languages"):
            from ultratron.curation.stages.tokenize import format_language_table

            sections.append("## Tokenizer by language\n\n" + format_language_table(s["tokenizer_languages"]))
        if s["stage"] == "tokenize" and s.get("tokenizer_domains"):
            from ultratron.curation.stages.tokenize import format_domain_table

            sections.append("## Tokenizer by domain\n\n" + format_domain_table(s["tokenizer_domains"]))
    write_json(out / "report.json", report)
    atomic.write_text(out / "report.md", "# Data curation report\n\n" + "\n\n".join(sections) + "\n")
    for section in sections:
        log(section)
    for warning in report.get("tokenizer_audit_warnings", []):
        log(f"data: tokenizer audit warning: {warning}")
    log(f"data: report {out / 'report.json'}, decisions {out / 'decisions.jsonl'}")
    return report
