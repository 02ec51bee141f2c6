"""The torchrun command line for `ultratron train` on many processes, and a Slurm batch script for it.

One node: `torchrun --standalone`. Several nodes: every node runs the same torchrun with a c10d
rendezvous at the given endpoint; the Slurm script finds the first node of the allocation
itself and `srun` starts one torchrun per node.
"""

from __future__ import annotations

import shlex
import sys

from ultratron.errors import UserError

DEFAULT_PORT = 29500


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


def slurm_script(nproc_per_node: int, nnodes: int, train_args: list[str], *, job_name: str = "ultratron",
                 time_limit: str = "01:00:00", partition: str | None = None, max_restarts: int = 0) -> str:
    """A batch script: one task per node, each running torchrun; rendezvous on the first node."""
    torchrun = torchrun_command(nproc_per_node, nnodes, train_args, rdzv_endpoint="$HEAD_NODE:$PORT",
                                max_restarts=max_restarts, python="python")
    # $HEAD_NODE and $PORT must expand at run time, so those words are left unquoted.
    words = [w if "$HEAD_NODE" in w else shlex.quote(w) for w in torchrun]
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nnodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={nproc_per_node}",
             f"#SBATCH --time={time_limit}", "#SBATCH --output=%x-%j.out"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["set -euo pipefail",
              'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f"PORT={DEFAULT_PORT}",
              "srun --kill-on-bad-exit=1 " + " ".join(words), ""]
    return "\n".join(lines)

