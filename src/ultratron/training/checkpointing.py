"""When the trainer saves and where it resumes from; the saving and loading itself is the
checkpoint owner's (`ultratron.checkpoint`)."""

from __future__ import annotations

from pathlib import Path

from ultratron.checkpoint.manager import Checkpointer, ModelState
from ultratron.errors import CheckpointError
from ultratron.training.metrics import truncate_metrics
from ultratron.training.state import TrainState


class CheckpointPolicy:
    def __init__(self, cfg, run_dir: Path, is_main: bool, model_state: ModelState, train_state: TrainState,
                 files, log):
        self.interval, self.resume_from = cfg.checkpoint.interval, cfg.checkpoint.resume
        self.run_dir, self.is_main, self.log = run_dir, is_main, log
        self.checkpointer = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep)
        self.model_state, self.train_state = model_state, train_state
        self.files = files  # () -> {"config.toml": ..., "tokenizer.json": ...}
        self.last: Path | None = None

    def resume(self) -> None:
        """`none`: a fresh start (refused where checkpoints exist); `auto`: the latest, if any; else a path."""
        if self.resume_from == "none":
            existing = self.checkpointer.latest()
            if existing is not None:
                raise CheckpointError(
                    f"run.dir {str(self.run_dir)!r} already holds checkpoints (latest: {existing.name}); "
                    "pass --checkpoint.resume auto to continue that run, or choose a new --run.dir")
            self._trim_metrics(-1)  # drop records of an earlier attempt
            return
        path = self.checkpointer.latest() if self.resume_from == "auto" else self.resume_from
        if path is None:
            self.log("checkpoint: resume=auto found no checkpoint; starting from step 0")
            self._trim_metrics(-1)
            return
        ckpt = self.checkpointer.load(path, self.model_state, self.train_state)
        self._trim_metrics(self.train_state.step)
        self.log(f"checkpoint: resumed from {ckpt} at step {self.train_state.step}")

    def _trim_metrics(self, last_step: int) -> None:
        if self.is_main:
            truncate_metrics(self.run_dir, last_step)

    def after_step(self, step: int, stop_at: int) -> Path | None:
        """Save every `interval` steps and when this invocation stops; returns the new checkpoint."""
        if (self.interval > 0 and step % self.interval == 0) or step == stop_at:
            self.last = self.checkpointer.save(step, self.model_state, self.train_state, self.files())
            self.log(f"checkpoint: saved step {step} to {self.last}")
            return self.last
        return None
