"""Predicted vs measured step time: `plan estimate`'s cost model against `ultratron train` on this
machine, and against published runs whose layout is fully known.

  python benchmarks/plan_vs_measured.py [--out DIR] [--runs N] [--reuse DIR ...] [--steps 6] [--skip-local]

Local part, --runs times (each into DIR/run-i; --reuse predicts earlier runs again without measuring):
`ultratron bench comm --nproc 4` measures this machine's collectives (gloo), the matmul and
elementwise rates of all four ranks at once and of one alone, the cores, and the tiny model's own
non-matmul work on one rank (a block, the loss, attention, the optimizer step); `ultratron bench sweep`
trains the tiny model for --steps steps on 4 gloo processes in six layouts (dp4, dp2×tp2, dp2×pp2
1F1B and GPipe, cp2×dp2, ZeRO-3 dp4); each measured median step time is set beside
`planning.search.estimate_step` under that profile (the planner's one function, no constant fitted
per layout), then one process alone (dp4's share of the batch) against the planner's step for it.
The machine is shared and noisy: each run's ratio is printed side by side, and the medians over
runs. Published part: the runs in `PUBLISHED`, each predicted on the GPU table's figures (with the
changes said there). The docs quote the figures (docs/planning.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from ultratron.models.presets import PRESETS
from ultratron.planning.hardware import get_accelerator
from ultratron.planning.layout import Layout
from ultratron.planning.profile import accelerator_of_profile, load_profile, network_of_profile, profile_note
from ultratron.planning.search import SearchSpec, estimate_step

LOCAL = {  # name: the sweep's layout words (4 processes; the tiny model's batch of 8,192 tokens at seq 256)
    "dp4": "dp=4",
    "dp2×tp2": "dp=2 tp=2",
    "dp2×pp2 1f1b": "dp=2 pp=2 pp_schedule=1f1b mbs=2",
    "dp2×pp2 gpipe": "dp=2 pp=2 pp_schedule=gpipe mbs=2",
    "cp2×dp2": "dp=2 parallel.cp=2",
    "zero3 dp4": "dp=4 zero=3",
}

# Published runs whose layout is fully known, from torchtitan's own benchmark files (seq 8192, its
# Llama-3 configs; tokens/s per GPU). Most ran on one kind of machine, Grand Teton: 8 H100 a host on
# NVLink, 96 GB HBM2e "with 2.4 TB/sec peak memory bandwidth" at the default 500 W, 400 Gb/s per GPU
# between hosts:
#   benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: Llama-3.1-8B, FSDP over 8 and over
#     128 H100, local batch 2, selective activation checkpointing, eager, torch.compile, and
#     torch.compile + Float8;
#   benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, vanilla TP column: Llama-3-70B on 256 H100,
#     FSDP 32 × TP 8, torch.compile, full activation checkpointing, local batch 16; Llama-3-8B on 64
#     H100, FSDP 8 × TP 8, torch.compile, per-op SAC, local batch 12; bf16 and float8 tensorwise.
# One ran on H200s at their datasheet figures: benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md,
# Llama-3.1-8B, FSDP over 32 and 64 H200, local batch 2, torch.compile + Float8 (fp8 all-gathers),
# the config's per-op SAC. (Async TP's rows are left out: the planner does not price its overlap;
# the Float8 rowwise rows too: the planner prices their bf16 gathers but their per-row casts as
# tensorwise's.) torchtitan's TP is
# sequence-parallel (its norms run on the sequence shard); its loss is compiled with the blocks. Like
# with like:
#   - Grand Teton's peak: the file says its 500 W HBM2e parts' dense peak lies between the H100
#     SXM's and the H100 NVL's and is not known. Each of those runs is predicted at both ends — the
#     SXM table's 989.4 TFLOP/s and the NVL's 835.5 (NVIDIA H100 datasheet, NVL column: 1,671
#     TFLOP/s bf16 with sparsity), fp8 twice each — and at their geometric middle, whose ratio is
#     the one quoted; with the file's 2.4 TB/s in place of the SXM's HBM3 3.35 TB/s;
#   - torchtitan's selective checkpointing as its default `selective_ac_option = "op"` runs it — the
#     outputs of matmuls, attention and reduce-scatters kept except every second matmul's, so about
#     half of each block's matmul forward and its elementwise ops run again, and under TP the
#     forward's all-gathers (not the reduce-scatters) — modelled as our selective recompute (norms,
#     rotary, SwiGLU and the gathers again) plus half the layers' matmul forward FLOPs at the
#     layout's compute rate (`titan_op_sac_s`); ours keeps the reduce-scatters' outputs as it does.
TITAN_HBM = 2.4e12
H100_PEAKS = (("SXM", 989.4e12), ("NVL", 835.5e12))
_8B_FSDP = dict(zero=3, micro_batch_size=2, grad_accum=1, seq_len=8192, recompute="selective")
_8B_TP8 = dict(dp=8, tp=8, sp=True, zero=3, micro_batch_size=12, grad_accum=1, seq_len=8192, recompute="selective",
               compile=True)
_70B_TP8 = dict(dp=32, tp=8, sp=True, zero=3, micro_batch_size=16, grad_accum=1, seq_len=8192, recompute="full",
                compile=True)
PUBLISHED = (  # name, preset, machine, layout, torchtitan's op-level SAC, tokens/s/GPU
    ("torchtitan 8B, FSDP 8 H100, eager", "llama3-8b", "grand-teton", Layout(dp=8, **_8B_FSDP), True, 5762.0),
    ("torchtitan 8B, FSDP 128 H100, eager", "llama3-8b", "grand-teton", Layout(dp=128, **_8B_FSDP), True, 5605.0),
    ("torchtitan 8B, FSDP 8 H100, compile", "llama3-8b", "grand-teton", Layout(dp=8, compile=True, **_8B_FSDP),
     True, 6667.0),
    ("torchtitan 8B, FSDP 128 H100, compile", "llama3-8b", "grand-teton", Layout(dp=128, compile=True, **_8B_FSDP),
     True, 6514.0),
    ("torchtitan 8B, FSDP 8 x TP 8, 64 H100, compile", "llama3-8b", "grand-teton", Layout(**_8B_TP8), True, 4378.0),
    ("torchtitan 70B, FSDP 32 x TP 8, 256 H100, compile", "llama3-70b", "grand-teton", Layout(**_70B_TP8), False,
     597.3),
)
PUBLISHED_FP8 = (  # the same with Float8 (tensorwise): the planner's fp8 matmul rate is not measured
    ("torchtitan 8B, FSDP 8 H100, compile+fp8", "llama3-8b", "grand-teton",
     Layout(dp=8, compile=True, precision="fp8", **_8B_FSDP), True, 8532.0),
    ("torchtitan 8B, FSDP 128 H100, compile+fp8", "llama3-8b", "grand-teton",
     Layout(dp=128, compile=True, precision="fp8", **_8B_FSDP), True, 8380.0),
    ("torchtitan 8B, FSDP 8 x TP 8, 64 H100, compile+fp8", "llama3-8b", "grand-teton",
     Layout(precision="fp8", **_8B_TP8), True, 5078.1),
    ("torchtitan 70B, FSDP 32 x TP 8, 256 H100, compile+fp8", "llama3-70b", "grand-teton",
     Layout(precision="fp8", **_70B_TP8), False, 809.8),
    ("trainy 8B, FSDP 32 H200, compile+fp8", "llama3-8b", "h200",
     Layout(dp=32, compile=True, precision="fp8", **_8B_FSDP), True, 10938.0),
    ("trainy 8B, FSDP 64 H200, compile+fp8", "llama3-8b", "h200",
     Layout(dp=64, compile=True, precision="fp8", **_8B_FSDP), True, 10753.0),
)


def ultratron(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "ultratron", *argv], check=True)


def measured_steps(cell_dir: Path) -> float | None:
    """The sweep's measured seconds per step (its median after the warm-up step), from result.json."""
    path = cell_dir / "result.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("step_seconds")


def predict_local(profile: dict, cell_dir: Path, dp: int | None = None) -> tuple[Layout, float, object]:
    """The planner's step time for a cell's config under the profile (`dp`: with that many data-parallel
    ranks instead, each keeping its share of the batch)."""
    from ultratron.config import load_config

    cfg = load_config(cell_dir / "config.toml")
    t = cfg.training
    layout = replace(cfg.layout, dp=dp or cfg.layout.dp)
    batch = t.batch_tokens * layout.dp // cfg.layout.dp
    acc = accelerator_of_profile(profile, 64.0)
    spec = SearchSpec(cfg.model, acc, layout.n_gpus, min(layout.n_gpus, profile["gpus_per_node"]), batch, t.seq_len,
                      t.precision, efficiency=1.0, network=network_of_profile(profile))
    est = estimate_step(spec, layout)
    return layout, est.step_s, est


def single_process(run_dir: Path, cells: list[Path], profile: dict) -> tuple:
    """One process (no collectives, no core shared with another rank) training one dp rank's share of
    dp4's batch, against the planner's step for it under the run's profile (its measured time is kept
    in single.json, so a later --reuse reads it back)."""
    saved = run_dir / "single.json"
    cell = next(c for c in cells if _matches(c, LOCAL["dp4"]))
    if not saved.is_file():
        import torch

        from ultratron.bench.comm import matmul_rate

        torch.set_num_threads(1)
        rate = matmul_rate(torch.device("cpu"), torch.float32, 1024, 10)
        run = run_dir / "single"
        shutil.rmtree(run, ignore_errors=True)  # a fresh run, not a resumed one
        ultratron("train", "--config", str(cell / "config.toml"), "--parallel.dp", "1", "--training.batch_tokens",
                  "2048", "--training.threads", "1", "--run.dir", str(run))
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        measured = sorted(r["step_time"] for r in steps[1:])[len(steps[1:]) // 2]
        saved.write_text(json.dumps({"measured": measured, "rate": rate}))
    data = json.loads(saved.read_text())
    _, predicted, est = predict_local(profile, cell, dp=1)
    return data["measured"], predicted, _describe(est) + f"; matmul alone before it {data['rate'] / 1e9:.1f} GFLOP/s"


def measure_run(run_dir: Path, steps: int) -> None:
    """One measurement: bench comm's profile, then the sweep of the six layouts, then one process alone."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ultratron("bench", "comm", "--nproc", "4", "--threads", "1", "--out", str(run_dir / "profile.json"),
              "--model", "tiny", "--seq", "256", "--micro-batch", "8")
    layouts = [a for words in LOCAL.values() for a in ("--layout", words)]
    ultratron("bench", "sweep", "--out", str(run_dir / "sweep"), "--model", "tiny", *layouts, "--gpus", "4", "--gpu",
              "cpu", "--steps", str(steps), "--", "--training.threads", "1")
    single_process(run_dir, sorted((run_dir / "sweep" / "cells").iterdir()), load_profile(run_dir / "profile.json"))


def local_rows(run_dir: Path) -> dict[str, tuple]:
    """{case: (measured, predicted, parts)} of one measured run, predicted by the current planner."""
    profile = load_profile(run_dir / "profile.json")
    cells = sorted((run_dir / "sweep" / "cells").iterdir())
    out = {}
    for name, words in LOCAL.items():
        cell = next((c for c in cells if _matches(c, words)), None)
        if cell is None:
            continue
        _, predicted, est = predict_local(profile, cell)
        out[f"local {name} (step s)"] = (measured_steps(cell), predicted, _describe(est))
    out["local dp1, one process alone (step s)"] = single_process(run_dir, cells, profile)
    note = profile_note(profile)
    if note:
        print(f"note ({run_dir}): {note}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="plan-vs-measured", help="work directory (profiles, sweeps)")
    parser.add_argument("--runs", type=int, default=1, help="measure this many times (profile + sweep each)")
    parser.add_argument("--reuse", nargs="*", default=[], help="earlier runs' directories to predict again")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-local", action="store_true", help="only the published runs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if not args.skip_local:
        run_dirs = [Path(d) for d in args.reuse]
        for i in range(args.runs if not args.reuse else 0):
            run_dirs.append(out / f"run-{i + 1}")
            measure_run(run_dirs[-1], args.steps)
        runs = [local_rows(d) for d in run_dirs]
        print(f"{'case (each run: measured / predicted = ratio)':52s} " + "  ".join(f"{'run ' + str(i + 1):>22s}"
                                                                                for i in range(len(runs)))
              + "  median ratio")
        for case in runs[0]:
            cells = [r.get(case) for r in runs]
            ratios = [c[1] / c[0] for c in cells if c and c[0] and c[1]]
            median = f"{statistics.median(ratios):10.2f}" if ratios else ""
            print(f"{case:52s} " + "  ".join(f"{c[0]:6.2f} / {c[1]:6.2f} = {c[1] / c[0]:4.2f}" if c and c[0] else
                                             f"{'—':>22s}" for c in cells) + f"  {median}")
            median_measured = statistics.median(c[0] for c in cells if c and c[0])
            median_predicted = statistics.median(c[1] for c in cells if c and c[1])
            rows.append((case, median_measured, median_predicted, cells[-1][2] if cells[-1] else ""))
        print()
    for name, model, machine, layout, op_sac, tokens_per_s in PUBLISHED + PUBLISHED_FP8:
        peaks = H100_PEAKS if machine == "grand-teton" else (("datasheet", None),)
        predicted = {label: predict_published(model, machine, layout, op_sac, peak)[0] for label, peak in peaks}
        middle = None if len(peaks) == 1 else (peaks[0][1] * peaks[1][1]) ** 0.5
        tokens, parts = predict_published(model, machine, layout, op_sac, middle)
        bounds = " / ".join(f"{label} peak {predicted[label] / tokens_per_s:.2f}" for label, _ in peaks)
        rows.append((f"{name} (tokens/s/GPU)", tokens_per_s, tokens, f"{bounds}; {parts}"))
    print(f"{'case (local: medians over runs)':58s} {'measured':>10s} {'predicted':>10s} {'pred/meas':>9s}  "
          "predicted parts (last run)")
    for name, measured, predicted, parts in rows:
        ratio = f"{predicted / measured:.2f}" if measured and predicted else "—"
        print(f"{name:58s} {measured or 0:>10.4g} {predicted or 0:>10.4g} {ratio:>9s}  {parts}")
    (out / "results.json").write_text(json.dumps([dict(zip(("case", "measured", "predicted", "parts"), r,
                                                           strict=True)) for r in rows], indent=1))


def predict_published(model: str, machine: str, layout: Layout, op_sac: bool,
                      peak: float | None) -> tuple[float, str]:
    """Tokens/s/GPU `estimate_step` predicts for a published run, and the step's parts: on Grand
    Teton's H100s at a dense bf16 `peak` (fp8 twice it) and their file's HBM bandwidth, on H200s at
    the table's figures (the notes above `PUBLISHED`)."""
    if machine == "grand-teton":
        h100 = get_accelerator("h100-sxm")
        acc = replace(h100, memory_bw=TITAN_HBM, flops={**h100.flops, "bf16": peak, "fp8": 2 * peak})
    else:
        acc = get_accelerator(machine)
    spec = SearchSpec(PRESETS[model], acc, layout.n_gpus, 8,
                      layout.dp * layout.micro_batch_size * layout.grad_accum * layout.seq_len, layout.seq_len,
                      precision=layout.precision)
    est = estimate_step(spec, layout)
    extra = titan_op_sac_s(spec, est) if op_sac else 0.0
    parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in _parts(est).items() if v > 0.01 * est.step_s)
    if extra:
        parts += f", op-SAC's recompute {extra * 1e3:.0f} ms"
    return spec.global_batch_tokens / (est.step_s + extra) / spec.n_gpus, parts


def titan_op_sac_s(spec: SearchSpec, est) -> float:
    """How torchtitan's op-level selective checkpointing differs from ours in time: it recomputes half
    of the layers' matmul forward FLOPs (every second matmul), at the layout's modelled compute rate.
    Under tensor parallel both keep the reduce-scatters' outputs (ours: `parallel/recompute.py`, so
    `planning.comm` counts none again) and run the forward's all-gathers again: no difference there."""
    from ultratron.planning.compute import layer_matmuls

    lay = est.layout
    tokens = lay.micro_batch_size * lay.seq_len / lay.cp
    per_micro = sum(2 * m * k * n * c for m, k, n, c in layer_matmuls(spec.shape, tokens, lay.tp, lay.ep))
    flops = 0.5 * per_micro * spec.shape.n_layers / lay.pp * lay.grad_accum
    return flops / (est.efficiency * spec.accelerator.flops[spec.precision])


def _matches(cell: Path, words: str) -> bool:
    from ultratron.config import load_config

    path = cell / "config.toml"
    if not path.is_file():
        return False
    cfg = load_config(path)
    want = dict(w.split("=", 1) for w in words.split())
    have = {"dp": cfg.parallel.dp, "tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "zero": cfg.parallel.zero,
            "pp_schedule": cfg.parallel.pp_schedule, "parallel.cp": cfg.parallel.cp,
            "mbs": cfg.training.micro_batch_size}
    defaults = {"tp": "1", "pp": "1", "zero": "0", "parallel.cp": "1"}
    return all(str(have[k]) == want.get(k, defaults.get(k, str(have[k]))) for k in have)


def _describe(est) -> str:
    parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in _parts(est).items() if v > 0.01 * est.step_s)
    return parts + f"; cores shared ×{est.core_share:.1f}"


def _parts(est) -> dict[str, float]:
    from ultratron.planning.reasons import step_terms

    return step_terms(est)


if __name__ == "__main__":
    main()
