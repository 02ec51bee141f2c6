"""Step time and tokens/s of the same model and global batch under each parallel layout, on CPU
with gloo (local processes, one thread each). Prints a table; medians over the steps after the
first (which includes warm-up). On a machine with fewer cores than ranks the ranks share cores,
so read the figures as overhead of the layout on this machine, not as scaling.

  python benchmarks/parallel_overhead.py [--steps 6] [--dim 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {
    "1 process": (1, []),
    "dp2 zero0 (DDP)": (2, ["--parallel.dp", "2"]),
    "dp2 zero1": (2, ["--parallel.dp", "2", "--parallel.zero", "1"]),
    "dp2 zero2": (2, ["--parallel.dp", "2", "--parallel.zero", "2"]),
    "dp2 zero3": (2, ["--parallel.dp", "2", "--parallel.zero", "3"]),
    "tp2": (2, ["--parallel.tp", "2"]),
    "tp2+sp": (2, ["--parallel.tp", "2", "--parallel.sp", "true"]),
    "pp2 1f1b": (2, ["--parallel.pp", "2"]),
    "dp2×tp2+sp zero3": (4, ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sp", "true",
                             "--parallel.zero", "3"]),
    "hsdp 2×2 zero3": (4, ["--parallel.dp", "4", "--parallel.dp_replicate", "2", "--parallel.zero", "3"]),
}


def train_runs(runs: list[list[str]]) -> None:
    from ultratron.config import load_config
    from ultratron.training.trainer import train

    for overrides in runs:
        train(load_config(None, overrides), echo=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    import torch

    from ultratron.launch.local import run_local
    from ultratron.training.metrics import read_metrics

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="parallel-overhead-"))
    base = ["--model.preset", "tiny", "--model.n_layers", str(args.layers), "--model.dim", str(args.dim),
            "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", str(2 * args.dim),
            "--model.vocab_size", "1024", "--training.seq_len", str(args.seq), "--training.micro_batch_size", "4",
            "--training.batch_tokens", str(16 * args.seq), "--training.steps", str(args.steps),
            "--training.progress", "false", "--training.sample_tokens", "0", "--run.tensorboard", "false",
            "--eval.interval", "0", "--data.max_bytes", "1500000", "--data.cache_dir", str(root / "data"),
            "--training.threads", "1"]
    print(f"model dim {args.dim}, {args.layers} layers; global batch {16 * args.seq} tokens; "
          f"{torch.get_num_threads()} thread per rank; {args.steps} steps", file=sys.stderr)
    rows = []
    for name, (world, layout) in LAYOUTS.items():
        run_dir = root / name.replace(" ", "_").replace("×", "x").replace("+", "_")
        overrides = base + layout + ["--run.dir", str(run_dir)]
        start = time.perf_counter()
        if world == 1:
            train_runs([overrides])
        else:
            run_local(world, train_runs, [overrides])
        wall = time.perf_counter() - start
        records = [r for r in read_metrics(run_dir) if "loss" in r][1:]
        step_time = statistics.median(r["step_time"] for r in records)
        rows.append((name, world, step_time, statistics.median(r["tokens_per_sec"] for r in records),
                     records[-1]["loss"], wall))
    shutil.rmtree(root, ignore_errors=True)
    reference = rows[0][2]
    print(f"{'layout':<20} {'ranks':>5} {'step s':>8} {'tokens/s':>10} {'vs 1 proc':>9} {'final loss':>10}")
    for name, world, step_time, tokens, loss, _wall in rows:
        print(f"{name:<20} {world:>5} {step_time:>8.3f} {tokens:>10,.0f} {step_time / reference:>8.2f}× {loss:>10.4f}")


if __name__ == "__main__":
    main()
