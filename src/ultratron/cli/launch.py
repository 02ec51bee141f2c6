"""Launch training on many processes with torchrun, or write a Slurm batch script for it.

  ultratron launch --nproc-per-node 4 -- --config run.toml --parallel.dp 2 --parallel.tp 2
  ultratron launch --nproc-per-node 8 --nnodes 4 --slurm job.sbatch -- --config run.toml

Everything after `--` (or any --section.field flag) goes to `ultratron train`. One node: runs
torchrun with its rendezvous on a free port (printed; --rdzv-endpoint picks one). Several nodes:
every node runs the same torchrun with a c10d rendezvous at --rdzv-endpoint; with --slurm, the
script finds the first node of the allocation and a free port on it, and `srun` starts one
torchrun per node. --dry-run prints the command instead of running it.

--max-restarts N restarts the whole group after any rank dies (up to N times), and each restart
resumes from the newest verified checkpoint (--checkpoint.resume auto is added unless given).
The Slurm script is requeued when a node fails, checks every node's GPUs before training
(`ultratron health`), and submits itself again without nodes found failing.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
from pathlib import Path

from ultratron.launch.torchrun import local_endpoint, slurm_script, torchrun_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, required=True, help="processes per node (GPUs per node)")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST[:PORT] of the rendezvous (multi-node)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole group up to N times after any rank fails; each restart resumes from "
                             "the newest verified checkpoint (adds --checkpoint.resume auto unless given)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="R ≥ 2: R replica groups of --nproc-per-node processes with torchft: a group that fails "
                             "is left out while the others go on, restarts alone (--max-restarts) and heals from a "
                             "peer (docs/resilience.md); the global batch is R × training.batch_tokens")
    parser.add_argument("--slurm", metavar="FILE", help="write a Slurm batch script to FILE instead of running")
    parser.add_argument("--job-name", default="ultratron")
    parser.add_argument("--time", default="01:00:00", help="Slurm time limit")
    parser.add_argument("--partition", default=None, help="Slurm partition")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    parser.set_defaults(_accepts_overrides=True)


def _config(train_args: list[str]):
    """The config the training arguments give (read and validated here, so a bad one fails now, not
    on the cluster)."""
    from ultratron.config import load_config

    config, overrides, rest = None, [], iter(train_args)
    for arg in rest:
        if arg == "--config":
            config = next(rest, None)
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return load_config(config, overrides)


def _run_dir(train_args: list[str]) -> str:
    return str(Path(_config(train_args).run.dir).resolve())


def _run_replicas(args, train_args: list[str]) -> int:
    from ultratron.errors import UserError
    from ultratron.launch.replicas import replica_group_commands, run_replicas

    if args.nnodes > 1 or args.slurm:
        raise UserError("--replicas runs every replica group on this node for now; with several nodes, start one "
                        "torchrun per group yourself with TORCHFT_LIGHTHOUSE, ULTRATRON_REPLICA_GROUP and "
                        "ULTRATRON_REPLICA_GROUPS set (docs/resilience.md)")
    cfg = _config(train_args)
    if args.dry_run:
        for cmd, env in replica_group_commands(args.replicas, args.nproc_per_node, train_args, cfg.run.dir,
                                               cfg.data.cache_dir or f"{cfg.run.dir}/data", args.max_restarts,
                                               "LIGHTHOUSE"):
            print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(cmd))
        return 0
    return run_replicas(args.replicas, args.nproc_per_node, train_args, cfg, args.max_restarts,
                        log=lambda line: print(line, flush=True))


def run(args) -> int:
    train_args = [a for a in args.overrides if a != "--"]
    if args.max_restarts > 0 and not any(a.startswith("--checkpoint.resume") for a in train_args):
        train_args += ["--checkpoint.resume", "auto"]  # a restarted group must continue, not refuse
    if args.slurm:
        path = Path(args.slurm)
        path.write_text(slurm_script(args.nproc_per_node, args.nnodes, train_args, job_name=args.job_name,
                                     time_limit=args.time, partition=args.partition,
                                     max_restarts=args.max_restarts, run_dir=_run_dir(train_args),
                                     script_path=str(path.resolve())), encoding="utf-8")
        path.chmod(0o755)
        print(f"wrote {path}; submit it with: sbatch {path}")
        return 0
    if args.replicas > 1:
        return _run_replicas(args, train_args)
    endpoint = args.rdzv_endpoint or (local_endpoint() if args.nnodes == 1 else None)
    cmd = torchrun_command(args.nproc_per_node, args.nnodes, train_args, endpoint, args.max_restarts)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    print(f"launch: rendezvous on {endpoint}" + ("" if args.rdzv_endpoint else " (a free port)"), flush=True)
    return subprocess.call(cmd)
