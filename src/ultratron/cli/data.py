"""Data curation: `ultratron data run --config data.toml`, or one stage at a time.

  ultratron data run --config configs/data.toml
  ultratron data STAGE --input PATH --output DIR [--config data.toml] [--workers N]

STAGE is one of read, normalize, exact-dedup, near-dedup, substring-dedup, filter, perplexity,
tokenize, shard. Each stage reads JSONL parts (`read` reads raw sources or "builtin") and writes
JSONL parts plus a decision log; see docs/data.md.
"""

from __future__ import annotations

import argparse
import json

from ultratron.curation.config import STAGES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="STAGE")
    run = sub.add_parser("run", help="every stage in data.toml's pipeline.stages, resuming finished work")
    run.add_argument("--config", help="data.toml (default: built-in corpus, default stages)")
    run.add_argument("--workers", type=int, help="override pipeline.workers")
    run.add_argument("--output", help="override pipeline.output")
    for stage in STAGES:
        sp = sub.add_parser(stage, help=f"run the '{stage}' stage alone on JSONL parts")
        where = "a stage directory or JSONL file"
        if stage == "read":
            where = "a raw source: directory, file or 'builtin'"
        sp.add_argument("--input", required=True, help=where)
        sp.add_argument("--output", required=True, help="directory for this stage's parts")
        sp.add_argument("--config", help="data.toml for the stage's settings")
        sp.add_argument("--workers", type=int, help="override pipeline.workers")


def run(args: argparse.Namespace) -> int:
    from ultratron.curation import config as pipeline_config
    from ultratron.curation.runner import run_pipeline, run_stage

    if not getattr(args, "data_command", None):
        print(__doc__.strip())
        return 2
    cfg = pipeline_config.load(args.config)
    if args.workers is not None:
        cfg.pipeline.workers = args.workers
    if args.data_command == "run":
        if args.output:
            cfg.pipeline.output = args.output
        run_pipeline(cfg)
        return 0
    summary = run_stage(args.data_command, cfg, args.input, args.output)
    shown = {k: summary[k] for k in ("stage", "docs_in", "docs_out", "bytes_in", "bytes_out", "tokens_out",
                                     "removed", "modified")}
    print(json.dumps(shown, indent=2))
    return 0
