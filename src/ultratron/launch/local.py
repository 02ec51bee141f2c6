"""Run a function in N local processes joined in one gloo process group, as torchrun would set
them up (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). For tests and benchmarks on one machine;
real jobs use torchrun (`ultratron launch`)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, threads: int, fn, args) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    fn(*args)
    # Every rank done, then leave while Python is alive (see ParallelDims.leave: a group alive at
    # interpreter shutdown can abort the process). After a failure the rank just exits non-zero.
    dist.barrier()
    dist.destroy_process_group()


def run_local(world: int, fn, *args, threads: int = 1) -> None:
    """Call fn(*args) on `world` spawned ranks; raises if any rank fails. fn must be importable."""
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(world, free_port(), threads, fn, args), nprocs=world, join=True,
                       start_method="spawn")
