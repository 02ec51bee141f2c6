"""Live recovery with torchft, proven by kill -9: `ultratron launch --replicas 2 --nproc-per-node 2`;
one process of replica group 1 is killed mid-run. Group 0 goes on alone without a gap longer than
the collective timeout plus a step, group 1 restarts by itself, heals from group 0 and rejoins;
both end at the configured step with equal weights, and every committed step advanced the global
data position by exactly what its participants read (so no sequence was lost or read twice)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_common import dist_base_fixture  # noqa: F401 (fixture)

from ultratron.checkpoint.inference import load_for_inference
from ultratron.launch.local import processes_with
from ultratron.training.metrics import read_metrics

pytest.importorskip("torchft")

STEPS, KILL_AT, TIMEOUT, PER_GROUP = 300, 15, 10, 8  # PER_GROUP: sequences a group reads a step (512 / 64)


ENV_TAG = f"replicas-{os.getpid()}"  # marks this test's processes in /proc


def _worker(group: int, rank: int | None = None, attempt: int = 0) -> list[int]:
    """PIDs of attempt `attempt`'s training processes in replica group `group` (of one `rank`, if given)."""
    ranks = {} if rank is None else {"RANK": str(rank)}
    return processes_with(ULTRATRON_REPLICA_GROUP=str(group), TORCHELASTIC_RESTART_COUNT=str(attempt),
                          ULTRATRON_TEST_RUN=ENV_TAG, **ranks)


def _hold_restart_until_alone(run: Path, job: subprocess.Popen) -> None:
    """Stop group 1's restarted ranks as they start and let them go once group 0 has committed a step
    alone. On a quiet machine the restart heals within ~2 s, sooner than the collective timeout in
    which group 0 notices the loss, so without this group 0 may never step alone and the test could
    not show that it goes on without waiting."""
    held: set[int] = set()
    deadline = time.monotonic() + 120
    try:
        while len(held) < 2 and time.monotonic() < deadline and job.poll() is None:
            for pid in set(_worker(1, attempt=1)) - held:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    held.add(pid)
            time.sleep(0.01)
        assert len(held) == 2, f"group 1 restarted {len(held)} of 2 ranks in 120 s"
        while not any(r["replicas"] == 1 and r["step"] >= KILL_AT for r in _steps(run / "replica-0")):
            assert job.poll() is None and time.monotonic() < deadline, "group 0 did not step alone in 120 s"
            time.sleep(0.05)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _slow_group_0_until_healed(run: Path, job: subprocess.Popen) -> None:
    """Pause group 0 for 0.2 s in every 0.25 s until group 1 has healed. A real job has far more steps
    left than this test's 300, which group 0 alone runs in ~15 s: on a loaded machine that was less
    than group 1's restart took, so group 0 had finished, and group 1 found no one to heal from
    (CI saw it). The pauses are far below the collective timeout and torchft's heartbeats, so the
    quorum and the heal itself go on as in a slower job."""
    group_0 = _worker(0)
    log = run / "replica-1" / "train.log"
    deadline = time.monotonic() + 180
    try:
        while job.poll() is None and time.monotonic() < deadline:
            if log.exists() and "replicas: healed from a live replica group" in log.read_text():
                return
            for pid in group_0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            time.sleep(0.2)
            for pid in group_0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
    finally:
        for pid in group_0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _steps(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if "loss" in r]


def test_kill_9_of_a_replica_group_the_other_goes_on_and_it_heals_and_rejoins(dist_base, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ultratron", "launch", "--replicas", "2", "--nproc-per-node", "2", "--max-restarts",
           "1", "--", *dist_base, "--training.batch_tokens", "512", "--parallel.dp", "2", "--training.steps",
           str(STEPS), "--checkpoint.interval", "10", "--training.log_interval", "10", "--eval.interval", "0",
           "--training.threads", "1", "--parallel.collective_timeout", str(TIMEOUT), "--run.dir", str(run),
           # a loss spike would roll back and skip its window's data, by design, which the exact data
           # accounting below does not expect: spikes only logged (the tiny model's loss jumps 5 % at times)
           "--stability.max_rollbacks", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ULTRATRON_TEST_RUN": ENV_TAG}
    output = tmp_path / "launch.out"  # a file, not a pipe: a pipe nobody reads stops the writers when full
    with open(output, "w") as out_file:
        job = subprocess.Popen(cmd, stdout=out_file, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            deadline = time.monotonic() + 240
            while not any(r["step"] >= KILL_AT for r in _steps(run / "replica-1")):
                assert job.poll() is None and time.monotonic() < deadline, output.read_text()[-4000:]
                time.sleep(0.05)
            victims = _worker(1, 1)
            assert len(victims) == 1, victims
            os.kill(victims[0], 9)
            killed_at = time.time()
            _hold_restart_until_alone(run, job)
            _slow_group_0_until_healed(run, job)
            job.wait(timeout=400)
        finally:
            job.kill()
    out = output.read_text()
    assert job.returncode == 0, out[-5000:]

    survivor, healed = _steps(run / "replica-0"), _steps(run / "replica-1")
    assert [r["step"] for r in survivor] == list(range(1, STEPS + 1))  # each optimizer step once, none extra
    alone = [r["step"] for r in survivor if r["replicas"] == 1]
    assert alone and min(alone) >= KILL_AT, alone  # it went on alone after the kill ...
    times = [r["time"] for r in survivor]
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    typical = sorted(b - a for a, b in zip(times, times[1:], strict=False))[len(times) // 2]
    assert gap <= TIMEOUT + typical + 2.0, (gap, typical)  # ... without waiting for the restart
    log = (run / "replica-1" / "train.log").read_text()
    assert "launch: restart 1 of this job" in log, log[-3000:]
    assert "replicas: healed from a live replica group" in log, log[-3000:]
    rejoined = next(r for r in survivor if r["step"] > max(alone))  # ... and the other came back
    assert rejoined["replicas"] == 2 and healed[-1]["step"] == STEPS
    print(f"longest gap in group 0: {gap:.1f} s (a step: {typical:.2f} s); group 1 rejoined "
          f"{rejoined['time'] - killed_at:.1f} s after the kill; group 0 alone for {len(alone)} steps")

    # the data position advanced by exactly what each committed step's participants read
    position = 0
    for r in survivor:
        position += r["replicas"] * PER_GROUP
        assert r["sequences"] == position, (r["step"], r["sequences"], position)
    assert healed[-1]["sequences"] == position
    final = [load_for_inference(run / f"replica-{g}").model.state_dict() for g in (0, 1)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])  # the same weights, bit for bit
