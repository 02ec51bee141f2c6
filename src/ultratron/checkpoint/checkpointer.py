"""A run's checkpoints under one root: saves (at most one in flight), `latest` and retention,
resume from the newest checkpoint that passes verification (moving damaged ones aside), cleanup
of what interrupted saves left. The files themselves are written and read by `manager.py`."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ultratron.checkpoint.manager import (
    CheckpointWriter,
    ModelState,
    PendingSave,
    SaveOutcome,
    WriteOptions,
    checkpoint_group,
    is_main,
    read_checkpoint,
)
from ultratron.checkpoint.storage import Location, Storage
from ultratron.checkpoint.store import CheckpointRoot
from ultratron.checkpoint.verify import has_manifest, manifest_bytes, read_manifest, verify


class Checkpointer:
    """A run's checkpoints under `root` (a directory or an fsspec URL). Every rank constructs it at
    the same point (it makes the checkpoint process group)."""

    def __init__(self, root: str | Path, keep: int = 3, *, endpoint: str | None = None,
                 asynchronous: bool = False, log=None):
        self.root = CheckpointRoot(Storage(root, endpoint), keep)
        self.storage = self.root.storage
        self.asynchronous = asynchronous
        self.log = log or (lambda message: None)
        self.group = checkpoint_group()
        self.writer = CheckpointWriter(self.root, group=self.group, on_commit=self._committed)
        self.pending: PendingSave | None = None
        self.verified: Location | None = None  # the newest checkpoint known to pass verification

    def latest(self) -> Location | None:
        return self.root.latest()

    # ---- start of a run ---------------------------------------------------------------------------
    def clean_stale(self) -> None:
        """Rank 0 removes what interrupted saves left (they may hold a disk full)."""
        if is_main():
            for loc in self.root.clean_stale():
                self.log(f"checkpoint: removed {loc}, left by an interrupted save")
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def newest_verified(self, before_step: int | None = None) -> Location | None:
        """The newest complete checkpoint (older than `before_step`, if given) that passes
        verification. Those that fail are reported and moved aside (never deleted: a person may
        want them); rank 0 decides for everyone."""
        chosen = None
        if is_main():
            done = self.root.complete()
            if before_step is not None:
                done = [c for c in done if (self.root.step_of(c) or 0) < before_step]
            for ckpt in reversed(done):
                problems = verify(self.storage, ckpt)
                if not problems:
                    if not has_manifest(self.storage, ckpt):
                        self.log(f"checkpoint: {ckpt} has no manifest (written before checksums); loading unverified")
                    chosen = ckpt
                    break
                moved = self.root.quarantine(ckpt)
                where = f"; moved to {moved}" if moved is not None else "; its marker removed"
                self.log(f"checkpoint: {ckpt} failed verification, skipped{where}: {'; '.join(problems)}")
        if dist.is_initialized():
            box = [chosen]
            dist.broadcast_object_list(box, src=0, group=self.group)
            chosen = box[0]
        return chosen

    def load(self, path: Location, model: ModelState, train_state: Stateful | None = None,
             verified: bool = False) -> Location:
        self.before_update()  # loading overwrites the tensors a save in flight may still be copying
        if isinstance(path, str) and self.storage.remote:
            ckpt = read_checkpoint(path, model, train_state, storage=self.storage, verified=verified)
        else:
            ckpt = read_checkpoint(path, model, train_state, verified=verified)
        self.verified = ckpt
        return ckpt

    # ---- saving -----------------------------------------------------------------------------------
    def save(self, step: int, model: ModelState, train_state: Stateful, files: dict[str, str]) -> PendingSave:
        """Start a save (first waiting for the one in flight: see `wait`). Asynchronous unless configured not to."""
        if self.pending is not None and (outcome := self.wait()).error is not None:
            self.log(f"checkpoint: saving step {outcome.step} failed: {outcome.error}")
        # the last verified checkpoint's size predicts this one's, for the free-space check
        previous = read_manifest(self.storage, self.verified) if self.verified is not None and is_main() else None
        options = WriteOptions(background=self.asynchronous, expected_bytes=manifest_bytes(previous) or None)
        self.pending = self.writer.write(step, model, train_state, files, options)
        return self.pending

    def before_update(self) -> None:
        """Before the weights or optimizer state change (the optimizer step, a load): the save in
        flight must have copied them out."""
        if self.pending is not None:
            self.pending.wait_staged()

    def _committed(self, final: Location) -> None:
        """Rank 0, when a checkpoint is whole: it is the one `latest` names, and retention runs."""
        self.root.point_latest(final)
        self.verified = final  # its checksums were computed from the bytes read back from storage
        self.root.prune(protect=final)

    def wait(self) -> SaveOutcome | None:
        """The outcome of the save in flight (None if there is none), once it has finished."""
        if self.pending is None:
            return None
        outcome, self.pending = self.pending.wait(), None
        if outcome.error is None:
            self.verified = outcome.location
        return outcome

    def close(self) -> None:
        """Free the staging buffers (after the last save has been waited for)."""
        self.writer.close()

    def abandon_wait(self) -> SaveOutcome | None:
        """Let the save in flight finish, with no collective (training failed; other ranks may be gone)."""
        if self.pending is None:
            return None
        outcome, self.pending = self.pending.wait(collective=False), None
        return outcome
