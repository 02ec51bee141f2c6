"""`training.profile_steps = "N..M"`: where a step's time and memory go, per rank, in the run directory.

Steps N to M (1-based optimizer steps, counted as the run counts them) run under
`torch.profiler`; when step M ends each rank writes into RUN_DIR/profile/:

- `rank{R}.pt.trace.json` — the trace (every operator on a time line, CPU and, on a GPU, CUDA
  kernels, with input shapes and allocations): open it in Perfetto (ui.perfetto.dev) or
  chrome://tracing, or in TensorBoard with the torch-tb-profiler plugin (`--logdir RUN_DIR/profile`);
- `rank{R}-operators.txt` — the operators by self time, a table to read first;
- `rank{R}-memory.pickle` (CUDA only) — the allocator's memory snapshot with the stack of every
  allocation alive, for pytorch.org/memory_viz;
- `rank{R}-memory.html` — memory over the profiled steps by kind (parameters, gradients,
  optimizer state, activations, temporaries), from the profiler's allocation records; on a CPU
  this is what torch offers (its CPU allocator keeps no history of its own).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

import torch
from torch.autograd.profiler_util import EventList

from ultratron.config.training_rules import parse_steps

PYTHON_FRAME = re.compile(r"\.py\(\d+\)|^<built-in")  # (with_stack's Python frames: not operators)


class StepProfiler:
    def __init__(self, steps: str, run_dir: Path, rank: int, device: torch.device, log):
        self.range = parse_steps(steps)
        self.dir, self.rank, self.device, self.log = Path(run_dir) / "profile", rank, device, log
        self.profiler = None

    def before(self, step: int) -> None:
        """Called before optimizer step `step` (1-based) runs."""
        if self.range is None or step != self.range[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                               with_stack=True)
        self.profiler.__enter__()

    def after(self, step: int) -> None:
        """Called when optimizer step `step` has finished."""
        if self.profiler is None or step != self.range[1]:
            return
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}"
        profiler.export_chrome_trace(str(self.dir / f"{name}.pt.trace.json"))
        operators = EventList([e for e in profiler.key_averages() if not PYTHON_FRAME.search(e.key)],
                              profile_memory=True)
        table = operators.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
        (self.dir / f"{name}-operators.txt").write_text(table + "\n", encoding="utf-8")
        with contextlib.suppress(Exception), warnings.catch_warnings():  # (optional: torch may lack the data)
            warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA, the only view on a CPU
            profiler.export_memory_timeline(str(self.dir / f"{name}-memory.html"), device=self._memory_device())
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.dir / f"{name}-memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0:
            self.log(f"profile: steps {self.range[0]}..{self.range[1]} written to {self.dir} "
                     "(trace for Perfetto / TensorBoard, operator table, memory)")

    def _memory_device(self) -> str:
        return f"cuda:{self.device.index or 0}" if self.device.type == "cuda" else "cpu"
