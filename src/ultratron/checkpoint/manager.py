"""The one owner of checkpoints: every save and every load of ultratron goes through here.

One format for every layout, one process or many: `dcp/` holds the model (and optimizer) as a
`torch.distributed.checkpoint` of name-keyed tensors with their global shapes, which loads into
any other layout; `state.pt` holds the run's own state (step, data-loader position, RNG), written
by rank 0; `config.toml` and `tokenizer.json` make the directory self-contained, so evaluation,
serving and export need nothing else; `manifest.json` holds every file's size and SHA-256
(verify.py), checked before a load. Directory conventions and atomicity: `store.py`; local disk
or an object store: `storage.py`.

A save is synchronous or asynchronous. Asynchronous: DCP's `async_save` copies the tensors into
host memory (the "staging" copy) and returns; a background thread writes them, then rank 0
writes state.pt, the manifest and the marker. Training goes on meanwhile. The background
collectives run on a gloo group of their own (`checkpoint_group`), so they never interleave with
the training loop's collectives on the default group (the PyTorch DCP async-save guidance).
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import warnings
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ultratron.checkpoint.state import ModelState
from ultratron.checkpoint.storage import Location, Storage, first_oserror, space_problem
from ultratron.checkpoint.store import CheckpointRoot, begin, commit, resolve_checkpoint_dir, step_of
from ultratron.checkpoint.verify import has_manifest, manifest_bytes, read_manifest, verify, write_manifest
from ultratron.errors import CheckpointError, CheckpointStorageError

DCP_DIR = "dcp"
STATE_FILE = "state.pt"
# DCP warns whenever it runs without a process group; in one process that is intended here (the
# asynchronous path warns from its own thread, where a catch_warnings block cannot reach).
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _cause(err: BaseException) -> str:
    """The underlying error's own line: DCP's message is a header, then each rank's traceback."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


@contextmanager
def _one_process_is_intended():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _stager():
    """The host-memory staging of asynchronous saves, kept for the run: its buffers are allocated at
    the first save and reused by the next (a fresh allocation each time costs page faults, which on
    CPU dominate the copy). Pinned memory where there is a GPU, for fast device-to-host copies.
    Reuse is safe because at most one save is in flight. The copy itself runs in a background
    thread too (`use_async_staging`): the next step's forward and backward only read the weights,
    so the loop waits for the copy only before its next optimizer update (`PendingSave.wait_staged`)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=False))


def checkpoint_group():
    """The gloo process group every checkpoint collective runs on (None in one process). Every
    rank must call this at the same point, since creating a group is collective."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def _is_sharded(state) -> bool:
    if isinstance(state, dict):
        return any(_is_sharded(v) for v in state.values())
    if isinstance(state, list | tuple):
        return any(_is_sharded(v) for v in state)
    return hasattr(state, "to_local")


def _local_bytes(state) -> int:
    """Bytes of the tensors this rank holds in a state dict (a DTensor counts its local shard)."""
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_local_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


@dataclass
class SaveOutcome:
    step: int
    location: Location
    error: str | None = None  # None: saved and committed
    fatal: bool = False  # the storage cannot take checkpoints (full, read-only): stop training


class PendingSave:
    """A save that may still be writing. `wait()` (every rank, at the same point) returns its outcome."""

    def __init__(self, step: int, final: Location, future: Future, group=None, refused: bool = False,
                 staged: Future | None = None):
        self.step, self.final, self._future, self._group = step, final, future, group
        self.refused = refused  # failed before writing anything (known on every rank at once)
        self._staged = staged  # done once the tensors are copied out (None: copied before returning)
        self._outcome: SaveOutcome | None = None

    def wait_staged(self) -> None:
        """Block until the tensors being saved have been copied to host memory, after which the
        weights and optimizer state may change again. A failed copy shows in `wait()`'s outcome."""
        if self._staged is not None:
            self._staged.exception()  # waits; the error itself reaches the outcome through the upload
            self._staged = None

    def wait(self, collective: bool = True) -> SaveOutcome:
        """The outcome; `collective` (every rank calls it together): every rank's failures count."""
        if self._outcome is None:
            error = self._future.exception()
            local = None if error is None else (isinstance(error, CheckpointStorageError), _cause(error))
            if collective and dist.is_initialized():  # every rank learns every rank's outcome: they act alike
                everyone: list = [None] * dist.get_world_size(self._group)
                dist.all_gather_object(everyone, local, group=self._group)
                local = next((o for o in everyone if o is not None and o[0]), None) or next(
                    (o for o in everyone if o is not None), None)
            self._outcome = SaveOutcome(self.step, self.final, None if local is None else local[1],
                                        bool(local and local[0]))
        return self._outcome

    def result(self) -> Location:
        """Wait; raise CheckpointError if the save failed."""
        outcome = self.wait()
        if outcome.error is not None:
            raise CheckpointError(outcome.error)
        return outcome.location


def _failure(storage: Storage, err: BaseException, needed: int, final: Location) -> BaseException:
    """The error a failed save reports: one clear line, marked fatal when the storage is full or
    read-only (nothing later can succeed there), else naming the storage's own error."""
    problem = space_problem(storage, first_oserror(err), needed)
    if problem is not None:
        return CheckpointStorageError(problem)
    return CheckpointError(f"saving {final} failed: {_cause(first_oserror(err))}")


def write_checkpoint(final: Location, step: int, model: ModelState, train_state: Stateful | None = None,
                     files: dict[str, str] | None = None, *, root: CheckpointRoot | None = None, group=None,
                     blocking: bool = True, needed: int | None = None, on_commit=None, stager=None,
                     planner=None) -> PendingSave:
    """Write one checkpoint atomically. Every rank calls this. `blocking=False` returns as soon as
    the tensors are copied to host memory and writes in the background; either way the returned
    `PendingSave` tells how it went. `on_commit(final)` runs on rank 0 once the checkpoint is whole
    (the `latest` pointer and retention). `needed`: the expected size, for the free-space check.
    `stager`: a DCP stager kept across saves, so the host-memory copy reuses its buffers. A `planner`
    (a DCP SavePlanner) may produce each tensor only when it is written: the Hugging Face import
    streams a model larger than memory that way, one file per tensor, so each is freed once written
    (in one file per rank DCP would keep them all until the file is done); such saves block."""
    root = root or CheckpointRoot(Path(final).parent if isinstance(final, Path) else final.rsplit("/", 1)[0])
    storage = root.storage
    tag = "sharded" if dist.is_initialized() else str(os.getpid())
    tmp = root.staging_for(final, tag)
    state = {"app": model.state_dict()}
    # the expected size, before a previous checkpoint tells it: replicated tensors are written once,
    # sharded ones (DTensor) by every rank
    needed = needed or _local_bytes(state) * (dist.get_world_size() if dist.is_initialized() and _is_sharded(state)
                                              else 1)
    early = None
    if _is_main():  # refuse before writing a byte when the disk is too full; then make the directory
        early = space_problem(storage, None, needed)
        try:
            if early is None:
                root.begin(final, tag)
        except Exception as err:  # an object store that is down, a directory that cannot be made
            failure = _failure(storage, err, needed, final)
            early = (isinstance(failure, CheckpointStorageError), str(failure))
        early = (True, early) if isinstance(early, str) else early
    if dist.is_initialized():  # every rank learns whether the save starts (also a barrier)
        verdict = [early]
        dist.broadcast_object_list(verdict, src=0, group=group)
        early = verdict[0]
    future: Future = Future()
    if early is not None:
        fatal, message = early
        future.set_exception(CheckpointStorageError(message) if fatal else CheckpointError(message))
        return PendingSave(step, final, future, group, refused=True)
    extra: dict[str, bytes] = {}
    if _is_main():
        if train_state is not None:
            buffer = io.BytesIO()
            torch.save(train_state.state_dict(), buffer)  # captured now: training changes it next step
            extra[STATE_FILE] = buffer.getvalue()
        extra |= {name: text.encode("utf-8") for name, text in (files or {}).items()}
    writer = storage.dcp_writer(storage.join(tmp, DCP_DIR), single_file_per_rank=planner is None)

    def finish(upload) -> Location:
        """Wait for the tensors (`upload()`), then rank 0 adds the rest, the manifest and the marker."""
        try:
            upload()
            if _is_main():
                for name, data in extra.items():
                    storage.write_bytes(storage.join(tmp, name), data)
                write_manifest(storage, tmp, step)
                root.commit(tmp, final, step)
                if on_commit is not None:
                    on_commit(final)
            return final
        except (Exception, CheckpointException) as err:  # DCP raises a BaseException per failed rank
            if _is_main():
                with suppress(Exception):  # the storage may be unreachable now; cleaned at the next start
                    root.abandon(tmp)
            raise _failure(storage, err, needed, final) from None

    def settle(upload) -> None:
        try:
            future.set_result(finish(upload))
        except CheckpointError as err:
            future.set_exception(err)
        except BaseException as err:  # noqa: B036 (whatever happens, the future resolves: no one waits forever)
            future.set_exception(CheckpointError(f"saving {final} failed: {type(err).__name__}: {err}"))

    if blocking or planner is not None:
        with _one_process_is_intended():
            settle(lambda: dcp.save(state, storage_writer=writer, process_group=group, planner=planner))
        return PendingSave(step, final, future, group)
    try:
        response = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)
    except (Exception, CheckpointException) as err:  # the staging copy itself failed (host memory)
        settle(partial(_reraise, err))
        return PendingSave(step, final, future, group)
    # with a background copy DCP answers with two futures: the copy, and the upload after it
    staged, upload = (response.staging_completion, response.upload_completion) if hasattr(
        response, "upload_completion") else (None, response)
    threading.Thread(target=settle, args=(upload.result,), name=f"checkpoint-step-{step}", daemon=True).start()
    return PendingSave(step, final, future, group, staged=staged)


def _reraise(err: BaseException):
    raise err


def read_checkpoint(path: Location, model: ModelState, train_state: Stateful | None = None, *,
                    storage: Storage | None = None, verified: bool = False) -> Location:
    """Load a checkpoint (a step, run or checkpoints directory) into `model` — whatever layout it
    was written under — and `train_state`. Every rank calls this; returns the checkpoint directory.
    Its manifest is checked first (rank 0 hashes, every rank learns the verdict) unless the caller
    has just done so (`verified`)."""
    if storage is None:
        ckpt = resolve_checkpoint_dir(path)
        storage = Storage(ckpt.parent)
    else:
        ckpt = path
    if not storage.is_file(storage.join(ckpt, DCP_DIR, ".metadata")):
        old = storage.exists(storage.join(ckpt, "model.pt"))
        why = " (it holds model.pt: written by an older ultratron, whose format this one does not read)"
        raise CheckpointError(f"{ckpt}: no {DCP_DIR}/ weights{why if old else ''}")
    if not verified:
        problems = verify(storage, ckpt) if _is_main() else []
        if dist.is_initialized():
            box = [problems]
            dist.broadcast_object_list(box, src=0)
            problems = box[0]
        if problems:
            raise CheckpointError(f"{ckpt} failed verification: {'; '.join(problems)}")
    try:
        with _one_process_is_intended():
            dcp.load({"app": model}, storage_reader=storage.dcp_reader(storage.join(ckpt, DCP_DIR)))
    except (Exception, CheckpointException) as err:  # DCP wraps each rank's error (a BaseException)
        raise CheckpointError(f"{ckpt}: the saved weights do not fit this model ({_cause(err)})") from None
    if train_state is not None:
        file = storage.join(ckpt, STATE_FILE)
        if not storage.exists(file):
            raise CheckpointError(f"{ckpt} holds weights only (no {STATE_FILE}, e.g. an imported model), so there is "
                                  "no run to resume; start a run from it with --model.init_from")
        try:
            state = torch.load(io.BytesIO(storage.read_bytes(file)), map_location="cpu", weights_only=False)
        except Exception as err:  # torch raises several types for truncated or foreign files
            raise CheckpointError(f"{file}: cannot be read ({type(err).__name__}: {err})") from None
        train_state.load_state_dict(state)
    return ckpt


def holds_run_state(path: Location, storage: Storage | None = None) -> bool:
    """Whether a checkpoint carries a run's state (step, data position) besides its weights (an
    import does not). `storage`: where `path` lives, when it came from a run's checkpoint root."""
    if storage is None:
        return (resolve_checkpoint_dir(path) / STATE_FILE).is_file()
    return storage.is_file(storage.join(path, STATE_FILE))


class Checkpointer:
    """A run's checkpoints under `root` (a directory or an fsspec URL): save (at most one in
    flight), `latest` and retention, verified resume with fallback, cleanup of interrupted saves.
    Every rank constructs it at the same point (it makes the checkpoint process group)."""

    def __init__(self, root: str | Path, keep: int = 3, *, endpoint: str | None = None,
                 asynchronous: bool = False, log=None):
        self.root = CheckpointRoot(Storage(root, endpoint), keep)
        self.storage = self.root.storage
        self.asynchronous = asynchronous
        self.log = log or (lambda message: None)
        self.group = checkpoint_group()
        self.stager = _stager() if asynchronous else None
        self.pending: PendingSave | None = None
        self.verified: Location | None = None  # the newest checkpoint known to pass verification

    def latest(self) -> Location | None:
        return self.root.latest()

    # ---- start of a run ---------------------------------------------------------------------------
    def clean_stale(self) -> None:
        """Rank 0 removes what interrupted saves left (they may hold a disk full)."""
        if _is_main():
            for loc in self.root.clean_stale():
                self.log(f"checkpoint: removed {loc}, left by an interrupted save")
        _barrier(self.group)

    def newest_verified(self, before_step: int | None = None) -> Location | None:
        """The newest complete checkpoint (older than `before_step`, if given) that passes
        verification. Those that fail are reported and moved aside (never deleted: a person may
        want them); rank 0 decides for everyone."""
        chosen = None
        if _is_main():
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
        previous = read_manifest(self.storage, self.verified) if self.verified is not None and _is_main() else None
        self.pending = write_checkpoint(self.root.path_for(step), step, model, train_state, files, root=self.root,
                                        group=self.group, blocking=not self.asynchronous,
                                        needed=manifest_bytes(previous) or None, on_commit=self._committed,
                                        stager=self.stager)
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
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def abandon_wait(self) -> SaveOutcome | None:
        """Let the save in flight finish, with no collective (training failed; other ranks may be gone)."""
        if self.pending is None:
            return None
        outcome, self.pending = self.pending.wait(collective=False), None
        return outcome


def snapshot(dest: Path, step: int, files: dict[str, str], model: ModelState | None = None,
             source: Location | None = None) -> Path:
    """A weights-only checkpoint at `dest` for a reader in another process (periodic evaluation):
    hard links to the files of `source` (a checkpoint of this step on local disk, so pruning it
    later cannot pull them away), or else the model written out. One process only."""
    if not isinstance(source, Path) or not (source / DCP_DIR).is_dir():
        return write_checkpoint(dest, step, model, None, files).result()
    tmp = begin(dest, str(os.getpid()))
    for file in (source / DCP_DIR).iterdir():
        (tmp / DCP_DIR).mkdir(exist_ok=True)
        try:
            os.link(file, tmp / DCP_DIR / file.name)
        except OSError:
            shutil.copyfile(file, tmp / DCP_DIR / file.name)
    for name, text in files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    write_manifest(Storage(dest.parent), tmp, step)
    return commit(tmp, dest, step)


__all__ = ["Checkpointer", "ModelState", "PendingSave", "SaveOutcome", "checkpoint_group", "holds_run_state",
           "read_checkpoint", "resolve_checkpoint_dir", "snapshot", "step_of", "write_checkpoint"]
