"""Live recovery's cost: `ultratron launch --replicas 2 --nproc-per-node 2` on the tiny model, once
without failures and once with one process of replica group 1 killed (kill -9) every
--kill-every seconds. Prints the surviving group's optimizer steps per second in both runs (the
goal: ≥ 80% of the run without failures, i.e. the survivors never wait for the restart), the
longest pause between two of its steps, and how long each killed group took to rejoin (from the
kill to the first step both groups took together).

  python benchmarks/replica_failover.py [--seconds 100] [--kill-every 30]

Each run is stopped after --seconds (SIGTERM to the launcher); the steps of the first
--warmup seconds are not counted. On a machine with few cores the groups share them, so the
survivor runs faster while it is alone: the ratio can exceed 100% here.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ultratron.launch.local import processes_with
from ultratron.training.metrics import read_metrics

TINY = ["--model.preset", "tiny", "--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
        "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "512", "--training.seq_len", "64",
        "--training.micro_batch_size", "4", "--training.batch_tokens", "512", "--training.progress", "false",
        "--training.sample_tokens", "0", "--run.tensorboard", "false", "--eval.interval", "0",
        "--training.threads", "1", "--parallel.dp", "2", "--training.steps", "1000000",
        "--training.log_interval", "100", "--parallel.collective_timeout", "10"]


def group_process(tag: str, group: int, rank: int) -> int | None:
    """The newest training process of `rank` in replica group `group` of the run tagged `tag`."""
    found = processes_with(BENCH_TAG=tag, ULTRATRON_REPLICA_GROUP=str(group), RANK=str(rank))
    return max(found) if found else None


def run(root: Path, data: str, seconds: float, kill_every: float | None) -> tuple[list[dict], list[float]]:
    tag = root.name
    cmd = [sys.executable, "-m", "ultratron", "launch", "--replicas", "2", "--nproc-per-node", "2",
           "--max-restarts", "100", "--", *TINY, "--data.path", data, "--run.dir", str(root)]
    kills = []
    with open(root.with_suffix(".out"), "w") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "BENCH_TAG": tag})
        while not (root / "replica-0" / "metrics.jsonl").is_file():  # the first step
            time.sleep(0.2)
        start = time.monotonic()
        next_kill = start + kill_every if kill_every else float("inf")
        while time.monotonic() - start < seconds:
            time.sleep(0.2)
            if time.monotonic() >= next_kill and (pid := group_process(tag, 1, 1)) is not None:
                os.kill(pid, signal.SIGKILL)
                kills.append(time.time())
                next_kill += kill_every
        job.send_signal(signal.SIGTERM)
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
    return [r for r in read_metrics(root / "replica-0") if "loss" in r], kills


def rate(records: list[dict], warmup: float) -> float:
    t0 = records[0]["time"] + warmup
    counted = [r for r in records if r["time"] >= t0]
    return (len(counted) - 1) / (counted[-1]["time"] - counted[0]["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=100)
    parser.add_argument("--kill-every", type=float, default=30)
    parser.add_argument("--warmup", type=float, default=5)
    parser.add_argument("--data", default=str(Path(os.__file__).parent / "json"),
                        help="a directory of text to train on (default: this Python's json package)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        base, _ = run(Path(tmp) / "steady", args.data, args.seconds, None)
        failing, kills = run(Path(tmp) / "failing", args.data, args.seconds, args.kill_every)
    steady, survivor = rate(base, args.warmup), rate(failing, args.warmup)
    times = [r["time"] for r in failing]
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    print(f"surviving group, no failures:          {steady:.2f} optimizer steps/s")
    print(f"surviving group, a kill every {args.kill_every:.0f} s:   {survivor:.2f} optimizer steps/s "
          f"({100 * survivor / steady:.0f}% of the run without failures; goal ≥ 80%)")
    print(f"longest pause between two of its steps: {gap:.1f} s; {len(kills)} kills")
    for when in kills:
        back = next((r for r in failing if r["time"] > when and r["replicas"] == 2), None)
        print(f"  killed at +{when - failing[0]['time']:.0f} s: " +
              (f"rejoined after {back['time'] - when:.1f} s" if back else "not rejoined before the end"))


if __name__ == "__main__":
    main()
