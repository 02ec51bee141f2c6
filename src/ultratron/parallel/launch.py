"""Launch training on many processes with torchrun, or write a Slurm batch script for it.

  ultratron launch --nproc-per-node 4 -- --config run.toml --parallel.dp 2 --parallel.tp 2
  ultratron launch --nproc-per-node 8 --nnodes 4 --slurm job.sbatch -- --config run.toml

Everything after `--` (or any --section.field flag) goes to `ultratron train`. One node: runs
`torchrun --standalone`. Several nodes: every node runs the same torchrun with a c10d rendezvous
at --rdzv-endpoint; with --slurm, the script finds the first node of the allocation itself and
`srun` starts one torchrun per node. --dry-run prints the command instead of running it.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from ultratron.errors import UserError

DEFAULT_PORT = 29500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, required=True, help="processes per node (GPUs per node)")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST[:PORT] of the rendezvous (multi-node)")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of the whole group")
    parser.add_argument("--slurm", metavar="FILE", help="write a Slurm batch script to FILE instead of running")
    parser.add_argument("--job-name", default="ultratron")
    parser.add_argument("--time", default="01:00:00", help="Slurm time limit")
    parser.add_argument("--partition", default=None, help="Slurm partition")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    parser.set_defaults(_accepts_overrides=True)


def torchrun_command(nproc_per_node: int, nnodes: int, train_args: list[str], rdzv_endpoint: str | None = None,
                     max_restarts: int = 0, python: str = sys.executable) -> list[str]:
    if nproc_per_node < 1 or nnodes < 1:
        raise UserError(f"--nproc-per-node and --nnodes must be ≥ 1, got {nproc_per_node} and {nnodes}")
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}",
           f"--max-restarts={max_restarts}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (or --slurm, which finds it)")
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=ultratron"]
    return cmd + ["-m", "ultratron", "train", *train_args]


def slurm_script(args, train_args: list[str]) -> str:
    """A batch script: one task per node, each running torchrun; rendezvous on the first node."""
    torchrun = torchrun_command(args.nproc_per_node, args.nnodes, train_args, rdzv_endpoint="$HEAD_NODE:$PORT",
                                max_restarts=args.max_restarts, python="python")
    # $HEAD_NODE and $PORT must expand at run time, so those words are left unquoted.
    words = [w if "$HEAD_NODE" in w else shlex.quote(w) for w in torchrun]
    lines = ["#!/bin/bash", f"#SBATCH --job-name={args.job_name}", f"#SBATCH --nodes={args.nnodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={args.nproc_per_node}",
             f"#SBATCH --time={args.time}", "#SBATCH --output=%x-%j.out"]
    if args.partition:
        lines.append(f"#SBATCH --partition={args.partition}")
    lines += ["set -euo pipefail",
              'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f"PORT={DEFAULT_PORT}",
              "srun --kill-on-bad-exit=1 " + " ".join(words), ""]
    return "\n".join(lines)


def run(args) -> int:
    train_args = [a for a in args.overrides if a != "--"]
    if args.slurm:
        path = Path(args.slurm)
        path.write_text(slurm_script(args, train_args), encoding="utf-8")
        path.chmod(0o755)
        print(f"wrote {path}; submit it with: sbatch {path}")
        return 0
    cmd = torchrun_command(args.nproc_per_node, args.nnodes, train_args, args.rdzv_endpoint, args.max_restarts)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    return subprocess.call(cmd)
