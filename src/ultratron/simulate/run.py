"""Simulate the ranks of a layout, one child process each, and put them next to the planner.

A process joins one process group in its life, so each simulated rank is a child process
(`python -m ultratron.simulate.rank`), run one after another in pipeline order (a later pipeline
stage reads the activation shapes an earlier one wrote, see `rank.py`). For each rank: the
measured peak bytes and its split, the planner's peak for the same layout (`plan memory`'s
`estimate_memory_per_rank`, for the rank's pipeline position), the FLOPs counted and the
planner's (`planning.flops`), the bytes per collective type; for all of them together the
collective check (`collectives.first_mismatch`).

The planner is asked about the layout as it was simulated: on a CPU, bf16 attention runs in
fp32 (`Layout.attention_fp32`), which the trainer decides from the device.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ultratron.config import load_config
from ultratron.errors import UserError
from ultratron.planning.compute import loss_recompute_flops
from ultratron.planning.flops import stage_flops_per_token
from ultratron.planning.memory import estimate_memory_per_rank, pipeline_ranks
from ultratron.planning.params import count_params_of
from ultratron.simulate.collectives import first_mismatch
from ultratron.simulate.roles import coordinates, parse_ranks, role_ranks

# What the meta build's bookkeeping takes: shapes only, but one Python object per tensor and
# int64 element counts; a model whose parameters or one tensor pass these is a typo, not a model.
MAX_PARAMS = 10**15
MAX_TENSOR_ELEMENTS = 2**62


def planned_layout(cfg):
    """The layout the planner prices for a simulation: the run's, as a CPU runs it."""
    return replace(cfg.layout, attention_fp32=cfg.layout.precision == "bf16")


def _check(cfg) -> None:
    counts = count_params_of(cfg.model)
    biggest = max(cfg.model.vocab_size * cfg.model.dim, cfg.model.dim * max(cfg.model.ffn_dim, cfg.model.dim))
    if counts.total > MAX_PARAMS or biggest > MAX_TENSOR_ELEMENTS:
        raise UserError(f"model too large to simulate: {counts.total:.3g} parameters (at most {MAX_PARAMS:.0e}), "
                        f"largest tensor {biggest:.3g} elements; check model.dim, ffn_dim, vocab_size, n_layers")


def select(cfg, ranks: str = "roles") -> dict[int, str]:
    """rank → its role, in the order the ranks run (pipeline order)."""
    layout = cfg.layout
    world = layout.n_gpus
    roles = [(where.name, tuple(where.layers)) for where in pipeline_ranks(cfg.model, layout)]
    chosen = parse_ranks(ranks, world)
    if chosen is None:
        picked = role_ranks(layout, roles)
    else:
        picked = {}
        for rank in chosen:
            pp = coordinates(layout, rank).pp
            picked[rank] = roles[pp][0] if layout.pp > 1 else "every rank"
        # a later stage reads the activation shapes that the first stage's rank writes
        if layout.pp > 1 and all(coordinates(layout, r).pp > 0 for r in picked):
            picked[0] = roles[0][0] + " (for the pipeline's shapes)"
    return dict(sorted(picked.items(), key=lambda item: (coordinates(layout, item[0]).pp, item[0])))


def run_rank(config: str | None, overrides: list[str], rank: int, meta_dir: str, plant: dict | None = None,
             timeout: float | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="ultratron-simulate-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({"config": config, "overrides": overrides, "rank": rank, "meta_dir": meta_dir,
                                       "plant": plant}))
        proc = subprocess.run([sys.executable, "-m", "ultratron.simulate.rank", str(request), str(result)],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not result.exists():
            tail = [line for line in proc.stderr.splitlines() if line.strip()][-12:]
            raise RuntimeError(f"simulating rank {rank} failed (exit {proc.returncode}):\n" + "\n".join(tail))
        return json.loads(result.read_text())


def simulate(config: str | None, overrides: list[str], ranks: str = "roles", plants: dict[int, dict] | None = None,
             echo=None) -> dict:
    """Simulate the selected ranks; the result `ultratron simulate --json` prints."""
    cfg = load_config(config, overrides)
    _check(cfg)
    layout = cfg.layout
    planned_per_pp = estimate_memory_per_rank(cfg.model, planned_layout(cfg))
    where_per_pp = pipeline_ranks(cfg.model, layout)
    t = cfg.training
    tokens = t.micro_batch_size * t.seq_len * cfg.grad_accum_steps  # per data-parallel rank and step
    picked = select(cfg, ranks)
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="ultratron-simulate-meta-") as meta_dir:
        for rank, role in picked.items():
            c = coordinates(layout, rank)
            if echo:
                echo(f"rank {rank} ({role}; {c.describe()}) ...")
            got = run_rank(config, overrides, rank, meta_dir, (plants or {}).get(rank))
            planned = planned_per_pp[c.pp]
            where = where_per_pp[c.pp]
            flops = sum(stage_flops_per_token(cfg.model, t.seq_len, layers, last=where.last and s == where.stages[-1])
                        for s, layers in zip(where.stages, where.layers, strict=True))
            flops += loss_recompute_flops(cfg.model, layout) if where.last else 0.0  # (the chunked loss's)
            planned_flops = flops * tokens / (layout.tp * layout.cp)
            results.append({**got, "role": role, "coordinates": c.describe(), "pp_rank": c.pp,
                            "planned_peak_bytes": planned.peak_bytes,
                            "planned_offloaded_bytes": planned.host_activations,
                            "planned": {term: getattr(planned, term) for term in planned.TERMS},
                            "peak_ratio": got["peak_bytes"] / planned.peak_bytes if planned.peak_bytes else None,
                            # from meta to the first step: materialize and initialize (planning/start.py)
                            "planned_start_bytes": planned.start_init_bytes,
                            "planned_load_bytes": planned.start_load_bytes,
                            "start_ratio": got["start_peak_bytes"] / planned.start_init_bytes,
                            "planned_flops": planned_flops,
                            "flops_ratio": got["flops"] / planned_flops if planned_flops else None})
    records = {r["rank"]: r["collectives"] for r in results}
    mismatch = first_mismatch(records)
    return {"layout": layout.describe(), "world_size": layout.n_gpus, "model_params": count_params_of(cfg.model).total,
            "tokens_per_rank_step": tokens, "ranks": results, "collective_check": mismatch or "ok",
            "ranks_compared": sorted(records), "wall_s": time.perf_counter() - started}
