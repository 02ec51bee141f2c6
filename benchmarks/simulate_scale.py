"""`ultratron simulate` at scale: for each layout, the measured peak per role next to `plan
memory`'s, their ratio, FLOPs against the planner's formula, and the simulation's own wall time and
host memory (the largest child's peak RSS).

  python benchmarks/simulate_scale.py [--only NAME[,NAME...]] [--ranks roles|LIST] [--list] [--json OUT.json]

The layouts are the issue's: Llama-3 8B at 8, 64 and 256 ranks (ZeRO 1 and 3, tp + sp, pp),
70B at 512 and 1,024 ranks (tp8 × pp × dp), 405B at 2,048, a DeepSeek-V3-like mixture of experts
with ep 8–64, and cp for 128k-token sequences. The mixture of experts is the `deepseek-v3-like`
preset: DeepSeek-V3's 256 routed experts (top-8), shared expert, dense first layers, sigmoid router
and vocabulary, but grouped-query attention in place of its multi-head latent attention, which
ultratron does not have; its routing is balanced by assumption (docs/simulate.md). Every run is
the default role selection (one rank per distinct pipeline role) unless `--ranks` picks ranks
(`--ranks 0`: the first stage only, when every role takes too long). A layout that cannot be simulated
is reported as an error line, not skipped silently.
Sequence lengths are 8192 (4096 for the mixture of experts, its pretraining length; 128k for cp),
one micro-batch per rank and step unless the pipeline needs more (grad_accum = 2·pp).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ultratron.errors import UserError
from ultratron.simulate.run import simulate


def _layout(model: str, seq: int, dp: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, zero: int = 3,
            extra: tuple = ()) -> list[str]:
    ga = 2 * pp if pp > 1 else 1
    flags = ["--model.preset", model, "--training.seq_len", str(seq), "--training.micro_batch_size", "1",
             "--training.batch_tokens", str(seq * dp * ga), "--training.precision", "bf16",
             "--parallel.dp", str(dp), "--parallel.tp", str(tp), "--parallel.pp", str(pp), "--parallel.cp", str(cp),
             "--parallel.ep", str(ep), "--parallel.zero", str(zero), "--model.max_seq_len", str(seq)]
    if tp > 1:
        flags += ["--parallel.sp", "true"]
    return flags + list(extra)


LAYOUTS: dict[str, list[str]] = {
    "8b-8-zero3": _layout("llama3-8b", 8192, dp=8),
    "8b-8-zero1": _layout("llama3-8b", 8192, dp=8, zero=1),  # DDP + ZeroRedundancyOptimizer
    "8b-8-zero1-tp2": _layout("llama3-8b", 8192, dp=4, tp=2, zero=1),
    "8b-8-tp8": _layout("llama3-8b", 8192, dp=1, tp=8, zero=1),
    "8b-64-zero3": _layout("llama3-8b", 8192, dp=64),
    "8b-64-zero1": _layout("llama3-8b", 8192, dp=64, zero=1),  # DDP + ZeroRedundancyOptimizer
    "8b-64-zero1-tp8": _layout("llama3-8b", 8192, dp=8, tp=8, zero=1),
    "8b-64-tp8-pp2": _layout("llama3-8b", 8192, dp=4, tp=8, pp=2, zero=1),
    "8b-64-tp4-pp4": _layout("llama3-8b", 8192, dp=4, tp=4, pp=4, zero=1),
    "8b-256-zero3": _layout("llama3-8b", 8192, dp=256),
    "8b-256-tp8-pp4": _layout("llama3-8b", 8192, dp=8, tp=8, pp=4, zero=1),
    "70b-512-tp8-pp8": _layout("llama3-70b", 8192, dp=8, tp=8, pp=8, zero=1),
    "70b-512-tp8-pp4-zero3": _layout("llama3-70b", 8192, dp=16, tp=8, pp=4, zero=3),
    "70b-1024-tp8-pp8": _layout("llama3-70b", 8192, dp=16, tp=8, pp=8, zero=1),
    "70b-1024-tp8-pp16": _layout("llama3-70b", 8192, dp=8, tp=8, pp=16, zero=1),
    "405b-2048-tp8-pp16": _layout("llama3-405b", 8192, dp=16, tp=8, pp=16, zero=1),
    "dsv3-64-ep8": _layout("deepseek-v3-like", 4096, dp=8, tp=1, pp=8, ep=8, zero=1),
    "dsv3-256-ep32": _layout("deepseek-v3-like", 4096, dp=32, tp=1, pp=8, ep=32, zero=1),
    "dsv3-512-ep64": _layout("deepseek-v3-like", 4096, dp=64, tp=1, pp=8, ep=64, zero=1),
    "8b-128k-cp8": _layout("llama3-8b", 131072, dp=1, tp=8, cp=8, zero=3),
    "8b-128k-cp16-tp8": _layout("llama3-8b", 131072, dp=2, tp=8, cp=16, zero=3),
    "70b-128k-cp16-tp8-pp4": _layout("llama3-70b", 131072, dp=1, tp=8, pp=4, cp=16, zero=1),
    "dsv3-128k-cp8-ep8": _layout("deepseek-v3-like", 131072, dp=8, tp=1, pp=8, cp=8, ep=8, zero=1),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma list of layout names")
    parser.add_argument("--ranks", default="roles", help="roles (one rank per pipeline role), or a comma list")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(LAYOUTS)
    if args.list:
        print("\n".join(f"{n}: {' '.join(LAYOUTS[n])}" for n in names))
        return 0
    out = {}
    print(f"{'layout':24} {'rank':>5} {'role':>14} {'measured GiB':>12} {'planned GiB':>11} {'ratio':>6} "
          f"{'FLOPs ratio':>11} {'wall s':>7} {'host GiB':>8}")
    for name in names:
        started = time.perf_counter()
        try:
            result = simulate(None, LAYOUTS[name], args.ranks)
        except UserError as err:
            print(f"{name:24} error: {'; '.join(err.problems)}")
            out[name] = {"error": err.problems}
            continue
        except RuntimeError as err:
            print(f"{name:24} failed: {str(err).splitlines()[-1]}")
            out[name] = {"failed": str(err)}
            continue
        for r in result["ranks"]:
            print(f"{name:24} {r['rank']:>5} {r['role'][:14]:>14} {r['peak_bytes'] / 2**30:12.2f} "
                  f"{r['planned_peak_bytes'] / 2**30:11.2f} {r['peak_ratio']:6.3f} {r['flops_ratio']:11.4f} "
                  f"{r['wall_s']:7.1f} {r['host_rss_bytes'] / 2**30:8.2f}")
        print(f"{name:24} total {time.perf_counter() - started:.1f} s; collectives: {result['collective_check']}")
        sys.stdout.flush()
        out[name] = {k: v for k, v in result.items() if k != "ranks"} | {
            "ranks": [{k: v for k, v in r.items() if k != "collectives"} for r in result["ranks"]]}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
