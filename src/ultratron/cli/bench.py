"""Measure parallel layouts and set the planner's prediction beside each measurement.

  ultratron bench sweep --out sweeps/tiny --model tiny --grid "dp=1,2,4 tp=1,2 pp=1,2" --gpus 4 --gpu cpu
  ultratron bench sweep --out sweeps/8b --model llama3-8b --top 5 --gpus 8 --gpu h100-sxm -- --config base.toml
  ultratron bench sweep --out sweeps/8b ... --slurm sweep.sbatch      (one Slurm job array; resubmit to resume)
  ultratron bench comm --nproc 4 --out profile.json        (then: ultratron plan estimate --profile profile.json)

Each cell (layout × model) trains for --steps steps in its own `ultratron train` process (torchrun
for several ranks); the sweep collects tokens/s/GPU, MFU and peak memory, or why the cell did not
run (refused by the config's rules, out of memory, timeout, failed: with the error), into
OUT/sweep.csv, OUT/sweep.md and OUT/sweep.png (MFU by dp × tp for each pp), each beside
`plan estimate`'s prediction and its error. Run the same command again: finished cells are not
rerun (--retry-failed reruns the ones that failed). Everything after `--` (or any --section.field
flag) goes to every cell's `ultratron train`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ultratron.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{sweep,comm}")
    sub.required = True
    cm = sub.add_parser("comm", help="measure collectives' bandwidth and latency and the matmul rate; write a "
                                     "profile for `plan estimate/search --profile`")
    cm.add_argument("--out", default="comm-profile.json", help="the profile to write (JSON)")
    cm.add_argument("--nproc", type=int, default=4, help="processes to start on this machine (ignored under "
                                                         "torchrun, which gives the ranks)")
    cm.add_argument("--max-bytes", type=int, default=16 * 2**20, help="largest message (default 16 MiB)")
    cm.add_argument("--repeat", type=int, default=5, help="timed runs per size (default 5; the median is kept)")
    cm.add_argument("--matmul-size", type=int, default=1024, help="square matmul timed on every rank at once")
    cm.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    cm.add_argument("--model", default="tiny", help="model preset whose own non-matmul work (a block, the loss, "
                                                     "attention, the optimizer step) one rank times for the planner; "
                                                     "none: skip (default tiny)")
    cm.add_argument("--seq", type=int, default=256, help="sequence length of that work (default 256)")
    cm.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch of that work (default 8)")
    cm.set_defaults(bench_run=run_comm)
    sw = sub.add_parser("sweep", help="train a grid of layouts × models for a few steps each; measured vs predicted")
    sw.add_argument("--out", required=True, help="the sweep directory (results, reports; resumed if it exists)")
    sw.add_argument("--model", default="tiny", help="model presets, comma-separated (default tiny)")
    sw.add_argument("--layout", action="append", default=[], metavar="'dp=2 tp=2 ...'",
                    help="one layout: FIELD=VALUE words (dp, tp, pp, zero, sp, mbs, recompute, pp_schedule, "
                         "virtual_stages, precision, or any section.field); repeatable")
    sw.add_argument("--grid", action="append", default=[], metavar="'dp=1,2 tp=1,2 ...'",
                    help="comma lists whose cartesian product are the layouts; repeatable")
    sw.add_argument("--top", type=int, default=0, help="the planner's K fastest layouts (needs --gpus and a GPU type)")
    sw.add_argument("--gpus", type=int, help="keep grid layouts on this many GPUs (dp·tp·pp); --top's GPU count")
    sw.add_argument("--gpu", default="cpu", help="what the cells run on, for the predictions: cpu or a GPU type "
                                                 "(h100-sxm, a100-80gb, ...)")
    sw.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    sw.add_argument("--steps", type=int, default=3, help="training steps per cell (default 3; the first is warm-up)")
    sw.add_argument("--timeout", type=float, default=3600.0, help="seconds a cell may run (default 3600)")
    sw.add_argument("--config", help="a base training config for every cell")
    sw.add_argument("--retry-failed", action="store_true", help="rerun cells that failed, ran out of memory or "
                                                                 "timed out")
    sw.add_argument("--slurm", metavar="FILE", help="write a Slurm job-array script (one cell per task) instead")
    sw.add_argument("--time", default="01:00:00", help="Slurm time limit per task")
    sw.add_argument("--partition", default=None, help="Slurm partition")
    sw.add_argument("--parallel", type=int, default=0, help="Slurm: at most this many tasks at once (0: no limit)")
    sw.add_argument("--cell", type=int, help="run only this cell of the sweep in --out (a Slurm array task)")
    sw.add_argument("--launcher", choices=("local", "slurm"), default="local", help="how a cell's ranks start")
    sw.set_defaults(bench_run=run_sweep, _accepts_overrides=True)


def run(args) -> int:
    return int(args.bench_run(args) or 0)


def run_comm(args) -> int:
    from ultratron.bench.comm import run_comm as measure
    from ultratron.models.presets import PRESETS
    from ultratron.planning.profile import load_profile

    problems = [f"--{n.replace('_', '-')} must be positive, got {getattr(args, n)}"
                for n in ("nproc", "max_bytes", "repeat", "matmul_size", "threads", "seq", "micro_batch")
                if getattr(args, n) <= 0]
    if args.nproc < 2:
        problems.append("--nproc must be at least 2: a collective needs a group")
    if args.model != "none" and args.model not in PRESETS:
        problems.append(f"--model {args.model!r} is not a preset; known: none, {', '.join(PRESETS)}")
    elif args.model != "none" and args.seq > PRESETS[args.model].max_seq_len:
        problems.append(f"--seq {args.seq} is longer than {args.model}'s max_seq_len "
                        f"{PRESETS[args.model].max_seq_len}")
    if problems:
        raise UserError(problems)
    kernels = None if args.model == "none" else (args.model, args.micro_batch, args.seq)
    measure(args.out, args.nproc, args.max_bytes, args.repeat, args.matmul_size, args.threads, kernels)
    profile = load_profile(args.out)
    print(f"{profile['world_size']} ranks ({profile['backend']}, {profile['device']}), matmul "
          f"{profile['matmul_flops'] / 1e9:.1f} GFLOP/s per rank")
    if profile.get("kernels"):
        print(f"  {args.model} at {args.micro_batch} × {args.seq} tokens, one rank: attention "
              f"{profile['attention_flops'] / 1e9:.1f} GFLOP/s; " + ", ".join(
                  f"{kind} {k['bandwidth'] / 1e9:.2f} GB/s + {k['latency'] * 1e3:.2f} ms a call"
                  for kind, k in profile["kernels"].items()))
    for where in ("intra", "inter"):
        for op, link in profile.get(where, {}).items():
            print(f"  {where}-node {op:15s} bus bandwidth {link['bandwidth'] / 1e9:8.3f} GB/s, "
                  f"latency {link['latency'] * 1e6:8.1f} µs")
    print(f"profile: {args.out} (ultratron plan estimate ... --profile {args.out})")
    return 0


def _cells(args, overrides: list[str]):
    from ultratron.bench.cells import layout_cells, top_cells, unique
    from ultratron.config import load_config
    from ultratron.planning.hardware import get_accelerator

    models = [m.strip() for m in args.model.split(",") if m.strip()]
    cells = layout_cells(models, args.layout, args.grid, args.gpus)
    if args.top:
        if not args.gpus or args.gpu == "cpu":
            raise UserError("--top needs --gpus N and a GPU type (--gpu h100-sxm, ...): the planner ranks for them")
        cells += top_cells(models, lambda m: load_config(args.config, overrides + ["--model.preset", m]),
                           get_accelerator(args.gpu), args.gpus, min(args.gpus_per_node, args.gpus), args.top)
    if not cells:
        raise UserError("no cells: give --layout, --grid (with --gpus, only layouts on that many GPUs) or --top")
    return unique(cells)


def run_sweep(args) -> int:
    from ultratron.bench.report import write_reports
    from ultratron.bench.run import Sweep, open_sweep, retry, run_cell, slurm_array

    root = Path(args.out)
    overrides = [a for a in args.overrides if a != "--"]
    problems = [f"--{n} must be positive, got {getattr(args, n)}" for n in ("steps", "timeout", "gpus_per_node")
                if getattr(args, n) <= 0]
    if problems:
        raise UserError(problems)
    if args.cell is not None:  # one task of a job array: the sweep is already defined
        sweep = Sweep.load(root)
        if not 0 <= args.cell < len(sweep.cells):
            raise UserError(f"--cell {args.cell}: the sweep in {root} has cells 0 to {len(sweep.cells) - 1}")
        cells = [sweep.cells[args.cell]]
    else:
        sweep = open_sweep(root, _cells(args, overrides), args.config, overrides, args.steps, args.timeout,
                           args.gpus_per_node)
        cells = sweep.cells
    if args.retry_failed:
        print(f"{retry(sweep, ('failed', 'oom', 'timeout'))} failed cells will run again")
    if args.slurm:
        path = Path(args.slurm)
        path.write_text(slurm_array(sweep, job_name=root.name or "sweep", time_limit=args.time,
                                    partition=args.partition, parallel=args.parallel), encoding="utf-8")
        path.chmod(0o755)
        print(f"wrote {path} ({len(sweep.cells)} cells); submit it with: sbatch {path}")
        return 0
    statuses = []
    for cell in cells:
        statuses.append(run_cell(sweep, cell, args.launcher)["status"])
        write_reports(sweep, args.gpu)  # after every cell, so a long sweep can be read as it goes
    paths = write_reports(sweep, args.gpu)
    counts = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
    print(f"{len(cells)} cells: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    print("reports: " + ", ".join(str(p) for p in paths.values()))
    return 0
