"""Check this node: its GPUs through NVML, and a matmul timing.

  ultratron health [--max-temperature 90] [--matmul-size N] [--unhealthy-file FILE]

GPU checks: uncorrected ECC errors, pages pending retirement, row-remap failures, temperature,
hardware clock slowdowns, XID events. Exit 0 when healthy; 1 when a GPU fails, and then this
node's name is appended to --unhealthy-file (the Slurm script from `ultratron launch --slurm`
excludes those nodes when it submits the job again). Without a GPU it says "no GPU" and still
times the matmul. During training the same checks run every health.interval minutes.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-temperature", type=int, default=90, help="°C at or above which a GPU fails")
    parser.add_argument("--matmul-size", type=int, default=0, help="side of the timing matmul; 0: 4096 on a GPU, "
                                                                   "256 on a CPU")
    parser.add_argument("--unhealthy-file", default=None, help="append this node's name here when it fails")


def run(args) -> int:
    import socket

    import torch

    from ultratron.training.health import GpuMonitor, matmul_seconds

    host = socket.gethostname()
    gpu = GpuMonitor().check(args.max_temperature)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.matmul_size or (4096 if device.type == "cuda" else 256)
    seconds = matmul_seconds(device, size)
    rate = 2 * size**3 / seconds / 1e12
    print(f"{host}: {gpu.summary}; {size}×{size} matmul on {device.type}: {seconds * 1e3:.2f} ms "
          f"({rate:.3g} TFLOP/s)")
    for line in gpu.warnings:
        print(f"{host}: warning: {line}")
    for line in gpu.problems:
        print(f"{host}: FAILED: {line}")
    if gpu.problems and args.unhealthy_file:
        with open(args.unhealthy_file, "a", encoding="utf-8") as fh:
            fh.write(host + "\n")
    return 1 if gpu.problems else 0
