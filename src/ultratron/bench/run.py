"""Run the cells of a sweep, each in its own `ultratron train` process, and record each outcome.

A sweep directory holds sweep.json (the cells and the settings they share) and, per cell,
cells/NAME/{config.toml, log.txt, run/, result.json}. result.json is written last (under a temporary
name, then renamed), so a cell with one is finished and is never run again; a cell without one
(interrupted) starts over in a clean run directory. A cell runs as `ultratron train` in one
process, `ultratron launch` (torchrun) on several, or — in a Slurm job array — `srun` of
`ultratron launch` on the task's nodes. Neither this module nor the cell's process imports the
trainer here: the outcome is read back from the cell's metrics.jsonl and RUN/memory/rank*.json.

Outcomes: ok; refused (the config fails validation, so nothing runs); oom (out of memory); timeout;
failed (any other error: the cause is the first error line of the log).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ultratron import atomic
from ultratron.bench.cells import Cell
from ultratron.errors import ConfigError, UserError

SWEEP_FILE = "sweep.json"
RESULT_FILE = "result.json"
# settings every cell gets before the user's own overrides (which win): a short run, no sample
CELL_DEFAULTS = ["--eval.interval", "0", "--training.sample_tokens", "0", "--training.progress", "false"]
OOM_PATTERNS = ("OutOfMemoryError", "CUDA out of memory", "DefaultCPUAllocator: can't allocate memory",
                "Cannot allocate memory", "std::bad_alloc")
# exception lines that only report another rank's failure, not its cause
SECONDARY = ("ChildFailedError", "torch.distributed.elastic", "DistBackendError", "Connection reset by peer",
             "Connection closed by peer", "Broken pipe")


@dataclass
class Sweep:
    """A sweep directory and what its cells share."""

    root: Path
    cells: list[Cell]
    config: str | None  # a base config file for every cell
    overrides: list[str]  # `ultratron train` flags for every cell (before the cell's own)
    steps: int
    timeout: float
    gpus_per_node: int

    def cell_dir(self, cell: Cell) -> Path:
        return self.root / "cells" / cell.name

    def to_json(self) -> dict:
        return {"cells": [c.as_dict() for c in self.cells], "config": self.config, "overrides": self.overrides,
                "steps": self.steps, "timeout": self.timeout, "gpus_per_node": self.gpus_per_node}

    def save(self) -> None:
        _write_json(self.root / SWEEP_FILE, self.to_json())

    @classmethod
    def load(cls, root: Path) -> Sweep:
        path = root / SWEEP_FILE
        if not path.is_file():
            raise UserError(f"{root} holds no sweep ({SWEEP_FILE} is missing); start one with --layout, --grid "
                            "or --top")
        data = json.loads(path.read_text())
        return cls(root, [Cell.from_dict(c) for c in data["cells"]], data["config"], data["overrides"],
                   data["steps"], data["timeout"], data["gpus_per_node"])


def open_sweep(root: Path, cells: list[Cell], config: str | None, overrides: list[str], steps: int, timeout: float,
               gpus_per_node: int) -> Sweep:
    """The sweep in `root`: a new one, or the one already there with any new cells added after its own
    (its shared settings must not change, or its finished cells would measure something else)."""
    new = Sweep(root, cells, config, overrides, steps, timeout, gpus_per_node)
    if (root / SWEEP_FILE).is_file():
        old = Sweep.load(root)
        for key in ("config", "overrides", "steps"):
            if getattr(old, key) != getattr(new, key):
                raise UserError(f"{root} was swept with {key} {getattr(old, key)!r}, not {getattr(new, key)!r}; "
                                "use another --out (finished cells are never rerun)")
        names = {c.name for c in old.cells}
        old.cells += [c for c in cells if c.name not in names]
        old.timeout, old.gpus_per_node = timeout, gpus_per_node
        new = old
    root.mkdir(parents=True, exist_ok=True)
    new.save()
    return new


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, data, indent=1)


def read_result(sweep: Sweep, cell: Cell) -> dict | None:
    path = sweep.cell_dir(cell) / RESULT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def cell_config(sweep: Sweep, cell: Cell):
    """The cell's validated training config (raises ConfigError for a layout the trainer refuses)."""
    from ultratron.config import load_config

    run_dir = sweep.cell_dir(cell) / "run"
    flags = CELL_DEFAULTS + ["--training.steps", str(sweep.steps)] + sweep.overrides + cell.overrides
    return load_config(sweep.config, flags + ["--run.dir", str(run_dir)])


def command(world: int, config_path: Path, launcher: str, gpus_per_node: int) -> list[str]:
    """The process a cell runs: `ultratron train` alone, `ultratron launch` (torchrun) on one node,
    or under Slurm `srun` of `ultratron launch` on as many of the task's nodes as it needs."""
    train = ["--config", str(config_path)]
    me = [sys.executable, "-m", "ultratron"]
    if launcher == "local" or world <= gpus_per_node:
        if world == 1:
            return [*me, "train", *train]
        cmd = [*me, "launch", "--nproc-per-node", str(world), "--", *train]
        return (["srun", "--nodes=1", "--ntasks=1", *cmd] if launcher == "slurm" else cmd)
    nodes = math.ceil(world / gpus_per_node)
    if world % nodes:
        raise UserError(f"{world} processes do not split evenly over {nodes} nodes of {gpus_per_node} GPUs")
    head = os.environ.get("ULTRATRON_HEAD_NODE") or "localhost"
    return ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", *me, "launch", "--nproc-per-node",
            str(world // nodes), "--nnodes", str(nodes), "--rdzv-endpoint", f"{head}:29500", "--", *train]


def _cause(log: str) -> tuple[str, str]:
    """(status, cause) of a failed cell from its log: out of memory, or the first error line."""
    for pattern in OOM_PATTERNS:
        for line in log.splitlines():
            if pattern in line:
                return "oom", line.strip()[:300]
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]  # ultratron's own, one line each
    errors += [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*", line)
               and not any(s in line for s in SECONDARY)]
    if errors:
        return "failed", errors[0].removeprefix("error: ")[:300]
    return "failed", (lines[-1][:300] if lines else "no output")


def measured(run_dir: Path, world: int) -> dict:
    """Figures from the cell's metrics.jsonl (the median over the steps after the first, which pays
    for warm-up) and its ranks' memory files (the largest rank's peak)."""
    records = []
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        records = [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]
    out: dict = {"steps": len(records)}
    timed = records[1:] or records
    if timed:
        tokens = statistics.median(r["tokens_per_sec"] for r in timed)
        out |= {"tokens_per_sec_per_gpu": tokens / world, "mfu": statistics.median(r["mfu"] for r in timed),
                "step_seconds": statistics.median(r["step_time"] for r in timed)}
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "memory").glob("rank*.json"))]
    if ranks:
        out["device"] = ranks[0]["device"]
        out["max_rss_bytes"] = max(r["max_rss_bytes"] for r in ranks)
        if all("peak_allocated_bytes" in r for r in ranks):
            out["peak_allocated_bytes"] = max(r["peak_allocated_bytes"] for r in ranks)
    return out


def run_cell(sweep: Sweep, cell: Cell, launcher: str = "local", echo=print) -> dict:
    """Run one cell (unless it is finished) and return its result."""
    if (done := read_result(sweep, cell)) is not None:
        return done
    where = sweep.cell_dir(cell)
    shutil.rmtree(where / "run", ignore_errors=True)  # an interrupted attempt starts over
    where.mkdir(parents=True, exist_ok=True)
    result = {**cell.as_dict(), "world": cell.world, "status": "", "cause": "", "exit_code": None,
              "seconds": 0.0, "steps": 0}
    try:
        cfg = cell_config(sweep, cell)
    except ConfigError as err:
        result |= {"status": "refused", "cause": "; ".join(err.problems)}
        _write_json(where / RESULT_FILE, result)
        echo(f"{cell.name}: refused — {result['cause']}")
        return result
    from ultratron.config import to_toml

    config_path = where / "config.toml"
    config_path.write_text(to_toml(cfg))
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    cmd = command(world, config_path, launcher, sweep.gpus_per_node)
    echo(f"{cell.name}: {shlex.join(cmd)}")
    start = time.perf_counter()
    with open(where / "log.txt", "w", encoding="utf-8") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=sweep.timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    text = (where / "log.txt").read_text(encoding="utf-8", errors="replace")
    result |= {"world": world, "exit_code": code, "seconds": time.perf_counter() - start,
               **measured(Path(cfg.run.dir), world)}
    if code is None:
        result |= {"status": "timeout", "cause": f"no result within {sweep.timeout:g} s"}
    elif code == 0 and result["steps"] > 0:
        result["status"] = "ok"
    else:
        result["status"], result["cause"] = _cause(text)
    _write_json(where / RESULT_FILE, result)
    echo(f"{cell.name}: {result['status']}" + (f" — {result['cause']}" if result["cause"] else ""))
    return result


def retry(sweep: Sweep, statuses: tuple[str, ...]) -> int:
    """Forget the results of cells that ended in one of `statuses`, so that they run again."""
    forgotten = 0
    for cell in sweep.cells:
        result = read_result(sweep, cell)
        if result is not None and result["status"] in statuses:
            (sweep.cell_dir(cell) / RESULT_FILE).unlink()
            forgotten += 1
    return forgotten


def slurm_array(sweep: Sweep, *, job_name: str, time_limit: str, partition: str | None, parallel: int) -> str:
    """A batch script that runs the sweep as one Slurm job array, one cell per task (on as many nodes
    as the largest cell needs); each task also refreshes the sweep's reports."""
    nodes = max(math.ceil(c.world / sweep.gpus_per_node) for c in sweep.cells)
    gpus = min(sweep.gpus_per_node, max(c.world for c in sweep.cells))
    root = shlex.quote(str(sweep.root.resolve()))
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}",
             f"#SBATCH --array=0-{len(sweep.cells) - 1}" + (f"%{parallel}" if parallel else ""),
             f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={gpus}",
             f"#SBATCH --time={time_limit}", f"#SBATCH --output={sweep.root.resolve()}/slurm-%A_%a.out"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["set -uo pipefail",
              'export ULTRATRON_HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "# one cell per array task; a finished cell is skipped, so resubmitting reruns only the rest",
              f'python -m ultratron bench sweep --out {root} --cell "$SLURM_ARRAY_TASK_ID" --launcher slurm', ""]
    return "\n".join(lines)
