"""When the trainer saves and where it resumes from; the saving and loading itself is the
checkpoint owner's (`ultratron.checkpoint`).

Saves are asynchronous by default: `after_step` starts one and training goes on; the next save
first collects the outcome of the one in flight (at most one at a time), and the last save of
an invocation is awaited. A save that fails on a storage that cannot take one (disk full,
read-only) stops training with one clear line; any other failure (an object store that is down)
is logged, the previous checkpoint stays the one `latest` names, and the next interval tries again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ultratron.checkpoint.checkpointer import Checkpointer
from ultratron.checkpoint.manager import ModelState, SaveOutcome, holds_run_state
from ultratron.checkpoint.storage import Location
from ultratron.checkpoint.store import resolve_checkpoint_dir
from ultratron.data.tokenizer import Tokenizer
from ultratron.errors import CheckpointError, CheckpointStorageError
from ultratron.models.lora import is_adapter
from ultratron.training.metrics import truncate_metrics
from ultratron.training.state import TrainState


def checkpoint_root(cfg, run_dir: Path) -> str | Path:
    return cfg.checkpoint.dir or run_dir / "checkpoints"


class CheckpointPolicy:
    def __init__(self, cfg, run_dir: Path, is_main: bool, model_state: ModelState, train_state: TrainState,
                 files, log):
        c = cfg.checkpoint
        self.cfg = cfg
        self.interval, self.resume_from = c.interval, c.resume
        self.init_from = cfg.model.init_from
        self.run_dir, self.is_main, self.log = run_dir, is_main, log
        self.checkpointer = Checkpointer(checkpoint_root(cfg, run_dir), keep=c.keep, endpoint=c.endpoint or None,
                                         asynchronous=c.async_save, log=log)
        self.model_state, self.train_state = model_state, train_state
        self.files = files  # () -> {"config.toml": ..., "tokenizer.json": ...}
        self.last: Location | None = None

    @property
    def storage(self):
        return self.checkpointer.storage

    def resume(self) -> None:
        """`none`: a fresh start (refused where checkpoints exist); `auto`: the newest checkpoint that
        passes verification, if any; else the named checkpoint (verified, no fallback: it was named)."""
        self.checkpointer.clean_stale()
        if self.resume_from == "none":
            existing = self.checkpointer.latest()
            if existing is not None:
                raise CheckpointError(
                    f"checkpoint.dir {str(self.storage)!r} already holds checkpoints (latest: {existing}); "
                    "pass --checkpoint.resume auto to continue that run, or choose a new --run.dir")
            self._fresh_start()
            return
        if self.resume_from == "auto":
            path = self.checkpointer.newest_verified()
            if path is None:
                self._nothing_to_resume()
                return
        else:
            path = self.resume_from
        if not holds_run_state(path, self.storage if self.resume_from == "auto" else None):
            self._fresh_start(path)  # weights only (an import): where a run starts, not one to resume
            return
        if self.cfg.lora.rank > 0:  # the checkpoint holds the adapters; the model under them is model.init_from
            self._load_weights(self.init_from)
        ckpt = self.checkpointer.load(path, self.model_state, self.train_state, verified=self.resume_from == "auto")
        self.last = ckpt
        self._trim_metrics(self.train_state.step)
        self.log(f"checkpoint: resumed from {ckpt} at step {self.train_state.step}")
        self._compare_with_saved()

    def _compare_with_saved(self) -> None:
        """Say what a resume under another layout or global batch means for the data: the loader's
        position is global (sequences consumed), so every sequence is still read exactly once."""
        saved, now = self.train_state.saved_config, self.cfg
        consumed = self.train_state.loader.consumed
        if not saved:
            return
        layout = lambda p: " × ".join(f"{k}{p[k]}" for k in ("dp", "tp", "pp", "cp") if p.get(k, 1) > 1) or "one rank"
        before, after = layout(saved.get("parallel", {})), layout(vars(now.parallel))
        if before != after:
            self.log(f"checkpoint: saved under {before}, resumed under {after}: the data position is global "
                     f"({consumed:,} sequences consumed), so the ranks read on in the same order and no sequence "
                     "is repeated or skipped")
        old_batch = saved.get("training", {}).get("batch_tokens")
        if old_batch is not None and old_batch != now.training.batch_tokens:
            self.log(f"warning: training.batch_tokens was {old_batch:,} when this checkpoint was saved, now "
                     f"{now.training.batch_tokens:,}: the data goes on from sequence {consumed:,} of the same order "
                     "(none repeated or skipped); steps and the learning-rate schedule go on counting optimizer "
                     "steps, each of the new size")

    def _nothing_to_resume(self) -> None:
        corrupt = [n for n in self.storage.names() if n.startswith("corrupt-step-")]
        if corrupt:
            raise CheckpointError(
                f"checkpoint.dir {str(self.storage)!r} holds only checkpoints that failed verification "
                f"({', '.join(corrupt)}); delete them to start this run over, or inspect them first")
        self.log("checkpoint: resume=auto found no checkpoint; starting from step 0")
        self._fresh_start()

    def _fresh_start(self, weights=None) -> None:
        """Step 0: the weights of `weights` or model.init_from if given (no optimizer state, no run state)."""
        self._trim_metrics(-1)  # drop records of an earlier attempt
        weights = weights or self.init_from
        if weights is not None:
            ckpt = self._load_weights(weights)
            self.log(f"checkpoint: starting at step 0 from the weights of {ckpt}")

    def _load_weights(self, weights):
        """The model's weights from a checkpoint; under LoRA only the model's own (the adapters are
        new, B = 0, or come from the run's checkpoint)."""
        select = (lambda name: not is_adapter(name)) if self.cfg.lora.rank > 0 else None
        return self.checkpointer.load(weights, ModelState(self.model_state.model, select=select))


    def _trim_metrics(self, last_step: int) -> None:
        if self.is_main:
            truncate_metrics(self.run_dir, last_step)

    def after_step(self, step: int, stop_at: int) -> Location | None:
        """Save every `interval` steps and when this invocation stops. Returns the checkpoint when it
        is already whole (a synchronous or final save), else None."""
        if not ((self.interval > 0 and step % self.interval == 0) or step == stop_at):
            return None
        self._collect(final=False)
        pending = self.checkpointer.save(step, self.model_state, self.train_state, self.files())
        if step != stop_at and self.checkpointer.asynchronous and not pending.refused:
            return None
        outcome = self._collect(final=step == stop_at)
        return outcome.location if outcome is not None and outcome.error is None else None

    def _collect(self, final: bool) -> SaveOutcome | None:
        """The outcome of the save in flight, acted on: logged; fatal → stop; last save failed → stop."""
        outcome = self.checkpointer.wait()
        if outcome is None:
            return None
        if outcome.error is None:
            self.last = outcome.location
            self.log(f"checkpoint: saved step {outcome.step} to {outcome.location}")
            self.log.event("checkpoint", outcome.step, path=str(outcome.location))  # for the trackers (W&B)
            return outcome
        if outcome.fatal:
            raise CheckpointStorageError(f"{outcome.error}; training stopped at step {self.train_state.step} "
                                         f"(last good checkpoint: {self.last or 'none'})")
        if final:
            raise CheckpointError(f"the last checkpoint (step {outcome.step}) could not be written: {outcome.error}; "
                                  f"last good checkpoint: {self.last or 'none'}")
        self.log(f"checkpoint: saving step {outcome.step} failed, training goes on and the next interval tries "
                 f"again (last good checkpoint: {self.last or 'none'}): {outcome.error}")
        return outcome

    def before_update(self) -> None:
        """Called before the optimizer changes the weights: an asynchronous save copies them out in
        the background while forward and backward run, and must have finished copying."""
        self.checkpointer.before_update()

    def rollback(self, before_step: int) -> int | None:
        """Load the newest verified checkpoint older than `before_step` (for the stability guard);
        returns its step, or None when there is none."""
        self._collect(final=False)
        path = self.checkpointer.newest_verified(before_step=before_step)
        if path is None:
            return None
        self.checkpointer.load(path, self.model_state, self.train_state, verified=True)
        return self.train_state.step

    def close(self) -> None:
        """At the end: a save still in flight (training ended early, by an error) is let finish,
        without any collective since other ranks may be gone; then the staging buffers are freed."""
        outcome = self.checkpointer.abandon_wait()
        if outcome is not None and outcome.error is None:
            self.log(f"checkpoint: saved step {outcome.step} to {outcome.location}")
        self.checkpointer.close()


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
