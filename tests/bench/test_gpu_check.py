"""`benchmarks/gpu_check.py`, the prepared GPU check, run as a CPU runs it: the tiny size, every row
with a measured and a planned figure and exit 0; a figure that cannot be had turns its row into
"missing: why" and the exit non-zero; the time limit is in --help and a watchdog enforces it. The
figures themselves are the benchmark's to print, not the test's to judge."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("ultratron_gpu_check", SCRIPT)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(bench, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = bench.main(list(argv))
    return code, out.getvalue()


def _rows(text: str) -> dict[str, list[str]]:
    """The table's rows by name: [what, measured, planned, measured ÷ planned, seconds]."""
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| row ")]
    return {c[0]: c[1:] for c in cells}


@pytest.fixture(scope="module")
def bench():
    return _benchmark()


@pytest.fixture(scope="module")
def tiny_run(bench):
    # the limit raised well past the tiny size's 2 minutes: this machine's cores are shared with the suite
    return _run(bench, "--tiny", "--limit", "1800")


def test_every_row_has_a_measured_and_a_planned_figure(bench, tiny_run):
    code, text = tiny_run
    print(text)
    rows = _rows(text)
    assert list(rows) == list(bench.ROWS), text
    for name, (_, measured, planned, ratio, _) in rows.items():
        assert not measured.startswith("missing"), (name, measured)
        assert re.search(r"\d", measured) and re.search(r"\d", planned), (name, measured, planned)
        assert re.fullmatch(r"\d+\.\d\d", ratio), (name, ratio)
    assert code == 0, text
    assert f"{len(bench.ROWS)} of {len(bench.ROWS)} rows measured and planned" in text


def test_a_figure_that_fails_is_missing_with_its_reason_and_the_exit_is_not_zero(bench, monkeypatch):
    def out_of_memory(self, cfg, forward_only=False):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(bench.Check, "train", out_of_memory)
    code, text = _run(bench, "--tiny", "--only", "eager,health", "--limit", "1800")
    rows = _rows(text)
    assert code == bench.EXIT_MISSING, text
    assert rows["eager"][1] == "missing: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", text
    assert not rows["health"][1].startswith("missing"), text  # the other rows still run
    assert "1 of 2 rows measured and planned" in text and "missing: eager" in text


def test_a_config_without_model_attention_says_so(bench, monkeypatch):
    """Where `model.attention` does not exist the flex row says that, rather than measuring something else."""
    from ultratron.errors import ConfigError

    def no_field(self, **fields):
        if "model.attention" in fields:
            raise ConfigError(["unknown field model.attention"])
        return original(self, **fields)

    original = bench.Check.config
    monkeypatch.setattr(bench.Check, "config", no_field)
    code, text = _run(bench, "--tiny", "--only", "flex-vs-sdpa", "--limit", "1800")
    assert code == bench.EXIT_MISSING, text
    assert _rows(text)["flex-vs-sdpa"][1].startswith("missing: model.attention not available"), text


def test_the_time_limit_is_stated_and_enforced(bench):
    help_text = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                               timeout=300).stdout
    assert f"Time limit: {bench.GPU_LIMIT_S // 60} minutes on a GPU" in " ".join(help_text.split())
    stopped = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--limit", "1"], capture_output=True, text=True,
                             timeout=600)
    assert stopped.returncode == bench.EXIT_TIME, stopped.stdout + stopped.stderr
    assert "the time limit of 1 s was reached; not measured:" in stopped.stdout
