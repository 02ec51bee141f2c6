"""Plan a training run before booking a cluster — instantly, without torch.

  ultratron plan memory   --model llama3-8b --dp 8 --zero 1 --seq 8192 --recompute none,selective,full
  ultratron plan estimate --model llama3-8b --dp 8 --zero 1 --seq 8192 --grad-acc 16 --gpu h100-sxm --json
  ultratron plan scaling --flops 5.76e23            (or --gpus 1024 --gpu h100-sxm --days 30 --mfu 0.4)
  ultratron plan search  --model llama3-8b --gpu h100-sxm --gpus 8 --batch-tokens 1048576 --seq 8192
  ultratron plan memory  --model mixtral-8x7b --dp 8 --ep 8 --zero 3 --seq 4096   (a mixture of experts)

Comma-separated values in `plan memory` sweep a layout field; --chart FILE.png draws the terms.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import asdict
from dataclasses import fields as dataclass_fields
from pathlib import Path
from types import SimpleNamespace

from ultratron import atomic
from ultratron.cli.plan_output import gib, human, stacked_bars, table, varying_labels, wrap
from ultratron.errors import UserError
from ultratron.models.presets import PRESETS, ModelShape
from ultratron.planning import hardware, scaling
from ultratron.planning.memory import (
    ACTIVATION_MODELS,
    PRECISIONS,
    GiB,
    Layout,
    MemoryBreakdown,
    estimate_memory_per_rank,
)
from ultratron.planning.params import count_params_of
from ultratron.planning.pipeline import BALANCES, SCHEDULES
from ultratron.planning.rules import shape_problems

SHAPE_FIELDS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
# optional shape fields (a preset's or ModelShape's default when not given): head width, MoE
OPTIONAL_FIELDS = ("head_dim", "n_experts", "n_active_experts", "n_shared_experts", "expert_ffn_dim", "n_dense_layers")
SWEEPABLE = ("dp", "zero", "tp", "pp", "pp_schedule", "virtual_stages", "cp", "ep", "mbs", "grad_acc", "seq",
             "recompute")
TEXT_SWEEPS = ("pp_schedule", "recompute")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", metavar="{memory,estimate,scaling,search}")
    sub.required = True
    mem = sub.add_parser("memory", help="bytes per GPU for a model and one or more layouts")
    _layout_arguments(mem, lists=True)
    mem.add_argument("--json", action="store_true", help="print JSON (with peak_bytes) instead of a table")
    mem.add_argument("--chart", metavar="PNG", help="stacked bars of the terms per layout")
    mem.set_defaults(plan_run=run_memory)

    est = sub.add_parser("estimate", help="peak memory, step time, tokens/s/GPU and MFU of one layout")
    _layout_arguments(est, lists=False)
    _hardware_arguments(est)
    est.add_argument("--json", action="store_true", help="print JSON (peak_bytes, step_seconds, "
                                                         "tokens_per_sec_per_gpu, mfu and their terms)")
    est.set_defaults(plan_run=run_estimate)

    sc = sub.add_parser("scaling", help="compute-optimal size and tokens, time, cost, checkpoint storage")
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

    se = sub.add_parser("search", help="fastest layout that fits; writes its config")
    _model_arguments(se)
    _hardware_arguments(se)
    se.add_argument("--gpus", type=int, required=True, help="total GPU count")
    se.add_argument("--batch-tokens", type=int, required=True, help="global batch in tokens")
    se.add_argument("--seq", type=int, required=True, help="sequence length")
    se.add_argument("--precision", default="bf16", choices=PRECISIONS)
    se.add_argument("--activation-model", default="per-op", choices=ACTIVATION_MODELS)
    se.add_argument("--top", type=int, default=5, help="layouts to print")
    se.add_argument("--out", default="plan-best.toml", help="config for the best layout ('-' to skip)")
    se.add_argument("--json", action="store_true")
    se.add_argument("--chart", metavar="PNG", help="step-time components of the top layouts")
    se.set_defaults(plan_run=run_search)


def _layout_arguments(parser: argparse.ArgumentParser, lists: bool) -> None:
    """The model and one layout's fields (`lists`: integer and text fields take comma lists to sweep)."""
    _model_arguments(parser)
    what = "integer or comma list" if lists else "integer"
    for name, default in (("dp", "1"), ("zero", "0"), ("tp", "1"), ("pp", "1"), ("virtual-stages", "0"),
                          ("cp", "1"), ("ep", "1"), ("mbs", "1"), ("grad-acc", "1"), ("seq", "4096")):
        extra = "; pipeline stages per rank, 0: the schedule's own" if name == "virtual-stages" else ""
        parser.add_argument(f"--{name}", default=default, help=f"{what} (default {default}{extra})")
    parser.add_argument("--sp", action="store_true", help="sequence parallel (with tp > 1)")
    parser.add_argument("--pp-schedule", default="1f1b",
                        help=f"pipeline schedule, as the trainer's parallel.pp_schedule: {', '.join(SCHEDULES)}"
                             + (", or a comma list" if lists else ""))
    parser.add_argument("--pp-split", help="layers per pipeline stage, comma-separated (as parallel.pp_split)")
    parser.add_argument("--pp-balance", default="flops", choices=BALANCES,
                        help="what the default stage split evens out (as parallel.pp_balance)")
    parser.add_argument("--recompute", default="none", help="none|selective|full" + (", or a comma list" if lists
                                                                                  else ""))
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS)
    parser.add_argument("--fp32-grad-accum", action="store_true",
                        help="price the Megatron-LM convention instead of the trainer's: bf16 weights, fp32 main "
                             "gradients (no bf16 copy), fp32 master weights")
    parser.add_argument("--attention-fp32", action="store_true",
                        help="attention computed in fp32 under bf16 (as ultratron does on CPU)")
    parser.add_argument("--activation-model", default="per-op", choices=ACTIVATION_MODELS,
                        help="per-op: what ultratron's trainer keeps; textbook: Korthikanti et al. 2022")


def _hardware_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", default="h100-sxm", help=f"GPU type: {', '.join(hardware.ACCELERATORS)}")
    parser.add_argument("--gpus-per-node", type=int, help="default: the GPU type's usual node (8)")
    parser.add_argument("--headroom", type=float, default=0.10, help="fraction of memory left free (default 0.1)")
    parser.add_argument("--efficiency", type=float, default=0.6, help="large-matmul fraction of peak (default 0.6)")


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=f"preset: {', '.join(PRESETS)} (explicit fields below override it)")
    for name in SHAPE_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    for name in OPTIONAL_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name,
                            help="mixture of experts (as model." + name + ")" if name != "head_dim" else
                            "attention head width (0: dim / n-heads)")
    parser.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--qk-norm", action="store_true")


def run(args) -> int:
    return int(args.plan_run(args) or 0)


# ---- shared --------------------------------------------------------------------------------

def resolve_shape(args) -> SimpleNamespace:
    """The model shape from --model and/or the explicit fields; every missing field is one problem line."""
    values: dict = {f.name: f.default for f in dataclass_fields(ModelShape) if f.name in OPTIONAL_FIELDS}
    if args.model:
        if args.model not in PRESETS:
            raise UserError(f"unknown model preset {args.model!r}; known: {', '.join(PRESETS)}")
        values = asdict(PRESETS[args.model])
    for name in (*SHAPE_FIELDS, *OPTIONAL_FIELDS, "tie_embeddings"):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    missing = [f"--{n.replace('_', '-')}" for n in (*SHAPE_FIELDS, "tie_embeddings") if values.get(n) is None]
    if missing:
        raise UserError(f"without --model these are needed: {', '.join(missing)}")
    problems = [f"--{n.replace('_', '-')} must be positive, got {values[n]}" for n in SHAPE_FIELDS if values[n] <= 0]
    if not problems:
        problems = shape_problems(SimpleNamespace(**values), name=lambda f: "--" + f.split(".")[1].replace("_", "-"))
    if problems:
        raise UserError(problems)
    values["qk_norm"] = bool(getattr(args, "qk_norm", False) or values.get("qk_norm", False))
    return SimpleNamespace(**values)


# ---- memory --------------------------------------------------------------------------------

def _int_list(name: str, text: str) -> list[int]:
    try:
        return [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--{name.replace('_', '-')} expects integers (or a comma list), got {text!r}") from None


def memory_layouts(args) -> list[Layout]:
    sweep: dict[str, list] = {}
    for name in SWEEPABLE:
        raw = getattr(args, name)
        sweep[name] = [v.strip() for v in str(raw).split(",")] if name in TEXT_SWEEPS else _int_list(name, raw)
    base = dict(sp=args.sp, pp_split=args.pp_split, pp_balance=args.pp_balance,
                precision=args.precision,
                fp32_grad_accum=args.fp32_grad_accum,
                attention_fp32=args.attention_fp32)
    return [Layout(**base, **dict(zip(sweep, combo, strict=True))) for combo in itertools.product(*sweep.values())]


def run_memory(args) -> int:
    shape = resolve_shape(args)
    layouts = memory_layouts(args)
    if len(layouts) > 64:
        raise UserError(f"the sweep makes {len(layouts)} layouts; keep it to 64 or fewer")
    results: list[tuple[Layout, MemoryBreakdown]] = []
    per_rank: list[list[MemoryBreakdown]] = []
    problems: list[str] = []
    for layout in layouts:
        try:
            ranks = estimate_memory_per_rank(shape, layout, args.activation_model)
        except UserError as err:
            problems += [f"{layout.describe()}: {p}" for p in err.problems]
            continue
        per_rank.append(ranks)
        results.append((layout, max(ranks, key=lambda m: m.peak_bytes)))
    if problems:
        raise UserError(problems)
    counts = count_params_of(shape)
    if args.json:
        print(json.dumps({
            "model": vars(shape), "params": counts.total, "activation_model": args.activation_model,
            "peak_bytes": max(m.peak_bytes for _, m in results),
            "layouts": [{"layout": asdict(lay), "describe": lay.describe(), **mem.as_dict(),
                         "pipeline_ranks": [r.as_dict() for r in ranks] if lay.pp > 1 else []}
                        for (lay, mem), ranks in zip(results, per_rank, strict=True)],
        }, indent=1))
    else:
        active = f" ({counts.active / 1e9:.3f}B active per token)" if counts.active != counts.total else ""
        print(f"model: {args.model or 'custom'} — {counts.total / 1e9:.3f}B parameters{active}; activations: "
              f"{args.activation_model}; GiB on the heaviest GPU")
        header = ["term"] + [f"#{i + 1}" for i in range(len(results))]
        rows = [[term] + [gib(getattr(m, term)) for _, m in results] for term in MemoryBreakdown.TERMS]
        rows.append(["peak"] + [gib(m.peak_bytes) for _, m in results])
        rows.append(["stage"] + [m.stage if lay.pp == 1 else f"{m.stage} (rank {m.extra['pp_rank']})"
                                 for lay, m in results])
        print(table(header, rows))
        for i, (lay, m) in enumerate(results):
            experts = m.extra["expert_params_on_gpu"]
            moe = (f"; experts: {human(experts)} params on the GPU (their parameters, gradients and optimizer "
                   f"state, split over ep·tp, not ZeRO-sharded), all-to-all buffers {gib(m.extra['all_to_all_bytes'])}"
                   f" GiB (in comm_buffers)") if experts else ""
            print(f"#{i + 1}: {lay.describe()} seq={lay.seq} {lay.precision}"
                  f"{' fp32-grad-accum' if lay.fp32_grad_accum else ''}{moe}")
    if args.chart:
        labels = varying_labels([lay for lay, _ in results])
        series = {term: [getattr(m, term) / GiB for _, m in results] for term in MemoryBreakdown.TERMS}
        stacked_bars(args.chart, labels, series, "GiB per GPU", f"{args.model or 'custom model'}: memory per GPU")
        if not args.json:
            print(f"chart: {args.chart}")
    return 0


# ---- scaling -------------------------------------------------------------------------------

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


# ---- search --------------------------------------------------------------------------------

def _hardware_problems(args) -> list[str]:
    problems = []
    if not 0 <= args.headroom < 1:
        problems.append(f"--headroom must lie in [0, 1), got {args.headroom}")
    if not 0 < args.efficiency <= 1:
        problems.append(f"--efficiency must lie in (0, 1], got {args.efficiency}")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        problems.append(f"--gpus-per-node must be positive, got {args.gpus_per_node}")
    return problems


def run_estimate(args) -> int:
    from ultratron.planning.memory import check_layout
    from ultratron.planning.search import SearchSpec, estimate_step

    shape = resolve_shape(args)
    acc = hardware.get_accelerator(args.gpu)
    layouts = memory_layouts(args)
    if len(layouts) > 1:
        raise UserError("plan estimate takes one layout; `ultratron plan memory` sweeps comma lists")
    layout = layouts[0]
    problems = _hardware_problems(args) + check_layout(shape, layout)
    if layout.precision not in acc.flops:
        problems.append(f"no {layout.precision} peak for {acc.name}")
    if problems:
        raise UserError(problems)
    gpus = layout.n_gpus
    spec = SearchSpec(shape, acc, gpus, args.gpus_per_node or min(acc.gpus_per_node, gpus),
                      layout.dp * layout.mbs * layout.grad_acc * layout.seq, layout.seq, layout.precision,
                      args.headroom, args.efficiency, activation_model=args.activation_model)
    est = estimate_step(spec, layout)
    if args.json:
        print(json.dumps({"model": vars(shape), "gpu": acc.name, "n_gpus": gpus, "gpus_per_node": spec.gpus_per_node,
                          "batch_tokens": spec.global_batch_tokens, "usable_bytes": spec.usable_bytes,
                          "fits": est.memory.peak_bytes <= spec.usable_bytes, "efficiency": spec.efficiency,
                          "overlap": spec.overlap, **est.as_dict()}, indent=1))
        return 0
    print(f"{args.model or 'custom model'} on {gpus} × {acc.name} ({spec.gpus_per_node} per node), "
          f"{spec.global_batch_tokens:,} tokens per step: {layout.describe()}")
    print(f"peak {est.memory.peak_bytes / GiB:.2f} GiB per GPU ({spec.usable_bytes / GiB:.1f} usable: "
          f"{'fits' if est.memory.peak_bytes <= spec.usable_bytes else 'does NOT fit'}); "
          f"step {est.step_s:.3f} s; {est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU; MFU {est.mfu:.1%} "
          f"(at an assumed matmul efficiency of {spec.efficiency:.0%})")
    for reason in est.reasons[1:]:
        print(f"   - {reason}")
    return 0


def run_search(args) -> int:
    from ultratron.config.layouts import config_toml
    from ultratron.planning.search import SearchSpec, search

    shape = resolve_shape(args)
    acc = hardware.get_accelerator(args.gpu)
    problems = [f"--{n.replace('_', '-')} must be positive, got {getattr(args, n)}"
                for n in ("gpus", "batch_tokens", "seq") if getattr(args, n) <= 0]
    problems += _hardware_problems(args)
    if problems:
        raise UserError(problems)
    spec = SearchSpec(shape, acc, args.gpus, args.gpus_per_node or min(acc.gpus_per_node, args.gpus),
                      args.batch_tokens, args.seq, args.precision, args.headroom, args.efficiency,
                      activation_model=args.activation_model)
    result = search(spec, top=args.top)
    wrote = None
    if result.best and args.out != "-":
        path = Path(args.out)
        atomic.write_text(path, config_toml(spec, result.best, args.model))
        wrote = str(path)
    if args.json:
        print(json.dumps({"summary": result.summary, "considered": result.considered, "too_big": result.too_big,
                          "layouts": [e.as_dict() for e in result.ranked], "config": wrote,
                          "closest": result.closest.as_dict() if result.closest and not result.best else None},
                         indent=1))
    else:
        print("\n".join(result.summary))
        for i, est in enumerate(result.ranked):
            print(f"\n#{i + 1} {est.layout.describe()}: {est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                  f"MFU {est.mfu:.1%}, {est.memory.peak_bytes / GiB:.1f} GiB")
            for reason in est.reasons:
                print(f"   - {reason}")
        if wrote:
            print(f"\nconfig for #1 written to {wrote}")
    if args.chart and result.ranked:
        labels = [f"#{i + 1}\n" + wrap(e.layout.describe()) for i, e in enumerate(result.ranked)]
        parts = {"compute": "compute_s", "TP": "tp_comm_s", "CP exposed": "cp_exposed_s", "EP all-to-all": "ep_comm_s",
                 "PP p2p": "pp_comm_s",
                 "bubble": "bubble_s", "DP exposed": "dp_exposed_s"}
        series = {name: [getattr(e, attr) for e in result.ranked] for name, attr in parts.items()}
        stacked_bars(args.chart, labels, series, "seconds per step",
                      f"{args.model or 'custom'} on {args.gpus} × {acc.name}: step time")
    return 0 if result.best else 1

