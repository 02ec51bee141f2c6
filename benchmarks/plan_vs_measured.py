"""Predicted vs measured step time: `plan estimate`'s cost model against `ultratron train` on this
machine, and against published runs whose layout is fully known.

  python benchmarks/plan_vs_measured.py [--out DIR] [--profile FILE] [--steps 6] [--skip-local]

Local part: `ultratron bench comm --nproc 4` measures this machine's collectives (gloo) and one
rank's matmul rate while all four multiply (or --profile reuses a profile); `ultratron bench sweep`
trains the tiny model for --steps steps on 4 gloo processes in six layouts (dp4, dp2×tp2, dp2×pp2
1F1B and GPipe, cp2×dp2, ZeRO-3 dp4); each measured median step time is set beside
`planning.search.estimate_step` under that profile (the planner's one function, no constant fitted
per layout). Published part: the runs in `PUBLISHED`, each predicted on the GPU table's figures.
Prints a table of predicted / measured for each; the docs quote the figures (docs/planning.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from ultratron.models.presets import PRESETS
from ultratron.planning.flops import flops_per_token_of
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

# Published runs whose layout is fully known (bf16, no fp8): torchtitan's own benchmark file
# benchmarks/llama3_h100_202412_torchtitan.md (Llama 3.1 8B, Tables 1 and 3: FSDP over 8 and 128
# H100 — Grand Teton, 96 GB HBM2e at 500 W, 400 Gb/s per GPU — local batch 2, seq 8192, selective
# activation checkpointing, eager; TPS/GPU at the 90th step).
PUBLISHED = (
    ("torchtitan Llama-3.1-8B, FSDP 8 H100, eager", "llama3-8b", "h100-sxm",
     Layout(dp=8, zero=3, micro_batch_size=2, grad_accum=1, seq_len=8192, recompute="selective"), 5762.0),
    ("torchtitan Llama-3.1-8B, FSDP 128 H100, eager", "llama3-8b", "h100-sxm",
     Layout(dp=128, zero=3, micro_batch_size=2, grad_accum=1, seq_len=8192, recompute="selective"), 5605.0),
)


def ultratron(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "ultratron", *argv], check=True)


def measured_steps(cell_dir: Path) -> float | None:
    """The sweep's measured seconds per step (its median after the warm-up step), from result.json."""
    path = cell_dir / "result.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("step_seconds")


def predict_local(profile: dict, cell_dir: Path) -> tuple[Layout, float, object]:
    from ultratron.config import load_config

    cfg = load_config(cell_dir / "config.toml")
    t = cfg.training
    acc = accelerator_of_profile(profile, 64.0)
    spec = SearchSpec(cfg.model, acc, cfg.layout.n_gpus, profile["gpus_per_node"], t.batch_tokens, t.seq_len,
                      t.precision, efficiency=1.0, network=network_of_profile(profile))
    est = estimate_step(spec, replace(cfg.layout))
    return cfg.layout, est.step_s, est


def single_process(out: Path, sweep: Path, cells: list[Path]) -> tuple:
    """The compute term alone: one process (no collectives, no core shared with another rank) training
    one dp rank's share of dp4's batch, against the planner at the matmul rate measured alone."""
    import torch

    from ultratron.bench.comm import matmul_rate
    from ultratron.config import load_config

    torch.set_num_threads(1)
    rate = matmul_rate(torch.device("cpu"), torch.float32, 1024, 5)
    cell = next(c for c in cells if _matches(c, LOCAL["dp4"]))
    run = out / "single"
    shutil.rmtree(run, ignore_errors=True)  # a fresh run, not a resumed one
    ultratron("train", "--config", str(cell / "config.toml"), "--parallel.dp", "1", "--training.batch_tokens", "2048",
              "--training.threads", "1", "--run.dir", str(run))
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = sorted(r["step_time"] for r in steps[1:])[len(steps[1:]) // 2]
    cfg = load_config(cell / "config.toml")
    flops = 2048 * flops_per_token_of(cfg.model, cfg.training.seq_len)
    return ("local dp1, one process alone (step s)", measured, flops / rate,
            f"compute at the matmul rate measured alone, {rate / 1e9:.1f} GFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="plan-vs-measured", help="work directory (profile, sweep)")
    parser.add_argument("--profile", help="a profile from `ultratron bench comm` (default: measure one)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-local", action="store_true", help="only the published runs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if not args.skip_local:
        profile_path = args.profile or str(out / "profile.json")
        if not args.profile:
            ultratron("bench", "comm", "--nproc", "4", "--threads", "1", "--out", profile_path)
        profile = load_profile(profile_path)
        sweep = out / "sweep"
        layouts = [a for words in LOCAL.values() for a in ("--layout", words)]
        ultratron("bench", "sweep", "--out", str(sweep), "--model", "tiny", *layouts, "--gpus", "4", "--gpu", "cpu",
                  "--steps", str(args.steps), "--", "--training.threads", "1")
        cells = sorted((sweep / "cells").iterdir())
        for name, words in LOCAL.items():
            cell = next((c for c in cells if _matches(c, words)), None)
            if cell is None:
                rows.append((f"local {name}", None, None, "cell not found"))
                continue
            layout, predicted, est = predict_local(profile, cell)
            measured = measured_steps(cell)
            parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in _parts(est).items() if v > 0.01 * est.step_s)
            rows.append((f"local {name} (step s)", measured, predicted, parts))
        rows.append(single_process(out, sweep, cells))
        note = profile_note(profile)
        if note:
            print(f"note: {note}")
    for name, model, gpu, layout, tokens_per_s in PUBLISHED:
        spec = SearchSpec(PRESETS[model], get_accelerator(gpu), layout.n_gpus, 8,
                          layout.dp * layout.micro_batch_size * layout.grad_accum * layout.seq_len, layout.seq_len)
        est = estimate_step(spec, layout)
        parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in _parts(est).items() if v > 0.01 * est.step_s)
        rows.append((f"{name} (tokens/s/GPU)", tokens_per_s, est.tokens_per_s_per_gpu, parts))
    print(f"{'case':58s} {'measured':>10s} {'predicted':>10s} {'pred/meas':>9s}  predicted parts")
    for name, measured, predicted, parts in rows:
        ratio = f"{predicted / measured:.2f}" if measured and predicted else "—"
        print(f"{name:58s} {measured or 0:>10.4g} {predicted or 0:>10.4g} {ratio:>9s}  {parts}")
    (out / "results.json").write_text(json.dumps([dict(zip(("case", "measured", "predicted", "parts"), r,
                                                           strict=True)) for r in rows], indent=1))


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


def _parts(est) -> dict[str, float]:
    from ultratron.planning.search import step_terms

    return step_terms(est)


if __name__ == "__main__":
    main()
