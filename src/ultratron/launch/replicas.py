"""`ultratron launch --replicas R`: torchft's lighthouse and R replica groups, each its own torchrun
(with its own rendezvous and `--max-restarts`), so a group that dies restarts alone while the
others train on (parallel/replicas.py is the training side).

Each group writes its own run directory, RUN_DIR/replica-I (log, metrics, checkpoints): the groups
hold the same weights after every committed step, but each saves and resumes its own. The data is
prepared once, here, into one cache every group reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ultratron.errors import UserError
from ultratron.launch.torchrun import local_endpoint, torchrun_command

# How fast the lighthouse moves on without a group: a quorum waits this long for a group that was
# in the last one, and a group whose heartbeats stop for the second is left out.
JOIN_TIMEOUT_MS, HEARTBEAT_TIMEOUT_MS = 1000, 3000


def replica_group_commands(replicas: int, nproc_per_node: int, train_args: list[str], run_dir: str, data_dir: str,
                           max_restarts: int, lighthouse: str) -> list[tuple[list[str], dict[str, str]]]:
    """(torchrun command, environment) of each replica group."""
    if replicas < 2:
        raise UserError(f"--replicas must be ≥ 2 (1 is a plain launch), got {replicas}")
    out = []
    for group in range(replicas):
        args = [*train_args, "--run.dir", str(Path(run_dir) / f"replica-{group}"), "--data.cache_dir", data_dir]
        cmd = torchrun_command(nproc_per_node, 1, args, local_endpoint(), max_restarts,
                               rdzv_id=f"ultratron-replica-{group}")
        env = {"TORCHFT_LIGHTHOUSE": lighthouse, "ULTRATRON_REPLICA_GROUP": str(group),
               "ULTRATRON_REPLICA_GROUPS": str(replicas)}
        out.append((cmd, env))
    return out


def run_replicas(replicas: int, nproc_per_node: int, train_args: list[str], cfg, max_restarts: int,
                 log=print) -> int:
    """Start the lighthouse and the groups; returns the worst exit code of the groups."""
    from torchft.coordination import LighthouseServer

    from ultratron.data.prepare import prepare_data

    run_dir = Path(cfg.run.dir).resolve()
    data_dir = Path(cfg.data.cache_dir).resolve() if cfg.data.cache_dir else run_dir / "data"
    # once: the groups would race for it
    prepare_data(cfg.data, cfg.model.vocab_size, data_dir, log=log, seq_len=cfg.training.seq_len)
    # torchft's lighthouse and managers log every quorum at INFO (several lines a step); warnings only,
    # unless the user asks (RUST_LOG=info)
    os.environ.setdefault("RUST_LOG", "warn")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    log(f"launch: torchft lighthouse at {lighthouse.address()}; {replicas} replica groups × {nproc_per_node} "
        f"processes, each in {run_dir}/replica-N")
    procs = []
    # SIGTERM (a scheduler ending the job) must reach the groups: exit through the `finally` below
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        for cmd, env in replica_group_commands(replicas, nproc_per_node, train_args, str(run_dir), str(data_dir),
                                               max_restarts, lighthouse.address()):
            procs.append(subprocess.Popen(cmd, env={**os.environ, **env}))
        while any(p.poll() is None for p in procs):
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
        for group, code in enumerate(codes):
            if code != 0:
                log(f"launch: replica group {group} ended with exit code {code}")
        return max(codes, key=abs)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs:
            if p.poll() is None:
                p.terminate()  # torchrun passes it on to its workers (which write their flight records)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        lighthouse.shutdown()
        sys.stdout.flush()
