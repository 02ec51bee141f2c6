"""A layout that does not divide stops before training with one clear message; `ultratron train`
runs under torchrun as written; `ultratron launch` builds the torchrun command and a Slurm script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dist_common import STEPS, TINY, assert_equivalent, dist_base_fixture, references_fixture  # noqa: F401

from ultratron.cli import main


def _cli(*args: str, env_extra: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_tp_that_does_not_divide_heads_stops_with_one_message(tmp_path):
    run = tmp_path / "run"
    result = _cli("-m", "ultratron", "train", *TINY, "--model.n_heads", "8", "--model.n_kv_heads", "8",
                  "--parallel.tp", "3", "--run.dir", str(run))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: parallel.tp=3 does not divide model.n_heads=8, model.n_kv_heads=8, model.ffn_dim=128 "
                      "and model.vocab_size=512"]
    assert "Traceback" not in result.stderr and not run.exists()


def test_world_size_not_equal_to_the_layout_stops_before_training(tmp_path):
    run = tmp_path / "run"
    result = _cli("-m", "ultratron", "train", *TINY, "--parallel.dp", "2", "--parallel.tp", "2", "--run.dir", str(run),
                  env_extra={"WORLD_SIZE": "2", "RANK": "0"})
    assert result.returncode == 2, result.stderr
    assert "dp×tp×pp×cp = 2×2×1×1 = 4 does not equal the number of processes (2)" in result.stderr
    assert "Traceback" not in result.stderr and not (run / "metrics.jsonl").exists()


def test_hsdp_needs_a_sharded_stage(tmp_path):
    result = _cli("-m", "ultratron", "train", *TINY, "--training.batch_tokens", "1024", "--parallel.dp", "4",
                  "--parallel.dp_replicate", "2",
                  "--run.dir", str(tmp_path / "run"), env_extra={"WORLD_SIZE": "4", "RANK": "0"})
    assert result.returncode == 2 and "needs parallel.zero 2 or 3, got 0" in result.stderr


def test_train_under_torchrun_two_processes(dist_base, references, tmp_path):
    run = tmp_path / "run"
    result = _cli("-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m", "ultratron", "train",
                  *dist_base, "--parallel.dp", "2", "--parallel.zero", "3", "--run.dir", str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_equivalent(run, references["fp32"], "fp32", "torchrun dp2 zero3")  # each step logged once, by rank 0
    assert (run / "checkpoints" / f"step-{STEPS:07d}" / "dcp" / ".metadata").is_file()
    assert (run / "train.log").read_text().count(f"checkpoint: saved step {STEPS}") == 1


def test_train_leaves_the_process_group_it_joined(dist_base, tmp_path):
    """A rank that exits with its gloo group alive can abort while Python shuts down; `train` destroys
    the group it created once every rank is done (a group the caller made stays, see dist_jobs)."""
    import json

    from dist_jobs import train_joining_the_group_itself

    from ultratron.launch.local import run_local

    run_local(2, train_joining_the_group_itself, dist_base, str(tmp_path), join_group=False)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"steps": STEPS, "group_after": False}


def test_each_launch_gives_its_ranks_the_callers_environment_of_the_moment(tmp_path, monkeypatch):
    """run_local forks the ranks from a fork server that an earlier launch started, with the environment
    of then: a variable set since must still reach the ranks, as a spawned rank's would."""
    import json

    from dist_jobs import write_environment

    from ultratron.launch.local import run_local

    run_local(2, write_environment, ["ULTRATRON_TEST_MARK"], str(tmp_path / "first"))  # (the fork server runs)
    monkeypatch.setenv("ULTRATRON_TEST_MARK", "set since")
    run_local(2, write_environment, ["ULTRATRON_TEST_MARK"], str(tmp_path / "second"))
    for launch, expected in (("first", None), ("second", "set since")):
        for rank in range(2):
            got = json.loads((tmp_path / launch / f"rank{rank}.json").read_text())
            assert got == {"ULTRATRON_TEST_MARK": expected, "RANK": str(rank)}, (launch, rank)


def test_launch_dry_run_and_slurm_script(tmp_path, capsys):
    assert main(["launch", "--nproc-per-node", "4", "--dry-run", "--", "--parallel.tp", "2"]) == 0
    printed = capsys.readouterr().out.split()
    endpoint = printed[7].removeprefix("--rdzv-endpoint=")  # a free loopback port, not a fixed one
    assert endpoint.startswith("127.0.0.1:") and int(endpoint.split(":")[1]) > 0
    assert printed[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=1", "--max-restarts=0",
                           "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=ultratron", "-m",
                           "ultratron", "train", "--parallel.tp", "2"]
    script, config = tmp_path / "job.sbatch", tmp_path / "run.toml"
    config.write_text(f'[run]\ndir = "{tmp_path / "myrun"}"\n')
    assert main(["launch", "--nproc-per-node", "8", "--nnodes", "2", "--slurm", str(script), "--",
                 "--config", str(config)]) == 0
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --requeue" in text
    assert "--rdzv-endpoint=$HEAD_NODE:$PORT" in text and "--nnodes=2" in text and "29500" not in text
    assert f"-m ultratron train --config {config} --checkpoint.resume auto\nrc=$?" in text
    assert f"RUN_DIR={tmp_path / 'myrun'}" in text
    assert main(["launch", "--nproc-per-node", "2", "--nnodes", "2", "--dry-run"]) == 2  # needs an endpoint


def test_the_slurm_script_excludes_failing_nodes_when_it_resubmits(tmp_path):
    """The script's own logic, run by bash with stand-ins for srun, scontrol and sbatch."""
    script = tmp_path / "job.sbatch"
    assert main(["launch", "--nproc-per-node", "1", "--slurm", str(script), "--", "--run.dir",
                 str(tmp_path / "run")]) == 0
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    shims = {
        "scontrol": "echo node1",
        # `srun ... ultratron health --unhealthy-file F` marks $FAKE_BAD (if set) as failing; other sruns are training
        "srun": 'if [[ "$*" == *"ultratron health"* ]]; then f="${@: -1}"; [ -n "${FAKE_BAD:-}" ] && '
                'echo "$FAKE_BAD" >> "$f"; exit 0; fi; echo "train $*" >> "$CALLS"; '
                '[ -n "${FAKE_BAD_LATER:-}" ] && echo "$FAKE_BAD_LATER" >> "$RUN_DIR_FOR_TEST/unhealthy-nodes.txt"; '
                'exit "${FAKE_RC:-0}"',
        "sbatch": 'echo "sbatch $*" >> "$CALLS"',
    }
    for name, body in shims.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)

    def job(**env) -> int:
        calls.unlink(missing_ok=True)
        full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "SLURM_JOB_ID": "7",
                "SLURM_JOB_NODELIST": "node[1-2]", "RUN_DIR_FOR_TEST": str(tmp_path / "run"), **env}
        return subprocess.run(["bash", str(script)], env=full, capture_output=True, text=True).returncode

    assert job() == 0
    assert calls.read_text().startswith("train --kill-on-bad-exit=1 ")
    port = calls.read_text().split("--rdzv-endpoint=node1:")[1].split()[0]  # a free port of the head node
    assert port.isdigit() and port != "29500"  # healthy: trains, no resubmission
    assert job(FAKE_BAD="node2") == 1  # the pre-check fails node2: no training, resubmitted without it
    assert calls.read_text() == f"sbatch --exclude=node2 {script.resolve()}\n"
    # training fails and the trainer's health monitor named node1: resubmitted without both
    assert job(FAKE_RC="3", FAKE_BAD_LATER="node1") == 1
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("train ") and lines[1] == f"sbatch --exclude=node1,node2 {script.resolve()}"
    assert job(FAKE_RC="3") == 3  # a failure with no unhealthy node: Slurm's requeue / torchrun decide


def test_two_launches_on_one_machine_at_once_both_finish(dist_base, tmp_path):
    """Each takes a free port for its rendezvous (torch's default 29500 would be taken by the first)."""
    from ultratron.config import load_config
    from ultratron.data.prepare import prepare_data

    cfg = load_config(None, dist_base)  # the shared data cache is written once, before both read it
    prepare_data(cfg.data, cfg.model.vocab_size, Path(cfg.data.cache_dir), log=lambda _: None)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = [subprocess.Popen([sys.executable, "-m", "ultratron", "launch", "--nproc-per-node", "2", "--", *dist_base,
                              "--parallel.dp", "2", "--training.steps", "2", "--eval.interval", "0",
                              "--training.sample_tokens", "0", "--run.dir", str(tmp_path / f"run{i}")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    outs = [job.communicate(timeout=300)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], "\n=====\n".join(out[-6000:] for out in outs)
    ports = [out.split("launch: rendezvous on 127.0.0.1:")[1].split()[0] for out in outs]
    assert ports[0] != ports[1], ports
    for i in range(2):
        assert "checkpoint: saved step 2" in (tmp_path / f"run{i}" / "train.log").read_text()
