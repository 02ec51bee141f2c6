"""Run a function in N local processes with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT), joined in one gloo process group unless the function joins itself. For tests
and benchmarks on one machine; real jobs use torchrun (`ultratron launch`)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path


def processes_with(**environment: str) -> list[int]:
    """PIDs of this machine's processes whose environment holds every NAME=VALUE given (Linux's
    /proc): how tests and benchmarks find one rank of a job they started, to kill it."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{pid}/environ").read_text(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        env = dict(kv.split("=", 1) for kv in text.split("\0") if "=" in kv)
        if all(env.get(name) == value for name, value in environment.items()):
            found.append(int(pid))
    return found


# What every rank imports, imported once by the fork server that the ranks are forked from: a
# spawned rank spent ~8 s of a busy 2-core machine on these imports and ~3 s on the interpreter's
# teardown, per launch (a forked rank exits without that teardown, as multiprocessing's do).
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
           "torch.distributed.pipelining"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, threads: int, join_group: bool, fn, args, environment) -> None:
    import torch
    import torch.distributed as dist

    from ultratron.parallel.dims import leave_process_group

    os.environ.clear()  # the caller's environment now, not the fork server's from its first launch
    os.environ.update(environment)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    if join_group:  # else, as under torchrun, fn (e.g. the trainer) joins and leaves the group itself
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    fn(*args)
    if join_group:
        leave_process_group()  # only after success: after a failure the rank just exits non-zero


def run_local(world: int, fn, *args, threads: int = 1, join_group: bool = True) -> None:
    """Call fn(*args) on `world` new ranks; raises if any rank fails. fn must be importable.
    join_group=False: the ranks get only torchrun's environment and fn joins the group itself.
    The ranks are forked from multiprocessing's fork server (started by the first call, with
    PRELOAD imported) and given this process's environment of the moment."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(_worker, args=(world, free_port(), threads, join_group, fn, args, dict(os.environ)),
                       nprocs=world, join=True, start_method="forkserver")
