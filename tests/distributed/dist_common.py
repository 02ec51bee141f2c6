"""Shared setup of the multi-process tests: one tokenized corpus for every run, one-process
reference runs, and a helper that launches N ranks running several training runs in a row."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ultratron.training.metrics import read_metrics


def _root_conftest():
    # tests/conftest.py holds TINY; it is imported by file so this module's name cannot shadow it.
    spec = importlib.util.spec_from_file_location("_ultratron_root_conftest", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = _root_conftest().TINY
STEPS = 5
# batch 1024 tokens = 16 sequences of 64: one process accumulates 4 micro-batches of 4, dp2 runs 2
# per rank (so no_sync / set_requires_gradient_sync are exercised) and dp4 runs one.
BATCH = ["--training.batch_tokens", "1024", "--training.steps", str(STEPS), "--eval.interval", "0"]


def records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


def launch(world: int, runs: list[list[str]]) -> None:
    from dist_jobs import train_runs

    from ultratron.parallel.local import run_local

    run_local(world, train_runs, runs)
