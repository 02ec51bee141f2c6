"""Each pipeline schedule's bubble and per-rank peak memory, measured on CPU (gloo, one thread per
rank) beside what the formulas and `plan memory` say.

Bubble: each rank times its stages' compute (forward, backward, and the weight backward of the
zero-bubble schedules) within a step; the rest of the step is idle (waiting for a neighbour, and
the point-to-point transfers). Printed as idle / busy — the bubble as a fraction of the ideal
compute time, the quantity (p−1)/(v·m) estimates for GPipe, 1F1B and interleaved 1F1B — the median
over the steps after the first (which also infers the activation shapes), the mean over ranks,
next to (p−1)/(v·m) and the planner's per-schedule estimate (planning.pipeline.bubble_fraction).

Memory: parameters, gradients and AdamW state from the tensors, activations as the peak of what
autograd keeps alive (parallel.memory.SavedActivations), for the first and the last stage's rank,
against `plan memory` (planning.memory.estimate_memory_per_rank) for the same layout.

With fewer cores than ranks the ranks share cores and the idle time means little: keep pp at
most the core count (the default pp 2 suits a 2-core machine).

  python benchmarks/pipeline_bubble.py [--pp 2] [--micro-batches 8] [--steps 6] [--dim 256] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb", "zbv", "dualpipev")


def _timed(stage, busy: list) -> None:
    """Add the compute time of `stage`'s forward / backward / weight-backward calls to busy[0]."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        method = getattr(stage, name)

        def timed(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start

        setattr(stage, name, timed)


def measure(overrides: list[str], steps: int, out: str) -> None:
    """On each rank: per-step busy and wall time, static bytes and the activation peak."""
    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.parallel.memory import SavedActivations, measured_bytes
    from ultratron.training.trainer import Trainer

    trainer = Trainer(load_config(None, overrides), echo=False)
    m = trainer.cfg.grad_accum_steps
    trainer.train_step()  # builds the schedule and infers the shapes
    schedule = trainer.strategy.runner.schedule
    busy = [0.0]
    for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
        _timed(stage, busy)
    walls, busies, peak, static = [], [], 0, {}
    for _ in range(steps - 1):
        busy[0] = 0.0
        dist.barrier()
        with SavedActivations(trainer.model) as meter:
            start = time.perf_counter()
            trainer.strategy.forward_backward(trainer.train_loader.next_batch, m)
            walls.append(time.perf_counter() - start)
        busies.append(busy[0])
        peak = max(peak, meter.peak)
        static = measured_bytes(trainer.model, trainer.optimizer)
        trainer.optimizer.step()
        static["optimizer_states"] = measured_bytes(trainer.model, trainer.optimizer)["optimizer_states"]
        trainer.optimizer.zero_grad(set_to_none=True)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"walls": walls, "busy": busies, "activations": peak, **static}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mbs", type=int, default=2)
    args = parser.parse_args()

    import torch

    from ultratron.config import load_config
    from ultratron.launch.local import run_local
    from ultratron.planning.layout import Layout
    from ultratron.planning.memory import estimate_memory_per_rank
    from ultratron.planning.pipeline import bubble_fraction, stages_per_rank

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="pipeline-bubble-"))
    p, m = args.pp, args.micro_batches
    base = ["--model.preset", "tiny", "--model.n_layers", str(args.layers), "--model.dim", str(args.dim),
            "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", str(3 * args.dim),
            "--model.vocab_size", "1024", "--training.seq_len", str(args.seq),
            "--training.micro_batch_size", str(args.mbs), "--training.batch_tokens", str(m * args.mbs * args.seq),
            "--training.steps", "100", "--training.progress", "false", "--training.sample_tokens", "0",
            "--run.tensorboard", "false", "--eval.interval", "0", "--data.max_bytes", "1500000",
            "--data.cache_dir", str(root / "data"), "--training.threads", "1", "--parallel.pp", str(p)]
    print(f"pp {p}, {m} micro-batches of {args.mbs} × {args.seq} tokens; dim {args.dim}, {args.layers} layers; "
          f"fp32 on CPU, 1 thread per rank; {args.steps - 1} timed steps", file=sys.stderr)
    rows = []
    for schedule in SCHEDULES:
        out = root / schedule
        out.mkdir()
        overrides = base + ["--parallel.pp_schedule", schedule, "--run.dir", str(out / "run")]
        run_local(p, measure, overrides, args.steps, str(out))
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(p)]
        idle = [statistics.median((w - b) / b for w, b in zip(r["walls"], r["busy"], strict=True)) for r in ranks]
        cfg = load_config(None, overrides)
        v = stages_per_rank(schedule, 0)
        layout = Layout(pp=p, pp_schedule=schedule, precision="fp32", micro_batch_size=args.mbs, grad_accum=m,
                        seq_len=args.seq)
        planned = estimate_memory_per_rank(cfg.model, layout)
        memory = {}
        for plan in planned:
            if plan.stage in ("first", "last", "first+last"):
                got = ranks[plan.extra["pp_rank"]]
                measured = sum(got[t] for t in ("parameters", "gradients", "optimizer_states", "activations"))
                terms = ("parameters", "gradients", "optimizer_states", "activations", "loss_logits")
                memory[plan.stage] = (measured / 2**20, sum(getattr(plan, t) for t in terms) / 2**20)
        rows.append((schedule, v, statistics.mean(idle), max(idle), (p - 1) / (v * m),
                     bubble_fraction(schedule, p, 0, m), statistics.median(w for r in ranks for w in r["walls"]),
                     memory))
    shutil.rmtree(root, ignore_errors=True)

    print(f"{'schedule':<17} {'v':>2} {'bubble':>7} {'(max)':>7} {'(p-1)/(vm)':>10} {'model':>6} {'step s':>7}  "
          "peak MiB measured / plan memory")
    for schedule, v, mean_idle, max_idle, formula, model, wall, memory in rows:
        mem = "  ".join(f"{stage} {got:.1f} / {plan:.1f}" for stage, (got, plan) in memory.items())
        print(f"{schedule:<17} {v:>2} {mean_idle:>7.3f} {max_idle:>7.3f} {formula:>10.3f} {model:>6.3f} "
              f"{wall:>7.3f}  {mem}")


if __name__ == "__main__":
    main()
