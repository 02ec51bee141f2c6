"""Training throughput and MFU of a ~10M-parameter model on this machine, fp32 and bf16.

  python benchmarks/train_throughput.py [--steps 12] [--warmup 3] [--threads 0]

Prints the measured fp32 and bf16 matmul peaks (square 2048 matmuls, best of ~2 s, before and
after training, the larger kept), then for
each precision the median step time, tokens/s and MFU against the matching measured peak.
Runs the real `Trainer.train_step` on the built-in corpus (data prepared once, cached in
runs/bench-data). The machines are shared: read medians, and compare the two precisions
measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ultratron.config import load_config
from ultratron.training.mfu import measure_cpu_matmul_flops
from ultratron.training.trainer import Trainer

MODEL_10M = [
    "--model.preset", "tiny", "--model.n_layers", "6", "--model.dim", "384", "--model.n_heads", "6",
    "--model.n_kv_heads", "2", "--model.ffn_dim", "1024", "--model.vocab_size", "4096",
    "--training.seq_len", "256", "--training.micro_batch_size", "16", "--training.batch_tokens", "8192",
]


def bench(precision: str, steps: int, warmup: int) -> dict:
    cfg = load_config(None, MODEL_10M + [
        "--training.precision", precision, "--training.steps", str(steps + warmup), "--training.progress", "false",
        "--run.dir", f"runs/bench-{precision}", "--data.cache_dir", "runs/bench-data", "--run.tensorboard", "false",
    ])
    trainer = Trainer(cfg, echo=False)
    times = []
    for i in range(steps + warmup):
        start = time.perf_counter()
        trainer.train_step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    tokens_per_sec = cfg.training.batch_tokens / step_time
    achieved = tokens_per_sec * trainer.flops_per_token
    return {"params": trainer.n_params, "step_time": step_time, "tokens_per_sec": tokens_per_sec,
            "achieved": achieved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # A peak is a maximum: measure before and after training and keep the larger, so a moment of
    # contention on this shared machine does not shrink the denominator.
    measure = lambda p: measure_cpu_matmul_flops(p, seconds=2.0, size=2048)  # noqa: E731
    before = {p: measure(p) for p in ("fp32", "bf16")}
    results = {p: bench(p, args.steps, args.warmup) for p in ("fp32", "bf16")}
    peaks = {p: max(before[p], measure(p)) for p in ("fp32", "bf16")}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for p, v in peaks.items():
        print(f"measured {p} matmul peak: {v / 1e9:8.1f} GFLOP/s (before training {before[p] / 1e9:.1f})")
    print(f"{'precision':>9} {'params':>8} {'step s':>8} {'tokens/s':>9} {'GFLOP/s':>8} {'MFU':>6}")
    for precision, r in results.items():
        print(f"{precision:>9} {r['params'] / 1e6:7.1f}M {r['step_time']:8.3f} {r['tokens_per_sec']:9,.0f} "
              f"{r['achieved'] / 1e9:8.1f} {r['achieved'] / peaks[precision]:6.1%}")


if __name__ == "__main__":
    main()
