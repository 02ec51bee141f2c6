"""Rehearse a launch on this CPU: run the real training step of ranks of the layout, one at a time.

  ultratron simulate --config run.toml [--section.field VALUE ...] [--ranks roles|all|LIST] [--json]
  ultratron simulate --model.preset tiny --parallel.dp 2 --parallel.tp 2 --parallel.pp 2 --parallel.zero 3

The world size is the layout's product (parallel.dp × tp × pp × cp). Each simulated rank builds the
model on the meta device, applies the real `parallelize` and runs the real step — forward and
backward over every micro-batch (through the pipeline schedule), gradient clipping, the optimizer
step — on torch's fake process group and fake tensors: shapes, sharding and every allocation are
real, values are not computed, no collective moves data. A second step is the one measured.

Per rank it prints the measured peak bytes (torch's MemTracker) next to `ultratron plan memory`'s
for the same layout, the FLOPs it computes next to the planner's, and the bytes it hands to each
kind of collective. Every rank's collectives are recorded in order (op, group, shape, dtype); within
each process group the simulated members must issue the same sequence, and every send must meet
its receive. The first mismatch is one line naming the ranks, the call and both sides: exit 1.

--ranks roles (default): one rank per distinct pipeline role (first, middle, last stage; within a
stage the dp, cp, tp and ep ranks are symmetric). --ranks all: every rank (the full collective
check). --ranks 0,5,8-11: those. Bad input (a layout the model cannot take, a model too large):
one `error:` line, exit 2. What it cannot see: docs/simulate.md (no timing, no NCCL buffers, ...).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ultratron.config import Config
    from ultratron.config.loader import describe_fields

    parser.add_argument("--config", help="a TOML config file; --section.field flags override it")
    parser.add_argument("--ranks", default="roles",
                        help="roles (default: one rank per distinct role), all, or a list such as 0,5,8-11")
    parser.add_argument("--json", action="store_true",
                        help="print JSON: per rank peak_bytes (measured), planned_peak_bytes, start_peak_bytes "
                             "(measured from meta to the first step), planned_start_bytes, flops, planned_flops, "
                             "bytes_by_op, collectives; and collective_check")
    parser.epilog = "config fields (default):\n" + describe_fields(Config)
    parser.set_defaults(_accepts_overrides=True)


def run(args) -> int:
    from ultratron.simulate.run import simulate

    result = simulate(args.config, args.overrides, args.ranks,
                      echo=None if args.json else (lambda line: print(line, file=sys.stderr, flush=True)))
    mismatch = result["collective_check"] != "ok"
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print(result)
    return 1 if mismatch else 0


def _print(result: dict) -> None:
    from ultratron.cli.plan_output import human, table

    gib = lambda value: f"{value / 2**30:.3g}"  # noqa: E731  (three digits: a tiny model's MiB still show)

    print(f"{result['layout']}: {result['world_size']} ranks, {human(result['model_params'])} parameters; "
          f"simulated {len(result['ranks'])} rank(s) in {result['wall_s']:.1f} s")
    header = ["rank", "role", "peak GiB", "planned GiB", "ratio", "params", "grads", "optim", "act+temp",
              "TFLOP", "planned", "ratio", "wall s", "host GiB"]
    rows = []
    for r in result["ranks"]:
        m = r["memory"]
        rows.append([str(r["rank"]), r["role"], gib(r["peak_bytes"]), gib(r["planned_peak_bytes"]),
                     f"{r['peak_ratio']:.3f}", gib(m["parameters"]), gib(m["gradients"]), gib(m["optimizer_states"]),
                     gib(m["activations_and_temporaries"]), f"{r['flops'] / 1e12:.4g}",
                     f"{r['planned_flops'] / 1e12:.4g}", f"{r['flops_ratio']:.3f}", f"{r['wall_s']:.1f}",
                     gib(r["host_rss_bytes"])])
    print(table(header, rows))
    for r in result["ranks"]:
        print(f"rank {r['rank']}: start (meta → parallelize → materialize → initialize): {gib(r['start_peak_bytes'])} "
              f"GiB, planned {gib(r['planned_start_bytes'])} (ratio {r['start_ratio']:.3f}); a start from a "
              f"checkpoint is planned at {gib(r['planned_load_bytes'])} GiB")
    for r in result["ranks"]:
        sent = ", ".join(f"{op} {human(b, 'B')}" for op, b in r["bytes_by_op"].items())
        print(f"rank {r['rank']}: {len(r['collectives'])} collectives: {sent}")
        if r.get("moved_bytes"):
            print(f"rank {r['rank']}: offload: {gib(r['offloaded_bytes'])} GiB on the host at most (planned "
                  f"{gib(r['planned_offloaded_bytes'])}), {gib(r['moved_bytes'])} GiB moved in the step")
    if result["collective_check"] == "ok" and len(result["ranks_compared"]) < 2:
        print("collectives: recorded for one rank, nothing to compare it with (--ranks all compares every rank)")
    elif result["collective_check"] == "ok":
        print(f"collectives: ranks {', '.join(map(str, result['ranks_compared']))} agree "
              "(same sequence within each process group; every send meets its receive)")
    else:
        print(result["collective_check"])
