"""`ultratron plan scaling`: compute-optimal size and tokens, training time, cost and checkpoint
storage for a compute budget or a model (`planning/scaling.py`). It takes no layout, so its flags
are its own."""

from __future__ import annotations

import argparse
import json
import math

from ultratron.cli.plan_output import human, table
from ultratron.errors import UserError
from ultratron.models.presets import PRESETS
from ultratron.planning import hardware, scaling
from ultratron.planning.params import count_params_of


def add_scaling_arguments(sc: argparse.ArgumentParser) -> None:
    sc.add_argument("--flops", type=float, help="compute budget in FLOPs")
    sc.add_argument("--gpus", type=int, help="GPU count (for a budget from GPU-days, and for time)")
    sc.add_argument("--gpu", default="h100-sxm", help=f"GPU type: {', '.join(hardware.ACCELERATORS)}")
    sc.add_argument("--days", type=float, help="days on --gpus GPUs (budget from GPU-days)")
    sc.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default 0.4)")
    sc.add_argument("--model", help="a preset to time instead of the compute-optimal size")
    sc.add_argument("--params", type=float, help="(active) parameters of the model to time")
    sc.add_argument("--total-params", type=float, help="MoE: total parameters (memory, checkpoints)")
    sc.add_argument("--moe-total-to-active", type=float, default=1.0,
                    help="MoE: total/active parameter ratio applied to compute-optimal (active) sizes")
    sc.add_argument("--tokens", type=float, help="training tokens of the model to time")
    sc.add_argument("--tokens-per-param", type=float, default=20.0)
    sc.add_argument("--price-per-gpu-hour", type=float, default=0.0, help="USD; 0 leaves cost out")
    sc.add_argument("--batch-tokens", type=float, default=4 * 2**20, help="tokens per step (for step counts)")
    sc.add_argument("--save-interval", type=int, default=1000, help="steps between checkpoints")
    sc.add_argument("--keep", type=int, default=3, help="checkpoints kept on disk")
    sc.add_argument("--json", action="store_true")
    sc.set_defaults(plan_run=run_scaling)


def run_scaling(args) -> int:
    problems = []
    for name in ("flops", "gpus", "days", "params", "total_params", "tokens", "batch_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            problems.append(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    if not 0 < args.mfu <= 1:
        problems.append(f"--mfu must lie in (0, 1], got {args.mfu}")
    if args.flops is None and (args.gpus is None or args.days is None) and args.params is None and not args.model:
        problems.append("give a budget: --flops C, or --gpus N --days D (with --gpu and --mfu), "
                        "or a model to time: --model PRESET / --params N with --tokens D")
    if problems:
        raise UserError(problems)
    acc = hardware.get_accelerator(args.gpu)
    peak = acc.flops["bf16"]
    budget = args.flops
    budget_source = "given"
    if budget is None and args.gpus and args.days:
        budget = scaling.budget_flops(args.gpus, args.days, args.mfu, peak)
        budget_source = f"{args.gpus} × {acc.name} × {args.days:g} days at MFU {args.mfu:.0%}"
    out: dict = {"budget_flops": budget, "budget_source": budget_source, "rows": []}
    rows = []
    if budget:
        for alloc in (scaling.compute_optimal(budget, scaling.FITS["epoch"]),
                      scaling.compute_optimal(budget, scaling.FITS["hoffmann"]),
                      scaling.tokens_per_param_rule(budget, args.tokens_per_param)):
            rows.append((alloc.method, alloc.params, alloc.params * args.moe_total_to_active, alloc.tokens,
                         alloc.loss))
    if args.model or args.params:
        if args.model and args.model not in PRESETS:
            raise UserError(f"unknown model preset {args.model!r}; known: {', '.join(PRESETS)}")
        counts = count_params_of(PRESETS[args.model]) if args.model else None
        active = args.params or counts.active
        total = args.total_params or (counts.total if counts and not args.params else active)
        tokens = args.tokens or args.tokens_per_param * active
        rows.append((args.model or "given model", active, total, tokens, scaling.FITS["epoch"].loss(active, tokens)))
    for method, active, total, tokens, loss in rows:
        flops = 6 * active * tokens
        row = {"method": method, "active_params": active, "total_params": total, "tokens": tokens,
               "tokens_per_param": tokens / active, "flops": flops, "loss": loss}
        if args.gpus:
            seconds = scaling.training_seconds(flops, args.gpus, args.mfu, peak)
            row.update(days=seconds / 86400, gpu_hours=seconds * args.gpus / 3600,
                       cost_usd=seconds * args.gpus / 3600 * args.price_per_gpu_hour)
        steps = math.ceil(tokens / args.batch_tokens)
        store = scaling.checkpoint_storage(total, steps, args.save_interval, args.keep)
        row.update(steps=steps, checkpoint_bytes=store.checkpoint_bytes, storage_peak_bytes=store.peak_bytes,
                   storage_written_bytes=store.written_bytes, saves=store.saves)
        out["rows"].append(row)
    out["fits"] = {name: fit.source for name, fit in scaling.FITS.items()}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    if budget:
        print(f"compute budget: {budget:.3g} FLOPs ({budget_source}); C = 6·N·D")
    header = ["allocation", "active N", "total N", "tokens D", "D/N", "loss", "ckpt", "disk (kept)"]
    if args.gpus:
        header += [f"days on {args.gpus}×{acc.name}", "GPU-hours"] + (["cost $"] if args.price_per_gpu_hour else [])
    lines = []
    for r in out["rows"]:
        cells = [r["method"], human(r["active_params"]), human(r["total_params"]), human(r["tokens"]),
                 f"{r['tokens_per_param']:.1f}", "—" if r["loss"] is None else f"{r['loss']:.3f}",
                 f"{r['checkpoint_bytes'] / 1e9:,.0f} GB", f"{r['storage_peak_bytes'] / 1e12:,.2f} TB"]
        if args.gpus:
            cells += [f"{r['days']:.1f}", f"{r['gpu_hours']:,.0f}"]
            if args.price_per_gpu_hour:
                cells.append(f"{r['cost_usd']:,.0f}")
        lines.append(cells)
    print(table(header, lines))
    print("fits: epoch = " + scaling.FITS["epoch"].source + "; hoffmann = " + scaling.FITS["hoffmann"].source)
    print(f"checkpoint = weights bf16 + fp32 master + 2 Adam moments (14 bytes × total params); "
          f"saved every {args.save_interval} steps of {human(args.batch_tokens)} tokens, {args.keep} kept "
          f"(+1 while writing)")
    return 0
