"""Shared setup of the multi-process tests: one tokenized corpus for every run, one-process
reference runs, and a helper that launches N ranks running several training runs in a row.
(Not a conftest.py: a second module named conftest would shadow tests/conftest.py for the
modules that import from it.) Test modules import the fixtures by their *_fixture names."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ultratron.config import load_config
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import train


def _root_conftest():
    # tests/conftest.py holds TINY; it is imported by file so this module's name cannot shadow it.
    spec = importlib.util.spec_from_file_location("_ultratron_root_conftest", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = _root_conftest().TINY
STEPS = 5
_SESSION: dict = {}
# batch 1024 tokens = 16 sequences of 64: one process accumulates 4 micro-batches of 4, dp2 runs 2
# per rank (so no_sync / set_requires_gradient_sync are exercised) and dp4 runs one.
BATCH = ["--training.batch_tokens", "1024", "--training.steps", str(STEPS), "--eval.interval", "0"]


def records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


def launch(world: int, runs: list[list[str]]) -> None:
    from dist_jobs import train_runs

    from ultratron.launch.local import run_local

    run_local(world, train_runs, runs)


@pytest.fixture(scope="session", name="dist_base")
def dist_base_fixture(small_corpus, tmp_path_factory) -> list[str]:
    if "dist_base" in _SESSION:
        return _SESSION["dist_base"]
    data = tmp_path_factory.mktemp("dist-data")
    base = TINY + BATCH + ["--data.path", str(small_corpus), "--data.extensions", ".py", "--data.cache_dir", str(data)]
    _SESSION["dist_base"] = base
    return base


@pytest.fixture(scope="session", name="references")
def references_fixture(dist_base, tmp_path_factory) -> dict[str, list[dict]]:
    """One-process runs in fp32 and bf16 (these also tokenize the corpus for everyone else).
    Each test module imports this fixture, so the result is kept here to run once per session."""
    if "references" in _SESSION:
        return _SESSION["references"]
    out = _SESSION["references"] = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path_factory.mktemp(f"ref-{precision}")
        train(load_config(None, dist_base + ["--training.precision", precision, "--run.dir", str(run)]), echo=False)
        out[precision] = records(run)
        assert [r["step"] for r in out[precision]] == list(range(1, STEPS + 1))
    return out
