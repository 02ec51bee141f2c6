"""The supervisor, proven by kill -9: `ultratron launch --max-restarts 2` restarts the whole group
after a rank dies, the restarted group rendezvouses again (gloo on CPU), resumes from the newest
verified checkpoint by itself, and ends with the weights of a run that was never interrupted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
import torch
from dist_common import dist_base_fixture, records, weights_gap  # noqa: F401 (fixtures)

from tolerances import LAYOUTS
from ultratron.checkpoint.inference import load_for_inference
from ultratron.config import load_config
from ultratron.launch.local import processes_with
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import train

STEPS, INTERVAL = 40, 10
RUN = ["--training.steps", str(STEPS), "--checkpoint.interval", str(INTERVAL), "--training.threads", "1"]


def _workers(marker: str, rank: int) -> list[int]:
    """PIDs of the first attempt's training processes of rank `rank` of the job tagged `marker`."""
    return processes_with(ULTRATRON_TEST_JOB=marker, RANK=str(rank), TORCHELASTIC_RESTART_COUNT="0")


@pytest.fixture(scope="module")
def uninterrupted(dist_base, tmp_path_factory):
    """One process, never interrupted: every layout trains like it (tests/distributed/test_dist_equivalence)."""
    run = tmp_path_factory.mktemp("uninterrupted")
    train(load_config(None, dist_base + RUN + ["--run.dir", str(run)]), echo=False)
    return run


@pytest.mark.parametrize("world", [2, 4])
def test_kill_9_of_one_rank_and_the_job_finishes_by_itself(world, dist_base, uninterrupted, tmp_path):
    run, marker = tmp_path / "run", uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ULTRATRON_TEST_JOB": marker}
    cmd = [sys.executable, "-m", "ultratron", "launch", "--nproc-per-node", str(world), "--max-restarts", "2", "--",
           *dist_base, *RUN, "--parallel.dp", str(world), "--run.dir", str(run)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / f"step-{INTERVAL:07d}" / "complete").is_file():
            assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:]
            time.sleep(0.05)
        victims = _workers(marker, world - 1)
        assert len(victims) == 1, victims
        os.kill(victims[0], 9)
        out, _ = job.communicate(timeout=400)
    finally:
        job.kill()
    assert job.returncode == 0, out[-4000:]
    log = (run / "train.log").read_text()
    assert "launch: restart 1 of this job" in log, log[-3000:]
    resumed = [line for line in log.splitlines() if "checkpoint: resumed from" in line]
    # on failure, what the supervisor saw: each attempt's end and the job's output
    why = "\n".join([*resumed, *(line for line in log.splitlines() if "launch:" in line), out[-3000:]])
    assert len(resumed) == 1 and any(f"at step {s}" in resumed[0] for s in (INTERVAL, 2 * INTERVAL)), why
    assert [r["restarts"] for r in read_metrics(run) if "restarts" in r] == [1]
    assert [r["step"] for r in records(run)] == list(range(1, STEPS + 1))  # each step once, after the trim

    # dp ranks against one process, as every layout is compared (tests/tolerances.py, LAYOUTS)
    assert weights_gap(run, uninterrupted) <= LAYOUTS["fp32"]["weights"]
    final = load_for_inference(run).model.state_dict()
    assert not torch.equal(final["tok_embeddings.weight"], load_for_inference(
        run / "checkpoints" / f"step-{(STEPS - INTERVAL):07d}").model.state_dict()["tok_embeddings.weight"])
