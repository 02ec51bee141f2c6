"""Health checks around the training loop: once before the first step and every `health.interval`
minutes. Every rank checks its GPU (NVML) and times a matmul and an all-reduce; rank 0 logs the
group's verdict, names a straggler (slower than `health.straggler_factor` × the others' median),
and records the timings in the metrics. A failing GPU is named in the log and in
RUN_DIR/unhealthy-nodes.txt (which the Slurm script excludes when it resubmits the job) and,
with `health.stop_on_failure`, stops training. The checks themselves: `parallel/health.py`.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ultratron.errors import DeviceError
from ultratron.parallel.health import GpuMonitor, check_rank, gather, judge

UNHEALTHY_FILE = "unhealthy-nodes.txt"


class HealthMonitor:
    def __init__(self, cfg, dims, device: torch.device, run_dir: Path, log):
        self.h, self.dims, self.device, self.run_dir, self.log = cfg.health, dims, device, run_dir, log
        gpu = [device.index or 0] if device.type == "cuda" else None
        self.monitor = GpuMonitor(gpu) if (self.h.check or self.h.interval > 0) else None
        self.last = time.monotonic()

    def check(self, step: int, record: bool = True) -> list[str]:
        """Run the checks on every rank (collective); returns the problems found (rank 0 logs them
        and, with `record`, writes a metrics record)."""
        mine = check_rank(self.dims.rank, self.device, self.monitor, matmul_size=self.h.matmul_size,
                          max_temperature=self.h.max_temperature, distributed=self.dims.distributed)
        reports = gather(mine)
        problems, warnings, failing = judge(reports, self.h.straggler_factor)
        matmul = [r.matmul_s for r in reports]
        reduce = [r.allreduce_s for r in reports if r.allreduce_s is not None]
        timing = f"matmul {min(matmul) * 1e3:.2f}–{max(matmul) * 1e3:.2f} ms" + (
            f", all-reduce {min(reduce) * 1e3:.2f}–{max(reduce) * 1e3:.2f} ms" if reduce else "")
        self.log(f"health: step {step}: {len(reports)} rank(s); {reports[0].gpu.summary}; {timing}; "
                 + ("ok" if not problems else f"{len(problems)} problem(s)"))
        for line in warnings:
            self.log(f"health: warning: {line}")
        for line in problems:
            self.log(f"health: FAILED: {line}")
        if record:
            self.log.record({"step": step, "health/matmul_ms_max": max(matmul) * 1e3,
                             "health/problems": len(problems), "health/warnings": len(warnings)}
                            | ({"health/allreduce_ms_max": max(reduce) * 1e3} if reduce else {}))
        if problems:
            if self.dims.is_main:
                with open(self.run_dir / UNHEALTHY_FILE, "a", encoding="utf-8") as fh:
                    fh.write("".join(f"{host}\n" for host in failing))
            if self.h.stop_on_failure:
                raise DeviceError([f"health check failed on {', '.join(failing)} (listed in "
                                   f"{self.run_dir / UNHEALTHY_FILE}):", *problems])
        self.last = time.monotonic()
        return problems

    def before_start(self, step: int) -> None:
        """Before anything else (no metrics record yet: a fresh start trims metrics.jsonl at resume)."""
        if self.h.check:
            self.check(step, record=False)

    def after_step(self, step: int) -> None:
        """The periodic check, when due by rank 0's clock (ranks' clocks differ, so rank 0 decides)."""
        if self.h.interval <= 0:
            return
        due = torch.tensor([float(time.monotonic() - self.last >= self.h.interval * 60)], device=self.device)
        if dist.is_initialized():
            dist.broadcast(due, src=0)
        if due.item():
            self.check(step)
