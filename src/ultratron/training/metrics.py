"""Where a run's numbers go: one metrics interface (`MetricsWriter`) in front of its sinks —
metrics.jsonl (one object per step, always), TensorBoard, Weights & Biases — and a log file.

Every sink takes the same records: a step's metrics, validation and task-evaluation results at
their step (`write`), and run events such as a saved checkpoint (`event`). A new tracker is one
more sink class.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

from ultratron import atomic
from ultratron.errors import ConfigError


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


def tag(key: str) -> str:
    """A metric's chart name: task results ("eval/TASK/METRIC") keep their path; val_* go under val/."""
    if "/" in key:
        return key
    return f"val/{key}" if key.startswith("val") else f"train/{key}"


def _scalars(record: dict) -> dict[str, float]:
    return {tag(k): v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool)}


class JsonlSink:
    """metrics.jsonl, opened at the first record (so a resume may trim the file before)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self._file = None

    def write(self, record: dict) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def event(self, kind: str, step: int, data: dict) -> None:
        pass  # metrics.jsonl holds metrics only; train.log has the events

    def rewind(self, last_step: int) -> None:
        """Drop the records after `last_step` (a rollback discards those steps); the file is reopened
        at the next record, so the sink never appends to the replaced file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        truncate_metrics(self.path.parent, last_step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self._tb.add_scalar(key, value, record["step"])

    def event(self, kind: str, step: int, data: dict) -> None:
        self._tb.add_text(kind, json.dumps(data), step)

    def close(self) -> None:
        self._tb.close()


class WandbSink:
    """A Weights & Biases run: the config at the start, every record, checkpoint events.

    Records are logged against our own `step` (W&B's define_metric with a step_metric), not
    W&B's internal counter, because task evaluations finish after later steps were logged and
    W&B drops records whose internal step goes backwards. The run id is kept in RUN/wandb-run-id
    so that a resumed training continues the same W&B run (online; offline runs sync separately).
    """

    ID_FILE = "wandb-run-id"

    def __init__(self, run_dir: Path, run_cfg, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError("run.wandb=true needs the wandb package: pip install wandb") from None
        id_file = run_dir / self.ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        wandb_dir = Path(run_cfg.wandb_dir or run_dir)
        wandb_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=run_cfg.wandb_project, name=run_cfg.wandb_name or run_dir.name, tags=run_cfg.wandb_tags,
                mode=run_cfg.wandb_mode, dir=str(wandb_dir), config=config, id=run_id,
                resume="allow" if run_cfg.wandb_mode == "online" else None,
                settings=wandb.Settings(console="off", silent=True, save_code=False))
        except Exception as err:  # wandb raises its own error types for a missing login, no network, ...
            raise ConfigError(f"run.wandb: W&B did not start ({type(err).__name__}: {err}); "
                              "--run.wandb_mode offline logs without an account or network") from None
        id_file.write_text(run_id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict) -> None:
        self.run.log({"step": record["step"], **_scalars(record)})

    def event(self, kind: str, step: int, data: dict) -> None:
        self.run.log({"step": step, f"{kind}/step": step})
        for key, value in data.items():
            self.run.summary[f"{kind}/{key}"] = value

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits until the service has flushed the run to disk (finish alone may not)


class MetricsWriter:
    """The one metrics interface: each record and event goes to every sink of the run."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, run_cfg=None, config: dict | None = None):
        self.sinks: list = [JsonlSink(run_dir)]
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir))
        if run_cfg is not None and run_cfg.wandb:
            self.sinks.append(WandbSink(run_dir, run_cfg, config or {}))

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def event(self, kind: str, step: int, **data) -> None:
        for sink in self.sinks:
            sink.event(kind, step, data)

    def rewind(self, run_dir: Path, last_step: int) -> None:
        """Forget the records after `last_step` where a sink can (metrics.jsonl; the trackers keep
        their history, and the rolled-back steps are logged again with their new values)."""
        self.sinks[0].rewind(last_step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Drop records after `last_step` (steps a crashed run logged past its last checkpoint),
    so a resumed run's metrics.jsonl holds each step once."""
    records = [r for r in read_metrics(run_dir) if r.get("step", 0) <= last_step]
    # ranks of one run may trim at once: each writes its own temporary (named by its process id)
    atomic.write_text(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))


MEMORY_DIR = "memory"


def start_memory(device) -> dict:
    """The peaks so far, taken once the model is built and its weights initialized or loaded, before
    the first step (`start_` figures of RUN/memory/rank<r>.json): what starting a run holds."""
    import resource

    import torch

    record = {"start_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if getattr(device, "type", "") == "cuda":
        record["start_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return record


def write_memory_peak(run_dir: Path, rank: int, device, start: dict | None = None) -> None:
    """This rank's peak memory over the run, in RUN/memory/rank<r>.json (read by `ultratron bench
    sweep`): torch's allocator peaks on a GPU (`max_memory_allocated`, what `plan memory` predicts,
    and `max_memory_reserved`), and the process's peak resident set on any device (on a CPU the
    only figure there is; it also holds Python, torch and the allocator's caches); with `start`
    (`start_memory`), the same peaks up to the first step."""
    import resource

    import torch

    record = {"rank": rank, "device": str(device),
              "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if getattr(device, "type", "") == "cuda":
        record |= {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                   "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    record |= start or {}
    path = Path(run_dir) / MEMORY_DIR / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, record)
