"""`ultratron bench sweep` end to end on CPU: a 4-process grid (two layouts that train, one the
config's rules refuse) and a layout that fails once its process starts, each cell its own
`ultratron train` process (under torchrun for several ranks); one CSV, a markdown table and a
heatmap PNG with the planner's prediction and the error beside each measurement;
run again, it reruns nothing finished."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from conftest import TINY

STEPS = 2


def sweep(out, data, corpus, *extra):
    """Run the sweep CLI in a subprocess (as a user would); returns the CompletedProcess."""
    train = list(TINY)
    train[train.index("--training.batch_tokens") + 1] = "1024"  # 16 sequences: 1 micro-batch per rank at dp4
    train += ["--data.path", str(corpus), "--data.extensions", ".py",
              "--data.cache_dir", str(data), "--health.check", "false"]
    cmd = [sys.executable, "-m", "ultratron", "bench", "sweep", "--out", str(out), "--gpu", "cpu",
           "--steps", str(STEPS), "--timeout", "300", "--grid", "dp=2,4 tp=1,2", "--gpus", "4",
           "--layout", "dp=1 tp=4", "--layout", "dp=1 training.device=cuda", *extra, "--", *train]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


@pytest.fixture(scope="module")
def swept(small_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "grid"
    data = tmp_path_factory.mktemp("sweep-data")
    first = sweep(out, data, small_corpus)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return out, data, first


def test_every_cell_is_measured_or_reported_with_its_cause(swept):
    out, _, _ = swept
    rows = {r["name"]: r for r in csv.DictReader((out / "sweep.csv").open())}
    assert set(rows) == {"tiny_dp1_tp4", "tiny_dp1_device-cuda", "tiny_dp2_tp2", "tiny_dp4_tp1"}
    assert rows["tiny_dp1_tp4"]["status"] == "refused"
    assert "parallel.tp=4 does not divide" in rows["tiny_dp1_tp4"]["cause"]
    failed = rows["tiny_dp1_device-cuda"]
    assert failed["status"] == "failed" and "training.device=cuda but no CUDA device" in failed["cause"]
    for name in ("tiny_dp2_tp2", "tiny_dp4_tp1"):
        row = rows[name]
        assert row["status"] == "ok" and int(row["steps"]) == STEPS and row["world"] == "4"
        assert row["dp"] == name[len("tiny_dp")] and row["zero"] == "0"
        measured, predicted = float(row["tokens_per_sec_per_gpu"]), float(row["predicted_tokens_per_sec_per_gpu"])
        assert measured > 0 and predicted > 0
        assert float(row["tokens_error"]) == pytest.approx(measured / predicted - 1)
        assert 0 < float(row["mfu"]) < 1 and float(row["predicted_mfu"]) > 0 and row["mfu_error"]
        assert float(row["predicted_peak_bytes"]) > 0 and row["memory_measured_as"] == "process rss"
        assert row["memory_error"] == ""  # a CPU's resident set is not what the planner predicts
    table = (out / "sweep.md").read_text()
    assert all(f"| {name} |" in table for name in rows) and "error = measured / predicted − 1" in table
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_second_run_reruns_no_finished_cell(swept, small_corpus):
    out, data, _ = swept
    results = sorted((out / "cells").glob("*/result.json"))
    stamps = [p.stat().st_mtime_ns for p in results]
    again = sweep(out, data, small_corpus)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "launch" not in again.stdout and [p.stat().st_mtime_ns for p in results] == stamps
    assert "4 cells: 1 refused, 1 failed, 2 ok" in again.stdout


def test_slurm_array_runs_one_cell_per_task(swept, small_corpus, tmp_path):
    out, data, _ = swept
    script = tmp_path / "sweep.sbatch"
    written = sweep(out, data, small_corpus, "--slurm", str(script))
    assert written.returncode == 0, written.stderr[-3000:]
    text = script.read_text()
    assert "#SBATCH --array=0-3" in text and "#SBATCH --gpus-per-node=4" in text
    assert '--cell "$SLURM_ARRAY_TASK_ID" --launcher slurm' in text
    one = subprocess.run([sys.executable, "-m", "ultratron", "bench", "sweep", "--out", str(out), "--cell", "3"],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and "1 cells: 1 ok" in one.stdout  # finished already: read, not rerun
