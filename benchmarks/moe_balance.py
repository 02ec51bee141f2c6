"""Expert load balance of the CPU mixture-of-experts preset (moe-tiny: 8 experts, top-2) over a
training run, by balancing method, measured from the router statistics the trainer writes.

Per step the trainer records, for every MoE layer, the routed token slots each expert got over
the whole batch (`moe_load` in metrics.jsonl) and the slots dropped over capacity. Printed: the
largest expert load over the mean load (of the worst layer; 1.0 is perfect balance) at the last
step and over the last 20 steps, the dropped slots over the whole run, and the final loss.

  aux       Switch Transformer loss α·E·Σ f_i·P_i, α = 0.01 (Fedus et al. 2021), dropless
  bias      DeepSeek-V3's routing bias, update speed 0.001, no aux loss (DeepSeek-AI 2024), dropless
  none      neither (the control), dropless
  capacity  aux, and each expert takes at most 1.25 × an even share of a micro-batch's slots

  python benchmarks/moe_balance.py [--steps 200] [--methods aux,bias,none,capacity]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

METHODS = {
    "aux": ["--model.moe_aux_loss", "0.01"],
    "bias": ["--model.moe_aux_loss", "0", "--model.moe_bias_update", "0.001"],
    "none": ["--model.moe_aux_loss", "0"],
    "capacity": ["--model.moe_aux_loss", "0.01", "--model.moe_capacity_factor", "1.25"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()

    import torch

    from ultratron.config import load_config
    from ultratron.training.metrics import read_metrics
    from ultratron.training.trainer import train

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="moe-balance-"))
    base = ["--model.preset", "moe-tiny", "--training.steps", str(args.steps), "--training.batch_tokens", "2048",
            "--training.micro_batch_size", "8", "--training.seq_len", "256", "--training.progress", "false",
            "--training.sample_tokens", "0", "--run.tensorboard", "false", "--eval.interval", "0",
            "--data.max_bytes", "3000000", "--data.cache_dir", str(root / "data"), "--training.threads", "1",
            "--health.check", "false"]
    print(f"moe-tiny (8 experts, top-2, 4 layers), {args.steps} steps of 2048 tokens, fp32, CPU", file=sys.stderr)
    rows = []
    for method in args.methods.split(","):
        run = root / method
        train(load_config(None, base + METHODS[method] + ["--run.dir", str(run)]), echo=False)
        steps = [r for r in read_metrics(run) if "loss" in r]
        ratios = [max(max(layer) / (sum(layer) / len(layer)) for layer in r["moe_load"]) for r in steps]
        dropped = sum(r["moe_dropped"] * sum(map(sum, r["moe_load"])) for r in steps)
        slots = sum(sum(map(sum, r["moe_load"])) for r in steps)
        rows.append((method, ratios[-1], statistics.median(ratios[-20:]), max(ratios[-20:]), ratios[0],
                     int(round(dropped)), slots, steps[-1]["loss"]))
    shutil.rmtree(root, ignore_errors=True)
    print(f"{'method':<9} {'max/mean at end':>15} {'median last 20':>14} {'max last 20':>11} {'at step 1':>9} "
          f"{'dropped slots':>19} {'final loss':>10}")
    for method, end, median, worst, first, dropped, slots, loss in rows:
        print(f"{method:<9} {end:>15.3f} {median:>14.3f} {worst:>11.3f} {first:>9.3f} "
              f"{dropped:>9,} / {slots:>9,} {loss:>10.4f}")


if __name__ == "__main__":
    main()
