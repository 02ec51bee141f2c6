"""Plan a training run before booking a cluster — instantly, without torch.

  ultratron plan memory   --model llama3-8b --dp 8 --zero 1 --seq 8192 --recompute none,selective,full
  ultratron plan estimate --model llama3-8b --dp 8 --zero 1 --seq 8192 --grad-acc 16 --gpu h100-sxm --json
  ultratron plan scaling --flops 5.76e23            (or --gpus 1024 --gpu h100-sxm --days 30 --mfu 0.4)
  ultratron plan search  --model llama3-8b --gpu h100-sxm --gpus 8 --batch-tokens 1048576 --seq 8192
  ultratron plan memory  --model mixtral-8x7b --dp 8 --ep 8 --zero 3 --seq 4096   (a mixture of experts)

The model and layout flags are generated from their definitions (`models.presets.ModelShape`,
`planning.layout.Layout`), the same the trainer's config takes: `--tp` is `parallel.tp`,
`--seq-len` (or `--seq`) `training.seq_len`. Comma-separated values in `plan memory` sweep a
layout field; --chart FILE.png draws the terms. `plan search` searches every layout field not
given and keeps the ones given.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

from ultratron import atomic
from ultratron.cli.plan_output import (
    gib,
    human,
    stacked_bars,
    start_line,
    step_table,
    table,
    varying_labels,
    wrap,
)
from ultratron.cli.plan_scaling import add_scaling_arguments
from ultratron.config.loader import add_arguments as add_field_flags
from ultratron.config.loader import coerce, type_hints
from ultratron.errors import UserError
from ultratron.fields import MISSING, field_problems
from ultratron.models.presets import PRESETS, ModelShape
from ultratron.planning import hardware
from ultratron.planning.compute import MATMUL_EFFICIENCY
from ultratron.planning.layout import Layout, underfilled_pipeline
from ultratron.planning.lora import TARGETS as LORA_TARGETS
from ultratron.planning.lora import adapter_params
from ultratron.planning.memory import ACTIVATION_MODELS, GiB, MemoryBreakdown, estimate_memory_per_rank, heaviest_rank
from ultratron.planning.params import count_params_of
from ultratron.planning.rules import shape_problems, short_name, trainer_limits

# A shape field no estimate reads (the config `plan search` writes does) stands in for itself when
# neither --model nor its flag gives it: Llama 3's RoPE base; max_seq_len: the longest sequence planned.
ROPE_THETA = 500_000.0
WHOLE = ("pp_split",)  # a layout field whose one value is itself a comma list: never swept


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", metavar="{memory,estimate,scaling,search}")
    sub.required = True
    mem = sub.add_parser("memory", help="bytes per GPU for a model and one or more layouts")
    _model_and_layout_arguments(mem, "a comma list sweeps a field; the trainer's parallel.* and training.* "
                                     "fields of the same names")
    mem.add_argument("--json", action="store_true", help="print JSON (with peak_bytes) instead of a table")
    mem.add_argument("--chart", metavar="PNG", help="stacked bars of the terms per layout")
    mem.add_argument("--lora-rank", type=int, default=0,
                     help="LoRA adapters of this rank on the frozen model (the trainer's lora.rank); 0: none")
    mem.add_argument("--lora-targets", default="q,k,v,o,gate,up,down", help="the adapted layers (lora.targets)")
    mem.set_defaults(plan_run=run_memory)

    est = sub.add_parser("estimate", help="peak memory, step time, tokens/s/GPU and MFU of one layout")
    _model_and_layout_arguments(est, "the trainer's parallel.* and training.* fields of the same names")
    _hardware_arguments(est)
    # its own flag, or argparse's prefix matching would read `--gpus 64` as `--gpus-per-node 64`
    est.add_argument("--gpus", type=int, help="total GPU count, checked against the layout's dp × tp × pp × cp")
    est.add_argument("--json", action="store_true", help="print JSON (peak_bytes, step_seconds, "
                                                         "tokens_per_sec_per_gpu, mfu and their terms)")
    est.set_defaults(plan_run=run_estimate)

    add_scaling_arguments(sub.add_parser("scaling", help="compute-optimal size and tokens, time, cost, checkpoint "
                                                         "storage"))

    se = sub.add_parser("search", help="fastest layout that fits; writes its config")
    _model_and_layout_arguments(se, "searched when not given; a value given is kept", search=True)
    _hardware_arguments(se)
    se.add_argument("--gpus", type=int, required=True, help="total GPU count")
    se.add_argument("--batch-tokens", type=int, required=True, help="global batch in tokens")
    se.add_argument("--top", type=int, default=5, help="layouts to print")
    se.add_argument("--out", default="plan-best.toml", help="config for the best layout ('-' to skip)")
    se.add_argument("--json", action="store_true")
    se.add_argument("--chart", metavar="PNG", help="step-time components of the top layouts")
    se.set_defaults(plan_run=run_search)


def _model_and_layout_arguments(parser: argparse.ArgumentParser, layout_help: str, search: bool = False) -> None:
    """The model flags (a preset, then each `ModelShape` field over it) and one flag per `Layout`
    field, generated from their definitions."""
    parser.add_argument("--model", help=f"preset: {', '.join(PRESETS)} (the shape flags override it)")
    add_field_flags(parser.add_argument_group("model shape (default: the preset's)"), ModelShape, unset=True)
    add_field_flags(parser.add_argument_group(f"layout ({layout_help})"), Layout, unset=search, text=True,
                    required=("seq_len",) if search else ())
    parser.add_argument("--activation-model", default="per-op", choices=ACTIVATION_MODELS,
                        help="per-op: what ultratron's trainer keeps; textbook: Korthikanti et al. 2022")


def _hardware_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", default="h100-sxm", help=f"GPU type: {', '.join(hardware.ACCELERATORS)}; custom (give "
                                                          "--peak-tflops, --memory-gib, --nvlink-gbs, --network-gbs); "
                                                          "profile (the --profile's measured matmul rate)")
    parser.add_argument("--gpus-per-node", type=int, help="default: the GPU type's usual node (8)")
    parser.add_argument("--headroom", type=float, default=0.10, help="fraction of memory left free (default 0.1)")
    parser.add_argument("--efficiency", type=float, default=None,
                        help=f"large-matmul fraction of peak (default {MATMUL_EFFICIENCY}, measured: "
                             "planning/compute.py; 1 with --gpu profile); small per-rank matmuls and short "
                             "attention run below it")
    parser.add_argument("--profile", metavar="JSON", help="links measured by `ultratron bench comm` (bandwidth and "
                                                          "latency per collective) instead of the GPU's table figures")
    hw = parser.add_argument_group("hardware figures (required with --gpu custom; else they override the table)")
    hw.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s of the layout's precision")
    hw.add_argument("--memory-gib", type=float, help="GPU memory, GiB")
    hw.add_argument("--nvlink-gbs", type=float, help="bus bandwidth NCCL reaches inside a node, GB/s per GPU "
                                                     "(nccl-tests' busbw; the table takes 0.8 of NVLink's datasheet)")
    hw.add_argument("--network-gbs", type=float, help="bus bandwidth across nodes, GB/s per GPU")
    hw.add_argument("--hbm-gbs", type=float, help="memory bandwidth kernels reach, GB/s (default: 0.92 of the "
                                                  "datasheet's; 0.92 × 3350 with --gpu custom)")
    hw.add_argument("--nvlink-latency-us", type=float, help="one collective's latency inside a node (default 10)")
    hw.add_argument("--network-latency-us", type=float, help="one collective's latency across nodes (default 30)")


CUSTOM_NEEDS = ("peak_tflops", "memory_gib", "nvlink_gbs", "network_gbs")


def resolve_hardware(args):
    """(accelerator, measured network or None, large-matmul efficiency) from --gpu, the figure flags
    and --profile."""
    from dataclasses import replace as with_fields

    from ultratron.planning.profile import accelerator_of_profile, load_profile, network_of_profile

    profile = load_profile(args.profile) if args.profile else None
    efficiency = args.efficiency
    if args.gpu == "custom":
        missing = [_flag(n) for n in CUSTOM_NEEDS if getattr(args, n) is None]
        if missing:
            raise UserError(f"--gpu custom needs {', '.join(missing)}")
        peak = args.peak_tflops * 1e12
        acc = hardware.Accelerator("custom", {k: peak for k in ("bf16", "fp16", "fp32", "tf32")},
                                   args.memory_gib * GiB, args.nvlink_gbs * 1e9, args.network_gbs * 1e9,
                                   args.gpus_per_node or 8, "given on the command line")
    elif args.gpu == "profile":
        if profile is None:
            raise UserError("--gpu profile needs --profile FILE (from `ultratron bench comm`)")
        acc = accelerator_of_profile(profile, args.memory_gib or 80.0)
        efficiency = 1.0 if efficiency is None else efficiency
    else:
        acc = hardware.get_accelerator(args.gpu)
        if args.peak_tflops is not None:
            acc = with_fields(acc, flops={k: args.peak_tflops * 1e12 for k in acc.flops})
        if args.memory_gib is not None:
            acc = with_fields(acc, memory_bytes=args.memory_gib * GiB)
        if args.nvlink_gbs is not None:  # a measured figure: no datasheet fraction applies
            acc = with_fields(acc, intra_node_bw=args.nvlink_gbs * 1e9, intra_node_achieved=1.0)
        if args.network_gbs is not None:
            acc = with_fields(acc, inter_node_bw=args.network_gbs * 1e9)
    if args.hbm_gbs is not None:
        acc = with_fields(acc, memory_bw=args.hbm_gbs * 1e9, memory_achieved=1.0)
    if args.nvlink_latency_us is not None:
        acc = with_fields(acc, intra_node_latency=args.nvlink_latency_us * 1e-6)
    if args.network_latency_us is not None:
        acc = with_fields(acc, inter_node_latency=args.network_latency_us * 1e-6)
    network = network_of_profile(profile, args.gpus_per_node) if profile else None
    return acc, network, MATMUL_EFFICIENCY if efficiency is None else efficiency


def run(args) -> int:
    return int(args.plan_run(args) or 0)


# ---- shared --------------------------------------------------------------------------------

def _flag(field: str) -> str:
    """`model.n_heads` or `n_heads` → `--n-heads`."""
    return "--" + field.rsplit(".", 1)[-1].replace("_", "-")


def resolve_shape(args, seq_len: int) -> ModelShape:
    """The model shape from --model and/or the shape flags; every missing field is one problem line."""
    values: dict = {"rope_theta": ROPE_THETA, "max_seq_len": seq_len}
    if args.model:
        if args.model not in PRESETS:
            raise UserError(f"unknown model preset {args.model!r}; known: {', '.join(PRESETS)}")
        values = asdict(PRESETS[args.model])
    values |= {f.name: getattr(args, f.name) for f in fields(ModelShape) if getattr(args, f.name) is not None}
    missing = [_flag(f.name) for f in fields(ModelShape) if f.name not in values
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise UserError(f"without --model these are needed: {', '.join(missing)}")
    shape = ModelShape(**values)
    problems = field_problems(shape, _flag) or shape_problems(shape, name=_flag)
    if problems:
        raise UserError(problems)
    return shape


def layout_values(args) -> dict[str, list]:
    """Each layout flag given: its values, typed as the field (a comma list sweeps)."""
    hints, values, problems = type_hints(Layout), {}, []
    for f in fields(Layout):
        raw = getattr(args, f.name)
        if raw is None or isinstance(raw, bool):
            values |= {} if raw is None else {f.name: [raw]}
            continue
        items = [raw] if f.name in WHOLE else [item for item in raw.split(",") if item.strip()] or [raw]
        try:
            values[f.name] = [coerce(item, hints[f.name], _flag(f.name), from_string=True) for item in items]
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise UserError(problems)
    return values


def memory_layouts(args) -> list[Layout]:
    """The layouts of the flags: every combination of the comma lists."""
    values = layout_values(args)
    layouts = [Layout(**dict(zip(values, combo, strict=True))) for combo in itertools.product(*values.values())]
    # --sp over a sweep of tp: sequence parallel where there is tensor parallelism to split
    return [replace(lay, sp=lay.sp and lay.tp > 1) if len(values["tp"]) > 1 else lay for lay in layouts]


# ---- memory --------------------------------------------------------------------------------

def run_memory(args) -> int:
    layouts = memory_layouts(args)
    shape = resolve_shape(args, max(1, *(lay.seq_len for lay in layouts)))
    if len(layouts) > 64:
        raise UserError(f"the sweep makes {len(layouts)} layouts; keep it to 64 or fewer")
    results: list[tuple[Layout, MemoryBreakdown]] = []
    per_rank: list[list[MemoryBreakdown]] = []
    problems: list[str] = []
    lora = None
    if args.lora_rank > 0:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or args.lora_rank < 0:
            raise UserError(f"--lora-targets: {', '.join(unknown)} not among {', '.join(LORA_TARGETS)}")
        lora = (args.lora_rank, targets)
    for layout in layouts:
        underfilled = underfilled_pipeline(layout)
        if underfilled:  # such runs exist: slow (mostly bubble), not impossible
            print(f"warning: {layout.describe()}: {underfilled}; estimated as it would run, mostly idle",
                  file=sys.stderr)
        try:
            ranks = estimate_memory_per_rank(shape, layout, args.activation_model, lora, fill_pipeline=False)
        except UserError as err:
            problems += [f"{layout.describe()}: {p}" for p in err.problems]
            continue
        per_rank.append(ranks)
        results.append((layout, heaviest_rank(ranks)))
    if problems:
        raise UserError(problems)
    counts = count_params_of(shape)
    if args.json:
        print(json.dumps({
            "model": asdict(shape), "params": counts.total, "activation_model": args.activation_model,
            "lora_params": adapter_params(shape, *lora) if lora else 0,
            "peak_bytes": max(m.peak_bytes for _, m in results),
            # from meta to the first step: a fresh start (initialization) and a start from a checkpoint
            "start_init_bytes": max(m.start_init_bytes for _, m in results),
            "start_load_bytes": max(m.start_load_bytes for _, m in results),
            "layouts": [{"layout": asdict(lay), "describe": lay.describe(), **mem.as_dict(),
                         "pipeline_ranks": [r.as_dict() for r in ranks] if lay.pp > 1 else []}
                        for (lay, mem), ranks in zip(results, per_rank, strict=True)],
        }, indent=1))
    else:
        active = f" ({counts.active / 1e9:.3f}B active per token)" if counts.active != counts.total else ""
        print(f"model: {args.model or 'custom'} — {counts.total / 1e9:.3f}B parameters{active}; activations: "
              f"{args.activation_model}; GiB on the heaviest GPU")
        if lora is not None:
            trainable = adapter_params(shape, *lora)
            print(f"lora: rank {lora[0]} on {','.join(lora[1])}: {trainable / 1e6:.2f}M trainable parameters "
                  f"({trainable / (counts.total + trainable):.2%}); the model's own weights frozen: their "
                  "parameters only, gradients and optimizer state for the adapters alone")
        header = ["term"] + [f"#{i + 1}" for i in range(len(results))]
        rows = [[term] + [gib(getattr(m, term)) for _, m in results] for term in MemoryBreakdown.TERMS]
        rows.append(["step_temporaries"] + [gib(m.step_temporaries) for _, m in results])
        rows.append(["peak"] + [gib(m.peak_bytes) for _, m in results])
        rows.append(["peak at"] + [m.peak_moment for _, m in results])
        rows.append(["of the peak, the loss's"] + [gib(m.loss_share_bytes) for _, m in results])
        rows.append(["start: init"] + [gib(m.start_init_bytes) for _, m in results])
        rows.append(["start: from a checkpoint"] + [gib(m.start_load_bytes) for _, m in results])
        rows.append(["stage"] + [m.stage if lay.pp == 1 else f"{m.stage} (rank {m.extra['pp_rank']})"
                                 for lay, m in results])
        if any(lay.offload_activations for lay, _ in results):  # host memory, not in the GPU's peak
            rows.append(["host (offloaded)"] + [gib(m.host_activations) for _, m in results])
        print(table(header, rows))
        for i, (lay, m) in enumerate(results):
            experts = m.extra["expert_params_on_gpu"]
            moe = (f"; experts: {human(experts)} params on the GPU (their parameters, gradients and optimizer "
                   f"state, split over ep·tp, not ZeRO-sharded), all-to-all buffers {gib(m.extra['all_to_all_bytes'])}"
                   f" GiB (in comm_buffers)") if experts else ""
            print(f"#{i + 1}: {lay.describe()} seq={lay.seq_len} {lay.precision}"
                  f"{' fp32-grad-accum' if lay.fp32_grad_accum else ''}"
                  f"{' zero3-units=linear' if lay.zero3_units == 'linear' and lay.zero == 3 else ''}{moe}")
            print(f"    {start_line(lay, m)}")
    if args.chart:
        labels = varying_labels([lay for lay, _ in results])
        series = {term: [getattr(m, term) / GiB for _, m in results] for term in MemoryBreakdown.TERMS}
        stacked_bars(args.chart, labels, series, "GiB per GPU", f"{args.model or 'custom model'}: memory per GPU")
        if not args.json:
            print(f"chart: {args.chart}")
    return 0


# ---- search --------------------------------------------------------------------------------

def _hardware_problems(args) -> list[str]:
    problems = []
    if not 0 <= args.headroom < 1:
        problems.append(f"--headroom must lie in [0, 1), got {args.headroom}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        problems.append(f"--efficiency must lie in (0, 1], got {args.efficiency}")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        problems.append(f"--gpus-per-node must be positive, got {args.gpus_per_node}")
    return problems


def run_estimate(args) -> int:
    from ultratron.planning.layout import check_layout
    from ultratron.planning.search import SearchSpec, estimate_step

    layouts = memory_layouts(args)
    shape = resolve_shape(args, max(1, layouts[0].seq_len))
    if len(layouts) > 1:
        raise UserError("plan estimate takes one layout; `ultratron plan memory` sweeps comma lists")
    layout = layouts[0]
    problems = _hardware_problems(args) + check_layout(shape, layout)
    if args.gpus is not None and args.gpus != layout.n_gpus:
        problems.append(f"--gpus {args.gpus}, but the layout (dp {layout.dp} × tp {layout.tp} × pp {layout.pp} × "
                        f"cp {layout.cp}) uses {layout.n_gpus}: give the axes, or `plan search --gpus` to choose them")
    if problems:
        raise UserError(problems)
    acc, network, efficiency = resolve_hardware(args)
    if layout.precision not in acc.flops:
        raise UserError(f"no {layout.precision} peak for {acc.name}")
    gpus = layout.n_gpus
    per_node = args.gpus_per_node or (network.gpus_per_node if network else min(acc.gpus_per_node, gpus))
    spec = SearchSpec(shape, acc, gpus, per_node,
                      layout.dp * layout.micro_batch_size * layout.grad_accum * layout.seq_len, layout.seq_len,
                      layout.precision, args.headroom, efficiency, activation_model=args.activation_model,
                      network=network)
    est = estimate_step(spec, layout)
    if args.json:
        print(json.dumps({"model": asdict(shape), "gpu": acc.name, "n_gpus": gpus, "gpus_per_node": spec.gpus_per_node,
                          "batch_tokens": spec.global_batch_tokens, "usable_bytes": spec.usable_bytes,
                          "fits": est.memory.fit_bytes <= spec.usable_bytes, "efficiency": spec.efficiency,
                          "overlap": spec.overlap, "profile": args.profile, **est.as_dict()}, indent=1))
        return 0
    print(f"{args.model or 'custom model'} on {gpus} × {acc.name} ({spec.gpus_per_node} per node"
          f"{', links from ' + args.profile if args.profile else ''}), {spec.global_batch_tokens:,} tokens per step: "
          f"{layout.describe()}")
    mem = est.memory
    fits = mem.fit_bytes <= spec.usable_bytes
    verdict = "fits" if fits else "does NOT fit" + ("" if mem.fit_moment == "step" else f": {mem.fit_description()}")
    print(f"peak {mem.peak_bytes / GiB:.2f} GiB per GPU ({spec.usable_bytes / GiB:.1f} usable: {verdict}); "
          f"step {est.step_s:.3f} s; {est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU; MFU {est.mfu:.1%}")
    print(start_line(layout, mem))
    print(step_table(est))
    for reason in est.reasons[2:]:
        print(f"   - {reason}")
    for limit in trainer_limits(layout, short_name):
        print(f"   - priced, but not yet for ultratron's trainer: {limit}")
    if layout.precision == "fp8":
        print("   - fp8: the blocks' matmuls are priced at the fp8 peak with bf16's efficiency, a rate not yet "
              "measured; published fp8 runs came out 1.05-1.3x slower than this predicts: read it as an upper "
              "bound (docs/planning.md)")
    return 0


def run_search(args) -> int:
    from ultratron.config.layouts import config_toml
    from ultratron.planning.search import SearchSpec, search

    fixed = layout_values(args)
    shape = resolve_shape(args, max(1, fixed["seq_len"][0]))
    problems = [f"plan search keeps one value of {_flag(name)}, got {len(v)}; `plan memory` sweeps comma lists"
                for name, v in fixed.items() if len(v) > 1]
    fixed = {name: v[0] for name, v in fixed.items()}
    problems += field_problems(Layout(**fixed), _flag) + _hardware_problems(args)
    problems += [f"--{n.replace('_', '-')} must be positive, got {getattr(args, n)}"
                 for n in ("gpus", "batch_tokens") if getattr(args, n) <= 0]
    if problems:
        raise UserError(problems)
    seq_len, precision = fixed.pop("seq_len"), fixed.pop("precision", Layout.precision)
    acc, network, efficiency = resolve_hardware(args)
    per_node = args.gpus_per_node or (network.gpus_per_node if network else min(acc.gpus_per_node, args.gpus))
    spec = SearchSpec(shape, acc, args.gpus, per_node, args.batch_tokens, seq_len, precision, args.headroom,
                      efficiency, activation_model=args.activation_model, fixed=fixed, network=network)
    result = search(spec, top=args.top)
    if not result.best and fixed.get("compile"):
        result.summary.append("compile rules out tensor parallel (the trainer does not yet compile blocks under "
                              "tp > 1): without --compile, layouts with tp are searched too")
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
        parts = {"compute": "compute_s", "elementwise": "elementwise_s", "optimizer": "optimizer_s",
                 "TP": "tp_comm_s", "CP exposed": "cp_exposed_s", "EP all-to-all": "ep_comm_s",
                 "PP p2p": "pp_comm_s", "bubble": "bubble_s", "DP exposed": "dp_exposed_s"}
        series = {name: [getattr(e, attr) for e in result.ranked] for name, attr in parts.items()}
        stacked_bars(args.chart, labels, series, "seconds per step",
                      f"{args.model or 'custom'} on {args.gpus} × {acc.name}: step time")
    return 0 if result.best else 1

