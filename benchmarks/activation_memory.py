"""Activation memory under tensor and sequence parallelism, measured beside `plan memory`.

  python benchmarks/activation_memory.py [--cpu-only | --simulate-only | --shard-options] [--tp 1,2,4,8]

CPU shape (fp32, gloo processes, `tests/distributed/dist_jobs.measure_step_memory`): the bytes one
transformer block keeps for backward at tp 1/2/4/8, with and without sequence parallel, with and
without selective recomputation, beside the planner's per-layer figure (`planning.activations`)
and, with sequence parallel, the ratio to one process's divided by tp.

`ultratron simulate` (fake tensors, one CPU process per simulated rank): Llama-3 8B, seq 4096,
micro-batch 1, bf16, ZeRO-3, no recomputation, dp8 × tp (sequence parallel when tp > 1): each
rank's measured peak beside `plan memory`'s, and the activations at the peak against tp1's / tp.
Llama-3 8B has 8 kv heads and tensor parallelism splits them, so tp 16 and 32 run it with
n_kv_heads = n_heads = 32 (labelled "kv 32"), beside a tp1 run of that model as their base.

`--shard-options` (CPU shape, tp+sp, tp 2 and 4 unless --tp says): the ways to keep only the sequence
shard of the column-parallel layers' input side by side (`keep_shard_options.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))

GIB = 2**30
CPU_SHAPE = ["--model.preset", "tiny", "--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "8",
             "--model.n_kv_heads", "8", "--model.ffn_dim", "128", "--model.vocab_size", "512",
             "--training.seq_len", "128", "--training.micro_batch_size", "4", "--training.batch_tokens", "4096",
             "--training.progress", "false", "--training.sample_tokens", "0", "--run.tensorboard", "false",
             "--training.precision", "fp32"]


def _cpu_layouts(tp: int) -> dict[str, list[str]]:
    base = ["--parallel.tp", str(tp)] if tp > 1 else ["--parallel.dp", "1"]
    out = {}
    for sp in ((False, True) if tp > 1 else (False,)):
        for recompute in ("none", "selective"):
            name = f"tp{tp}{'+sp' if sp else ''}{' selective' if recompute == 'selective' else ''}"
            out[name] = base + (["--parallel.sp", "true"] if sp else []) + ["--training.recompute", recompute]
    return out


def _planned_layer(flags: list[str]) -> float:
    from ultratron.config import load_config
    from ultratron.planning.activations import layer_activation_bytes

    cfg = load_config(None, flags)
    return layer_activation_bytes(cfg.model, cfg.layout)


def cpu_shape(tps: list[int], cache: str) -> None:
    from dist_jobs import measure_step_memory

    from ultratron.launch.local import run_local

    print(f"{'CPU shape, one block':28} {'measured KiB':>12} {'planned KiB':>11} {'measured/planned':>16} "
          f"{'× tp / tp1':>10}")
    one_process = {}
    for tp in tps:
        layouts = _cpu_layouts(tp)
        flags = CPU_SHAPE + ["--data.cache_dir", cache]
        with tempfile.TemporaryDirectory() as out:
            run_local(tp, measure_step_memory, flags, list(layouts.values()), out)
            measured = json.loads(Path(out, "rank0.json").read_text())
        for (name, layout), got in zip(layouts.items(), measured, strict=True):
            layer, planned = got["layer"], _planned_layer(flags + layout)
            selective = "selective" in name
            if tp == 1:
                one_process[selective] = layer
            scaled = layer * tp / one_process[selective] if selective in one_process else float("nan")
            print(f"{name:28} {layer / 1024:12.1f} {planned / 1024:11.1f} {layer / planned:16.3f} {scaled:10.3f}")
        sys.stdout.flush()


def _simulate_flags(tp: int, kv32: bool) -> tuple[str, list[str]]:
    seq = 4096
    flags = ["--model.preset", "llama3-8b", "--training.seq_len", str(seq), "--model.max_seq_len", str(seq),
             "--training.micro_batch_size", "1", "--training.batch_tokens", str(seq * 8),
             "--training.precision", "bf16", "--parallel.dp", "8", "--parallel.tp", str(tp), "--parallel.zero", "3",
             "--training.recompute", "none"]
    if tp > 1:
        flags += ["--parallel.sp", "true"]
    layout = f"dp8×tp{tp}" + ("+sp" if tp > 1 else "")
    if kv32:  # 8 kv heads: tp beyond 8 needs more kv heads
        return f"8B (kv 32) {layout}", flags + ["--model.n_kv_heads", "32"]
    return f"8B {layout}", flags


def simulated(tps: list[int]) -> None:
    """Each tp's row, and before the first row of a model (8 or 32 kv heads) its tp1 row, the base of
    the last column: a tp 16 or 32 row is compared with one process of the same model."""
    from ultratron.simulate.run import simulate

    print(f"{'simulate, Llama-3 8B seq 4096':30} {'peak GiB':>8} {'plan GiB':>8} {'plan/peak':>9} "
          f"{'activations GiB':>15} {'plan act. GiB':>13} {'act. × tp / tp1':>15} {'wall s':>6}")
    tp1_activations = {}
    for tp in tps:
        kv32 = tp > 8
        for each in ([1] if kv32 not in tp1_activations and tp != 1 else []) + [tp]:
            name, flags = _simulate_flags(each, kv32)
            result = simulate(None, flags)
            rank = result["ranks"][0]
            activations = rank["tracker"].get("activations", 0)
            if each == 1:
                tp1_activations[kv32] = activations
            print(f"{name:30} {rank['peak_bytes'] / GIB:8.2f} {rank['planned_peak_bytes'] / GIB:8.2f} "
                  f"{rank['planned_peak_bytes'] / rank['peak_bytes']:9.3f} {activations / GIB:15.2f} "
                  f"{rank['planned']['activations'] / GIB:13.2f} {activations * each / tp1_activations[kv32]:15.3f} "
                  f"{result['wall_s']:6.0f}")
            print("    measured split (GiB):", {k: round(v / GIB, 2) for k, v in rank["tracker"].items()},
                  "\n    planned (GiB):", {k: round(v / GIB, 2) for k, v in rank["planned"].items()},
                  f"\n    host RSS of the rank's process: {rank['host_rss_bytes'] / GIB:.2f} GiB")
            sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--simulate-only", action="store_true")
    parser.add_argument("--shard-options", action="store_true")
    parser.add_argument("--tp", help="comma list (CPU: of 1, 2, 4, 8; simulate: of 1, 2, 4, 8, 16, 32)")
    args = parser.parse_args()
    chosen = [int(x) for x in args.tp.split(",")] if args.tp else None
    if args.shard_options:
        from keep_shard_options import compare

        with tempfile.TemporaryDirectory() as cache:
            compare(chosen or [2, 4], CPU_SHAPE + ["--data.cache_dir", cache])
        return 0
    if not args.simulate_only:
        with tempfile.TemporaryDirectory() as cache:
            cpu_shape(chosen or [1, 2, 4, 8], cache)
    if not args.cpu_only:
        simulated(chosen or [1, 2, 4, 8, 16, 32])
    return 0


if __name__ == "__main__":
    sys.exit(main())
