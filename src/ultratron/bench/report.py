"""A sweep's results beside the planner's predictions: sweep.csv, sweep.md and sweep.png.

Each cell's prediction is `planning.search.estimate_step` — what `plan estimate` prints — for the
cell's own config (layout, micro-batches, precision; attention in fp32 for bf16 on a CPU, as the
trainer runs it) on the sweep's GPU type. A CPU has no datasheet: its peak is the matmul rate the
trainer measured (read back from the cell's MFU), and links between its processes are assumed at
CPU_LINK_BYTES_PER_S. The error is measured / predicted − 1. Peak memory is compared only where
the trainer measured torch's allocator peak (a GPU); on a CPU the process's resident set is shown,
which also holds Python, torch and the allocator's caches, and gets no error.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import replace
from pathlib import Path

from ultratron import atomic
from ultratron.bench.cells import Cell
from ultratron.bench.run import Sweep, read_result
from ultratron.planning.hardware import Accelerator, get_accelerator

# Assumed, not measured: gloo between processes of one machine (loopback TCP), per direction.
CPU_LINK_BYTES_PER_S = 2e9
COLUMNS = ["name", "model", "source", "world", "dp", "tp", "pp", "zero", "sp", "mbs", "recompute", "status",
           "cause", "steps", "tokens_per_sec_per_gpu", "predicted_tokens_per_sec_per_gpu", "tokens_error", "mfu",
           "predicted_mfu", "mfu_error", "step_seconds", "predicted_step_seconds", "peak_memory_bytes",
           "memory_measured_as", "predicted_peak_bytes", "memory_error"]


def _accelerator(gpu: str, result: dict, flops_per_token: float) -> Accelerator | None:
    if gpu != "cpu":
        return get_accelerator(gpu)
    if not result.get("mfu") or not result.get("tokens_per_sec_per_gpu"):
        return None  # no measured CPU peak to predict against
    peak = result["tokens_per_sec_per_gpu"] * flops_per_token / result["mfu"]
    # attention at the matmul rate: the table of measured attention rates is an H200's (planning.compute)
    return Accelerator("CPU (measured matmul peak)", {"fp32": peak, "bf16": peak}, 0.0, CPU_LINK_BYTES_PER_S,
                       CPU_LINK_BYTES_PER_S, os.cpu_count() or 1, "the trainer's measured CPU matmul rate",
                       attention_table=False)


def predict(sweep: Sweep, cell: Cell, result: dict, gpu: str) -> dict:
    """The planner's figures for a cell that has a config (an empty dict where it has none)."""
    from ultratron.config import load_config
    from ultratron.planning.flops import flops_per_token_of
    from ultratron.planning.layout import check_layout
    from ultratron.planning.search import SearchSpec, estimate_step

    path = sweep.cell_dir(cell) / "config.toml"
    if not path.is_file():
        return {}
    cfg = load_config(path)
    m, par, t = cfg.model, cfg.parallel, cfg.training
    on_cpu = gpu == "cpu" or str(result.get("device", "")).startswith("cpu")
    # attention in fp32 for bf16 on a CPU, as the trainer runs it (its device, not a config field)
    # and on a CPU ZeRO-3 gathering one linear layer at a time (parallel/data.py)
    layout = replace(cfg.layout, attention_fp32=on_cpu and t.precision == "bf16",
                     zero3_units="linear" if on_cpu else "block")
    fields = {"dp": par.dp, "tp": par.tp, "pp": par.pp, "zero": par.zero, "sp": par.sp, "mbs": t.micro_batch_size,
              "recompute": t.recompute}
    if check_layout(m, layout):
        return fields
    flops = flops_per_token_of(m, t.seq_len)
    acc = _accelerator(gpu, result, flops)
    if acc is None or t.precision not in acc.flops:
        from ultratron.planning.memory import estimate_memory

        return fields | {"predicted_peak_bytes": estimate_memory(m, layout).peak_bytes}
    spec = SearchSpec(m, acc, layout.n_gpus, min(sweep.gpus_per_node, layout.n_gpus), t.batch_tokens, t.seq_len,
                      t.precision)
    est = estimate_step(spec, layout)
    return fields | {"predicted_tokens_per_sec_per_gpu": est.tokens_per_s_per_gpu, "predicted_mfu": est.mfu,
            "predicted_step_seconds": est.step_s, "predicted_peak_bytes": est.memory.peak_bytes}


def _error(measured, predicted) -> float | None:
    return measured / predicted - 1 if measured and predicted else None


def rows(sweep: Sweep, gpu: str) -> list[dict]:
    """One row per cell (finished or not), measurements beside predictions."""
    out = []
    for cell in sweep.cells:
        result = read_result(sweep, cell) or {"status": "pending", "cause": "", "world": cell.world}
        row = {"name": cell.name, "model": cell.model, "source": cell.source, "world": result.get("world"),
               **{k: cell.get(k) for k in ("dp", "tp", "pp", "zero", "sp", "mbs", "recompute")},
               "status": result["status"], "cause": result.get("cause", ""), "steps": result.get("steps", 0),
               "tokens_per_sec_per_gpu": result.get("tokens_per_sec_per_gpu"), "mfu": result.get("mfu"),
               "step_seconds": result.get("step_seconds")}
        if "peak_allocated_bytes" in result:
            row |= {"peak_memory_bytes": result["peak_allocated_bytes"], "memory_measured_as": "cuda allocated"}
        elif "max_rss_bytes" in result:
            row |= {"peak_memory_bytes": result["max_rss_bytes"], "memory_measured_as": "process rss"}
        row |= predict(sweep, cell, result, gpu) if result["status"] != "pending" else {}
        row["tokens_error"] = _error(row["tokens_per_sec_per_gpu"], row.get("predicted_tokens_per_sec_per_gpu"))
        row["mfu_error"] = _error(row["mfu"], row.get("predicted_mfu"))
        if row.get("memory_measured_as") == "cuda allocated":
            row["memory_error"] = _error(row["peak_memory_bytes"], row.get("predicted_peak_bytes"))
        out.append({c: row.get(c) for c in COLUMNS})
    return out


def _csv(table: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in table)
    return buffer.getvalue()


def _fmt(value, kind: str) -> str:
    if value is None or value == "":
        return "—"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "err":
        return f"{value:+.0%}"
    if kind == "gib":
        return f"{value / 2**30:.2f}"
    return f"{value:,.0f}"


def markdown(table: list[dict], gpu: str) -> str:
    lines = [f"# Sweep: measured beside `plan estimate` ({gpu})", "",
             "| cell | status | tokens/s/GPU | predicted | error | MFU | predicted | error | peak GiB | predicted | "
             "error |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        status = r["status"] + (f": {r['cause']}" if r["cause"] else "")
        memory = _fmt(r["peak_memory_bytes"], "gib") + (" (rss)" if r["memory_measured_as"] == "process rss" else "")
        lines.append(f"| {r['name']} | {status.replace('|', '/')} | {_fmt(r['tokens_per_sec_per_gpu'], 'n')} | "
                     f"{_fmt(r['predicted_tokens_per_sec_per_gpu'], 'n')} | {_fmt(r['tokens_error'], 'err')} | "
                     f"{_fmt(r['mfu'], 'pct')} | {_fmt(r['predicted_mfu'], 'pct')} | {_fmt(r['mfu_error'], 'err')} | "
                     f"{memory} | {_fmt(r['predicted_peak_bytes'], 'gib')} | {_fmt(r['memory_error'], 'err')} |")
    lines += ["", "error = measured / predicted − 1. Peak memory on a GPU is torch's allocator peak (what the planner "
              "predicts); on a CPU it is the process's resident set (rss), which holds Python and torch too, and "
              "gets no error."]
    return "\n".join(lines) + "\n"


def heatmap(path: Path, table: list[dict], title: str) -> None:
    """MFU by dp × tp, one panel per model and pp: measured (colour and first line), predicted and
    error below; cells that did not run show their status."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], int(r["pp"] or 1)) for r in table})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (model, pp) in zip(axes[0], panels, strict=True):
        mine = [r for r in table if r["model"] == model and int(r["pp"] or 1) == pp]
        dps = sorted({int(r["dp"] or 1) for r in mine})
        tps = sorted({int(r["tp"] or 1) for r in mine})
        grid = [[float("nan")] * len(tps) for _ in dps]
        for r in mine:
            i, j = dps.index(int(r["dp"] or 1)), tps.index(int(r["tp"] or 1))
            if r["mfu"] is not None and not grid[i][j] >= r["mfu"]:  # the best of several cells at one point
                grid[i][j] = r["mfu"]
            text = (f"{r['mfu']:.1%}\npred {_fmt(r['predicted_mfu'], 'pct')}\n({_fmt(r['mfu_error'], 'err')})"
                    if r["status"] == "ok" else r["status"])
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="black" if r["status"] != "ok" or
                    r["mfu"] >= 0.5 * max((x for row in grid for x in row if x == x), default=0) else "white")
        ax.imshow(grid, cmap="viridis", vmin=0, aspect="auto")
        ax.set_xticks(range(len(tps)), [f"tp={t}" for t in tps])
        ax.set_yticks(range(len(dps)), [f"dp={d}" for d in dps])
        ax.set_title(f"{model}, pp={pp}: MFU", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


def write_reports(sweep: Sweep, gpu: str) -> dict[str, Path]:
    """sweep.csv, sweep.md and sweep.png in the sweep directory, from every cell's result so far."""
    table = rows(sweep, gpu)
    paths = {"csv": sweep.root / "sweep.csv", "markdown": sweep.root / "sweep.md", "heatmap": sweep.root / "sweep.png"}
    atomic.write_text(paths["csv"], _csv(table))
    atomic.write_text(paths["markdown"], markdown(table, gpu))
    heatmap(paths["heatmap"], table, f"{sweep.root.name}: measured MFU, planner's prediction and error")
    return paths
