"""Where a run's numbers go: metrics.jsonl (one object per step), TensorBoard, a log file."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


class RunLog:
    """Human-readable messages to stderr and RUN/train.log."""

    def __init__(self, run_dir: Path, echo: bool = True):
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "train.log", "a", encoding="utf-8")
        self.echo = echo

    def __call__(self, message: str, write=None) -> None:
        """`write`: prints the console line instead of print (a progress bar's, so it is not broken)."""
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        self._file.write(line + "\n")
        self._file.flush()
        if self.echo:
            if write is not None:
                write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self._file.close()


class MetricsWriter:
    """metrics.jsonl (opened at the first record, so a resume may trim the file before) and TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self._file = None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(self._tag(key), value, record["step"])

    def rewind(self, run_dir: Path, last_step: int) -> None:
        """Drop the records after `last_step` (a rollback discards those steps); the file is reopened
        at the next record, so the writer never appends to the replaced file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        truncate_metrics(run_dir, last_step)

    @staticmethod
    def _tag(key: str) -> str:
        """TensorBoard tag: task results ("eval/TASK/METRIC") keep their path; val_* go under val/."""
        if "/" in key:
            return key
        return f"val/{key}" if key.startswith("val") else f"train/{key}"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Drop records after `last_step` (steps a crashed run logged past its last checkpoint),
    so a resumed run's metrics.jsonl holds each step once."""
    records = [r for r in read_metrics(run_dir) if r.get("step", 0) <= last_step]
    tmp = run_dir / f"metrics.jsonl.tmp-{os.getpid()}"  # ranks of one run may trim at once
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, run_dir / "metrics.jsonl")
