"""Data curation: the whole pipeline from data.toml, or one stage at a time.

  ultratron data run [--config data.toml] [--section.field VALUE ...]
  ultratron data STAGE --input PATH --output DIR [--config data.toml] [--section.field VALUE ...]

Every field of data.toml can also be set as --section.field VALUE, e.g. --pipeline.workers 2,
--read.max_bytes 3000000 or --filter.enabled gopher_repetition,punctuation; overrides win over
the file. `run` runs pipeline.stages in order, each on the previous one's output, and writes a
report and a decision log; a rerun resumes finished stages and parts. A single stage reads JSONL
parts (`read` reads raw sources or "builtin") and writes JSONL parts plus a decision log.
See docs/data.md.
"""

from __future__ import annotations

import argparse
import json

RUN_DESCRIPTION = """\
  ultratron data run [--config data.toml] [--section.field VALUE ...]

Run every stage in pipeline.stages in order, each on the previous one's output, resuming
finished stages and parts; write report.json, report.md and decisions.jsonl to pipeline.output.
Every config field below can be set as --section.field VALUE; overrides win over the file."""

DECONTAMINATE_DESCRIPTION = """\
  ultratron data decontaminate --tasks builtin,my_task.jsonl --input PARTS [--output DIR]

Looks for the evaluation tasks' items in a corpus: every word 13-gram (lowercased, punctuation
stripped, unspaced scripts segmented) of each item of each task --tasks resolves to (the same
spelling as eval.tasks) is hashed, and every document of --input (a stage directory of JSONL parts,
or one JSONL file) that repeats one is counted under the task it repeats most. Prints per task the
items, n-grams and documents found, with examples. With --output the stage's parts are written
there, those documents removed (or, with --decontaminate.mode cut, the spans cut); without it, the
report only. docs/data.md explains the rules."""

STAGE_DESCRIPTION = """\
Reads --input (JSONL parts, or for `read` a raw source) and writes JSONL parts, a decision log
and stats to --output; a rerun resumes finished parts. The stage's settings come from --config
and --section.field VALUE overrides (the config fields below)."""


def _epilog() -> str:
    from ultratron.config.loader import describe_fields
    from ultratron.curation.config import STAGES, DataPipelineConfig

    stages = "\n".join(f"  {name:<16} {text}" for name, text in STAGES.items())
    return (f"stages, in pipeline order:\n{stages}\n\n"
            f"config fields (default), as [section] field = value in data.toml or --section.field VALUE:\n"
            f"{describe_fields(DataPipelineConfig)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ultratron.curation.config import STAGES

    epilog = _epilog()
    parser.epilog = epilog
    parser.set_defaults(_accepts_overrides=True)
    sub = parser.add_subparsers(dest="data_command", metavar="STAGE")
    run = sub.add_parser("run", help="every stage in pipeline.stages, resuming finished work",
                         description=RUN_DESCRIPTION, epilog=epilog,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--config", help="data.toml (default: the built-in corpus, the default stages)")
    run.add_argument("--workers", type=int, help="short for --pipeline.workers")
    run.add_argument("--input", help="short for --pipeline.input")
    run.add_argument("--output", help="short for --pipeline.output")
    for stage, text in STAGES.items():
        report = stage == "decontaminate"
        description = DECONTAMINATE_DESCRIPTION if report else f"Stage {stage!r}: {text}.\n\n{STAGE_DESCRIPTION}"
        sp = sub.add_parser(stage, help=f"run the {stage!r} stage alone", epilog=epilog, description=description,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        where = "a raw source: directory, file or 'builtin'" if stage == "read" else "a stage directory or JSONL file"
        sp.add_argument("--input", required=True, help=where)
        sp.add_argument("--output", required=not report, help="directory for this stage's parts"
                        + ("; none: print the report only" if report else ""))
        if report:
            sp.add_argument("--tasks", help="short for --decontaminate.tasks: builtin, built-in task names, task files")
        sp.add_argument("--config", help="data.toml for the stage's settings")
        sp.add_argument("--workers", type=int, help="short for --pipeline.workers")


def run(args: argparse.Namespace) -> int:
    from ultratron.curation.config import load_config
    from ultratron.curation.runner import run_pipeline, run_stage
    from ultratron.evaluation.builtin import task_texts

    stage = getattr(args, "data_command", None)
    if not stage:
        print(__doc__.strip())
        return 2
    shorthand = ["--pipeline.workers", str(args.workers)] if args.workers is not None else []
    if stage == "run":
        shorthand += ["--pipeline.input", args.input] if args.input is not None else []
        shorthand += ["--pipeline.output", args.output] if args.output is not None else []
    if getattr(args, "tasks", None) is not None:
        shorthand += ["--decontaminate.tasks", args.tasks]
    overrides = shorthand + list(getattr(args, "overrides", []))  # the dotted ones last: they win
    if stage == "run":
        run_pipeline(load_config(args.config, overrides), task_texts=task_texts)
        return 0
    cfg = load_config(args.config, overrides, stages=[stage])
    if args.output is None:  # decontaminate as a report: the stage's files go to a temporary directory
        import tempfile

        with tempfile.TemporaryDirectory(prefix="ultratron-decontaminate-") as tmp:
            summary = run_stage(stage, cfg, args.input, tmp, task_texts=task_texts)
    else:
        summary = run_stage(stage, cfg, args.input, args.output, task_texts=task_texts)
    shown = {k: summary[k] for k in ("stage", "docs_in", "docs_out", "bytes_in", "bytes_out", "tokens_out",
                                     "removed", "modified", "notes", "pii_replaced") if k in summary}
    print(json.dumps(shown, indent=2))
    if stage == "decontaminate":
        from ultratron.curation.stages.decontaminate import format_tasks

        print(format_tasks(summary))
        for reason, examples in sorted(summary["examples"].items()):
            for example in examples:
                print(f"{reason}: {example['id']}: {example['snippet'][:100]!r}")
    if summary.get("languages"):
        from ultratron.curation.report import format_languages

        print(format_languages([summary]))
    if summary.get("tokenizer_languages"):
        from ultratron.curation.stages.tokenize import format_language_table

        print("tokenizer by language:")
        print(format_language_table(summary["tokenizer_languages"]))
    return 0
