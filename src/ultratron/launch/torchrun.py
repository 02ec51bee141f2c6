"""The torchrun command line for `ultratron train` on many processes, and a Slurm batch script for it.

One node: torchrun with its rendezvous on a free loopback port, picked here so that it can be
printed and two jobs on one machine never share one (not torch's 29500). Several nodes: every
node runs the same torchrun with a c10d rendezvous at the given endpoint; the Slurm script finds
the first node of the allocation and a free port on it, and `srun` starts one torchrun per node.

Surviving failures: torchrun's `--max-restarts` restarts the whole group after any rank dies
(training resumes from the newest verified checkpoint). The Slurm script asks to be requeued
when a node fails (`--requeue`), first checks every node (`ultratron health`), and when a node is
found failing — by that check, or by the trainer's periodic one — submits the job again without
the failing nodes (`sbatch --exclude`); either way the job continues from its checkpoints.
"""

from __future__ import annotations

import shlex
import sys

from ultratron.errors import UserError
from ultratron.launch.local import free_port


def local_endpoint() -> str:
    """A rendezvous endpoint on this machine, on a port free now."""
    return f"127.0.0.1:{free_port()}"


def torchrun_command(nproc_per_node: int, nnodes: int, train_args: list[str], rdzv_endpoint: str | None = None,
                     max_restarts: int = 0, python: str = sys.executable, module: str = "ultratron",
                     rdzv_id: str = "ultratron") -> list[str]:
    """One node without an endpoint: the caller picks one (`local_endpoint`)."""
    if nproc_per_node < 1 or nnodes < 1:
        raise UserError(f"--nproc-per-node and --nnodes must be ≥ 1, got {nproc_per_node} and {nnodes}")
    if rdzv_endpoint is None:
        raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (or --slurm, which finds it)")
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
           f"--rdzv-id={rdzv_id}"]
    return cmd + ["-m", module, "train", *train_args]


UNHEALTHY_FILE = "unhealthy-nodes.txt"  # the trainer's health monitor writes the same name


def slurm_script(nproc_per_node: int, nnodes: int, train_args: list[str], *, job_name: str = "ultratron",
                 time_limit: str = "01:00:00", partition: str | None = None, max_restarts: int = 0,
                 run_dir: str = "runs/default", script_path: str = "job.sbatch") -> str:
    """A batch script: one task per node, each running torchrun; rendezvous on the first node.
    Requeued on node failure; nodes that fail a health check are excluded from the next submission."""
    if not any(a.startswith("--checkpoint.resume") for a in train_args):
        train_args = [*train_args, "--checkpoint.resume", "auto"]  # a requeued job continues its run
    torchrun = torchrun_command(nproc_per_node, nnodes, train_args, rdzv_endpoint="$HEAD_NODE:$PORT",
                                max_restarts=max_restarts, python="python")
    # $HEAD_NODE and $PORT must expand at run time, so those words are left unquoted.
    words = [w if "$HEAD_NODE" in w else shlex.quote(w) for w in torchrun]
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nnodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={nproc_per_node}",
             f"#SBATCH --time={time_limit}", "#SBATCH --output=%x-%j.out", "#SBATCH --open-mode=append",
             "#SBATCH --requeue  # a failed node puts the job back in the queue; it resumes from its checkpoints"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["set -uo pipefail",
              'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "# a port free on this (the first) node now, not a fixed one two jobs on a node would share",
              """PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')""",
              'echo "launch: rendezvous on $HEAD_NODE:$PORT"',
              f"RUN_DIR={shlex.quote(run_dir)}",
              f'UNHEALTHY="$RUN_DIR/{UNHEALTHY_FILE}"',
              'mkdir -p "$RUN_DIR"',
              "",
              "# Submit this job again without every node ever found failing; it resumes from its checkpoints.",
              "resubmit_without_unhealthy() {",
              '    BAD=$(cat "$UNHEALTHY"* | sort -u | paste -sd, -)',
              '    mv "$UNHEALTHY" "$UNHEALTHY.$SLURM_JOB_ID"',
              '    echo "unhealthy nodes: $BAD; submitting the job again without them"',
              f'    sbatch --exclude="$BAD" {shlex.quote(script_path)}',
              "    exit 1",
              "}",
              "",
              "# Every node checks its GPUs first (NVML: ECC, retired pages, remapped rows, temperature, XIDs).",
              'srun --ntasks-per-node=1 python -m ultratron health --unhealthy-file "$UNHEALTHY"',
              '[ -s "$UNHEALTHY" ] && resubmit_without_unhealthy',
              "",
              "srun --kill-on-bad-exit=1 " + " ".join(words),
              "rc=$?",
              '# the trainer names a GPU that fails its periodic health check in the same file',
              '[ "$rc" -ne 0 ] && [ -s "$UNHEALTHY" ] && resubmit_without_unhealthy',
              'exit "$rc"', ""]
    return "\n".join(lines)

