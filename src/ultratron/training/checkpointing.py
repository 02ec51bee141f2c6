"""When the trainer saves and where it resumes from; the saving and loading itself is the
checkpoint owner's (`ultratron.checkpoint`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ultratron.checkpoint.manager import Checkpointer, ModelState, holds_run_state, resolve_checkpoint_dir
from ultratron.data.tokenizer import Tokenizer
from ultratron.errors import CheckpointError
from ultratron.training.metrics import truncate_metrics
from ultratron.training.state import TrainState


class CheckpointPolicy:
    def __init__(self, cfg, run_dir: Path, is_main: bool, model_state: ModelState, train_state: TrainState,
                 files, log):
        self.interval, self.resume_from = cfg.checkpoint.interval, cfg.checkpoint.resume
        self.init_from = cfg.model.init_from
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
            self._fresh_start()
            return
        path = self.checkpointer.latest() if self.resume_from == "auto" else self.resume_from
        if path is None:
            self.log("checkpoint: resume=auto found no checkpoint; starting from step 0")
            self._fresh_start()
            return
        if not holds_run_state(path):  # weights only (an import): where a run starts, not one to resume
            self._fresh_start(path)
            return
        ckpt = self.checkpointer.load(path, self.model_state, self.train_state)
        self._trim_metrics(self.train_state.step)
        self.log(f"checkpoint: resumed from {ckpt} at step {self.train_state.step}")

    def _fresh_start(self, weights=None) -> None:
        """Step 0: the weights of `weights` or model.init_from if given (no optimizer state, no run state)."""
        self._trim_metrics(-1)  # drop records of an earlier attempt
        weights = weights or self.init_from
        if weights is not None:
            ckpt = self.checkpointer.load(weights, ModelState(self.model_state.model))
            self.log(f"checkpoint: starting at step 0 from the weights of {ckpt}")

    def _trim_metrics(self, last_step: int) -> None:
        if self.is_main:
            truncate_metrics(self.run_dir, last_step)

    def after_step(self, step: int, stop_at: int) -> Path | None:
        """Save every `interval` steps and when this invocation stops; returns the new checkpoint."""
        if (self.interval > 0 and step % self.interval == 0) or step == stop_at:
            self.last = self.checkpointer.save(step, self.model_state, self.train_state, self.files())
            self.log(f"checkpoint: saved step {step} to {self.last}")
            self.log.event("checkpoint", step, path=str(self.last))  # for the trackers (W&B)
            return self.last
        return None


def with_init_tokenizer(data_cfg, init_from: str | None):
    """The data config with model.init_from's tokenizer: the weights' embeddings are its tokens.
    An explicit data.tokenizer must be that same tokenizer."""
    if init_from is None:
        return data_cfg
    ckpt = resolve_checkpoint_dir(init_from)
    own = ckpt / "tokenizer.json"
    if data_cfg.tokenizer is None:
        return dataclasses.replace(data_cfg, tokenizer=str(own))
    if Tokenizer.load(data_cfg.tokenizer).sha256 != Tokenizer.load(own).sha256:
        raise CheckpointError(f"data.tokenizer {data_cfg.tokenizer} is not the tokenizer of model.init_from ({own}), "
                              "whose tokens the weights were trained on; leave data.tokenizer unset")
    return data_cfg
