"""A rank that hangs or fails does not hold the others: they stop within parallel.collective_timeout,
name the failing rank in one line, and every rank leaves a flight record from which
`ultratron doctor` names the rank and the collective it was waited on in."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from dist_common import dist_base_fixture  # noqa: F401 (fixture)

from ultratron.cli import main
from ultratron.config import load_config
from ultratron.data.prepare import prepare_data
from ultratron.launch.local import free_port

# The patched trainer of a driver process: on rank VICTIM, before optimizer step AT, raise or sleep.
DRIVER = '''
import os, sys, time
from pathlib import Path
from ultratron.cli import main
from ultratron.training import trainer

mode, victim, at, marker = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
step = trainer.Trainer.train_step


def planted(self):
    if int(os.environ["RANK"]) == victim and self.step + 1 == at:
        marker.write_text(str(time.time()))
        if mode == "raise":
            raise ValueError("a planted failure")
        time.sleep(300)  # far past the collective timeout: only a kill ends it
    return step(self)


trainer.Trainer.train_step = planted
sys.exit(main(["train", *sys.argv[5:]]))
'''
WORLD, AT, TIMEOUT = 4, 3, 20


def _args(dist_base, run: Path) -> list[str]:
    return [*dist_base, "--parallel.dp", str(WORLD), "--training.steps", "6", "--eval.interval", "0",
            "--training.threads", "1", "--parallel.collective_timeout", str(TIMEOUT), "--run.dir", str(run)]


def _prepared(dist_base) -> None:
    cfg = load_config(None, dist_base)
    prepare_data(cfg.data, cfg.model.vocab_size, Path(cfg.data.cache_dir), log=lambda _: None)


def test_a_hung_rank_ends_the_job_within_a_minute_and_doctor_names_it(dist_base, tmp_path, capsys):
    _prepared(dist_base)
    driver, marker, run = tmp_path / "driver.py", tmp_path / "hung-at", tmp_path / "run"
    driver.write_text(DRIVER)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(driver), "sleep", "3", str(AT), str(marker),
           *_args(dist_base, run)]
    job = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ended = time.time()
    assert job.returncode != 0 and marker.is_file(), job.stderr[-3000:]
    assert ended - float(marker.read_text()) < 60, "the job outlived the hang by a minute"
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: rank")]
    assert errors and all(f"waited parallel.collective_timeout = {TIMEOUT} s" in line for line in errors), errors

    assert main(["doctor", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    print("\n".join(lines))
    assert any(line.startswith("rank 3 never arrived at gloo:all_reduce #") and "ranks 0, 1, 2 waited in it" in line
               for line in lines), lines
    assert not any(line.startswith(("rank 0 ", "rank 1 ", "rank 2 ")) for line in lines), lines


def test_a_failing_rank_is_named_by_the_others_which_exit_without_a_launcher(dist_base, tmp_path):
    """Plain processes (no torchrun to stop the others): rank 3 raises; ranks 0-2 end by themselves,
    each with one line that names rank 3 and its error."""
    _prepared(dist_base)
    driver, marker, run = tmp_path / "driver.py", tmp_path / "failed-at", tmp_path / "run"
    driver.write_text(DRIVER)
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(driver), "raise", "3", str(AT), str(marker),
                                       *_args(dist_base, run)], stderr=subprocess.PIPE, text=True, env=env))
    errs = [proc.communicate(timeout=300)[1] for proc in procs]
    failed_at = float(marker.read_text())
    assert time.time() - failed_at < TIMEOUT + 30
    assert [proc.returncode for proc in procs] == [2, 2, 2, 1], [e[-2000:] for e in errs]
    for rank in range(3):
        lines = [line for line in errs[rank].splitlines() if line.startswith("error:")]
        assert lines == [f"error: rank 3 failed (ValueError: a planted failure); rank {rank} stopped: its "
                         "collective could not finish without it"], errs[rank][-2000:]
    assert "ValueError: a planted failure" in errs[3]


def test_a_rank_broken_by_a_peer_that_timed_out_says_so(tmp_path, monkeypatch):
    """Ranks do not time out at the same instant: the first to leave closes its connections, and
    the others' collectives break on that instead. They must still say the job timed out waiting,
    not blame the rank that left first (seen under load: 3 waiting ranks, 2 broke this way)."""
    from torch.distributed import HashStore

    from ultratron.parallel import faults

    store = HashStore()
    monkeypatch.setattr(faults, "job_store", lambda: store)
    timed_out = faults.failure_error(RuntimeError("[pair.cc:1] Timed out waiting 20000ms for recv operation"),
                                     2, WORLD, TIMEOUT, tmp_path, since=0.0)
    broken = faults.failure_error(RuntimeError("[pair.cc:2] Connection closed by peer [127.0.0.1]:1234"),
                                  1, WORLD, TIMEOUT, tmp_path, since=0.0)
    assert f"rank 2: a collective waited parallel.collective_timeout = {TIMEOUT} s" in str(timed_out)
    assert f"rank 1: rank 2's collective waited parallel.collective_timeout = {TIMEOUT} s" in str(broken)
