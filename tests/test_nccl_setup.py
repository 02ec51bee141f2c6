"""The NCCL path's decisions, on a CPU (issue 45, part 3): the environment set before the group is
created (async error handling, the flight recorder and its dump on a timeout under the run
directory), `device_id` at `init_process_group`, abort rather than destroy after a failure, and the
NCCL watchdog's dump read by `ultratron doctor` like the records Python writes."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ultratron.parallel import dims as dims_module
from ultratron.parallel import faults
from ultratron.parallel.dims import ParallelDims, process_group_args
from ultratron.parallel.hangs import FLIGHT_DIR, findings, read_records

NCCL_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
             "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_BUFFER_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in NCCL_VARS:
        monkeypatch.delenv(name, raising=False)


def test_cuda_env_handles_errors_and_dumps_under_the_run_dir(tmp_path):
    env = faults.process_group_env("cuda", tmp_path)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) == int(env["TORCH_FR_BUFFER_SIZE"]) == faults.RECORDS
    assert Path(env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent == tmp_path / FLIGHT_DIR


def test_cpu_env_is_the_flight_recorder_only():
    assert set(faults.process_group_env("cpu", "run")) == {"TORCH_FR_BUFFER_SIZE"}


def test_the_users_own_setting_wins(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    applied = faults.enable_flight_recorder("cuda", tmp_path)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == applied["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert (tmp_path / FLIGHT_DIR).is_dir()


def test_a_later_run_in_the_process_dumps_under_its_own_run_dir(clean_env, tmp_path):
    faults.enable_flight_recorder("cuda", tmp_path / "a")
    applied = faults.enable_flight_recorder("cuda", tmp_path / "b")
    assert Path(applied["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent == tmp_path / "b" / FLIGHT_DIR


def test_init_args_by_device():
    assert process_group_args(torch.device("cuda", 3)) == {"backend": "nccl", "device_id": torch.device("cuda", 3)}
    assert process_group_args(torch.device("cpu")) == {"backend": "gloo"}


def test_init_on_cuda_sets_the_env_first_and_passes_device_id(clean_env, monkeypatch, tmp_path):
    """`init_distributed` on a GPU node, with the CUDA and process-group calls stood in for."""
    seen = {}

    def init_process_group(**kwargs):
        seen.update(kwargs, env={name: os.environ.get(name) for name in NCCL_VARS})

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("set_device", device))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(ParallelDims, "build_mesh", lambda self, device_type="cpu": None)
    dims = ParallelDims(dp=2, world_size=2, rank=1, local_rank=1)
    assert dims.init_distributed(torch.device("cuda"), tmp_path) == torch.device("cuda", 1)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1) == seen["set_device"]
    assert seen["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert seen["env"]["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(tmp_path / FLIGHT_DIR))


def test_leaving_after_a_failure_aborts_the_groups(monkeypatch):
    """A real gloo group: aborted (its pending work dropped), never destroyed (which waits for it)."""
    destroyed = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: destroyed.append(a))
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(2))
        faults.leave_after_failure()
        assert not dist.is_initialized() and destroyed == []
    finally:
        if dist.is_initialized():
            dims_module.dist.distributed_c10d._abort_process_group()


def _entry(seq: int, op: str = "nccl:all_reduce") -> dict:
    return {"collective_seq_id": seq, "profiling_name": op, "process_group": ("0", "default_pg"),
            "input_sizes": [[4]], "time_created_ns": 1_000_000_000 * seq, "is_p2p": False}


def test_doctor_reads_the_nccl_watchdogs_dump(tmp_path):
    """Rank 0 wrote its record in Python (it waited in all-reduce #5); rank 1's process was ended by the
    NCCL watchdog, which dumped its record (last collective #4): the doctor names rank 1 as behind."""
    flight = tmp_path / FLIGHT_DIR
    flight.mkdir()
    (flight / "rank-0.json").write_text(json.dumps({
        "rank": 0, "world_size": 2, "reason": "DistBackendError: timed out", "own_error": False, "time": 10.0,
        "flight": {"entries": [_entry(4), _entry(5)]}}), encoding="utf-8")
    dump = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "entries": [_entry(3), _entry(4)]}
    (flight / f"{faults.NCCL_DUMP_PREFIX}1").write_bytes(pickle.dumps(dump))
    assert sorted(r.rank for r in read_records(tmp_path)) == [0, 1]
    lines = findings(tmp_path)
    assert any(line.startswith("rank 1 never arrived at nccl:all_reduce #5") for line in lines), lines
    assert not any("left no flight record" in line for line in lines), lines


class Payload:
    def __reduce__(self):
        return (os.system, ("echo never",))


def test_a_dump_that_names_code_is_not_loaded(tmp_path):
    flight = tmp_path / FLIGHT_DIR
    flight.mkdir()
    (flight / f"{faults.NCCL_DUMP_PREFIX}0").write_bytes(pickle.dumps({"entries": [Payload()]}))
    assert read_records(tmp_path) == []
