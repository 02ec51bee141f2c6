"""The `ultratron` command: the top layer. It parses and calls one entry point per verb.

Each subcommand is a module of this package with `add_arguments(parser)` and `run(args) -> int`;
a module is imported only when its subcommand runs (or for --help), and keeps its own heavy
imports inside `run`, so that torch-free commands such as `ultratron plan` start instantly.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys

from ultratron.errors import UserError, format_user_error

# name → (module, one-line help). Modules keep their top-level imports light.
COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("ultratron.cli.quickstart", "built-in corpus → tokenizer → shards → train → validate → sample"),
    "train": ("ultratron.cli.train", "train a model: ultratron train [--config FILE] [--section.field VALUE ...]"),
    "report": ("ultratron.cli.report", "draw a run's curves (loss, grad norm, lr, tokens/s) into one PNG"),
    "plan": ("ultratron.cli.plan", "memory per GPU, step time, compute-optimal scaling, fastest parallel layout"),
    "simulate": ("ultratron.cli.simulate", "rehearse a launch on a CPU: the real step of each rank on a fake process "
                                           "group; memory, FLOPs, collectives checked"),
    "bench": ("ultratron.cli.bench", "sweep parallel layouts × models: measured tokens/s, MFU, memory vs the planner"),
    "data": ("ultratron.cli.data", "data curation pipeline: read, dedup, filter, tokenize, shard"),
    "launch": ("ultratron.cli.launch", "ultratron train on N processes via torchrun, or a Slurm script"),
    "doctor": ("ultratron.cli.doctor", "why a distributed run failed or hung: the rank and collective it waited on"),
    "health": ("ultratron.cli.health", "check this node's GPUs (NVML) and time a matmul; exit 1 if a GPU fails"),
    "eval": ("ultratron.cli.eval", "evaluate a checkpoint or an OpenAI-compatible endpoint on task suites"),
    "serve": ("ultratron.cli.serve", "serve a checkpoint behind an OpenAI-compatible HTTP API"),
    "export": ("ultratron.cli.export", "export a checkpoint: ultratron export hf --checkpoint DIR --out DIR"),
    "import": ("ultratron.cli.importer", "import a model: ultratron import hf --model HF_DIR --out RUN_DIR"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ultratron",
        description="Train large language models from one laptop CPU to thousands of GPUs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


def entry() -> None:
    """The `ultratron` command and `python -m ultratron`: `main`, then the process ends. Before it
    does, one collection runs the finalizers of whatever cyclic garbage is left (files flush), and
    every object still alive is frozen out of the collector: the interpreter's own collections at
    exit would walk them all again only for the memory to go back to the OS whole (~30 ms of
    `ultratron eval --endpoint`'s wall time, ~17 ms with this)."""
    code = main()
    gc.collect()
    gc.freeze()
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only)
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    if extra and not getattr(args, "_accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    try:
        return int(args._run(args) or 0)
    except UserError as err:
        print(format_user_error(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ultratron plan ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
