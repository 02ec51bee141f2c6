"""The sweep's parts without processes: layouts from lists, grids and the planner's top-K; the
command a cell runs; how a failure's cause is read from its log; a sweep directory's settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from ultratron.bench.cells import layout_cells, top_cells
from ultratron.bench.run import _cause, command, open_sweep, read_result, retry
from ultratron.config import load_config
from ultratron.errors import UserError
from ultratron.planning.hardware import get_accelerator


def test_grids_take_the_product_and_keep_the_gpu_count():
    cells = layout_cells(["tiny", "llama3-1b"], ["dp=2 tp=2 training.precision=bf16"], ["dp=1,2,4 tp=1,2 pp=1,2"], 4)
    explicit = [c for c in cells if c.source == "explicit"]
    assert [c.name for c in explicit] == ["tiny_dp2_tp2_precisionbf16", "llama3-1b_dp2_tp2_precisionbf16"]
    grid = [c for c in cells if c.source == "grid"]
    assert {(c.get("dp"), c.get("tp"), c.get("pp")) for c in grid} == {
        ("4", "1", "1"), ("2", "2", "1"), ("2", "1", "2"), ("1", "2", "2")}
    assert all(c.world == 4 for c in cells) and len(grid) == 8  # 4 layouts × 2 models
    assert explicit[0].overrides == ["--model.preset", "tiny", "--parallel.dp", "2", "--parallel.tp", "2",
                                     "--training.precision", "bf16"]


def test_bad_layout_words_say_what_is_wrong():
    with pytest.raises(UserError) as err:
        layout_cells(["tiny"], ["dp=2 tpp=2 pp"], [], None)
    text = "\n".join(err.value.problems)
    assert "unknown layout field 'tpp'" in text and "'pp' is not FIELD=VALUE" in text
    with pytest.raises(UserError, match="several values for parallel.dp; use --grid"):
        layout_cells(["tiny"], ["dp=1,2"], [], None)


def test_top_k_comes_from_the_planner():
    cells = top_cells(["llama3-8b"], lambda m: load_config(None, ["--model.preset", m, "--training.seq_len", "8192",
                                                                   "--training.batch_tokens", str(2**20),
                                                                   "--training.precision", "bf16"]),
                      get_accelerator("h100-sxm"), 8, 8, 3)
    assert [c.source for c in cells] == ["top-1", "top-2", "top-3"] and all(c.world == 8 for c in cells)


def test_a_cell_runs_train_alone_torchrun_on_a_node_or_srun_over_nodes(monkeypatch):
    path = Path("c.toml")
    assert command(1, path, "local", 8)[3:] == ["train", "--config", "c.toml"]
    assert command(4, path, "local", 8)[3:7] == ["launch", "--nproc-per-node", "4", "--"]
    monkeypatch.setenv("ULTRATRON_HEAD_NODE", "node7")
    multi = command(16, path, "slurm", 8)
    assert multi[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"]
    assert "--nnodes" in multi and "node7:29500" in multi and multi[multi.index("--nproc-per-node") + 1] == "8"


def test_the_cause_of_a_failure_is_read_from_its_log():
    assert _cause("boom\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")[0] == "oom"
    assert _cause("error: training.device=cuda but no CUDA device is available\n") == (
        "failed", "training.device=cuda but no CUDA device is available")
    log = ("[rank1]: RuntimeError: Connection reset by peer\n[rank0]: Traceback (most recent call last):\n"
           "ValueError: the real cause\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert _cause(log) == ("failed", "ValueError: the real cause")
    assert _cause("") == ("failed", "no output")


def test_a_sweep_keeps_its_settings_and_forgets_only_failures(tmp_path):
    cells = layout_cells(["tiny"], ["dp=1", "dp=2"], [], None)
    sweep = open_sweep(tmp_path, cells[:1], None, ["--training.seq_len", "64"], 2, 60, 8)
    again = open_sweep(tmp_path, cells, None, ["--training.seq_len", "64"], 2, 60, 8)
    assert [c.name for c in again.cells] == ["tiny_dp1", "tiny_dp2"]  # new cells join after the old
    with pytest.raises(UserError, match="was swept with steps 2, not 3"):
        open_sweep(tmp_path, cells, None, ["--training.seq_len", "64"], 3, 60, 8)
    for cell, status in zip(again.cells, ("ok", "oom"), strict=True):
        path = again.cell_dir(cell) / "result.json"
        path.parent.mkdir(parents=True)
        path.write_text(f'{{"status": "{status}"}}')
    assert retry(again, ("failed", "oom", "timeout")) == 1
    assert read_result(sweep, cells[0]) == {"status": "ok"} and read_result(sweep, cells[1]) is None
