"""The one owner of checkpoint files: every checkpoint of ultratron is written by
`CheckpointWriter.write` and read by `read_checkpoint`, both here.

One format for every layout, one process or many: `dcp/` holds the model (and optimizer) as a
`torch.distributed.checkpoint` of name-keyed tensors with their global shapes, which loads into
any other layout; `state.pt` holds the run's own state (step, data-loader position, RNG), written
by rank 0; `config.toml` and `tokenizer.json` make the directory self-contained, so evaluation,
serving and export need nothing else; `manifest.json` holds every file's size and SHA-256
(verify.py), checked before a load. Directory conventions and atomicity: `store.py`; local disk
or an object store: `storage.py`; a run's rotation of checkpoints: `checkpointer.py`.

A write puts the tensors down in one of three ways (`WriteOptions`): blocking, from memory (the
default); in the background, where DCP's `async_save` copies them into host memory (the "staging"
copy) and returns while a thread writes them, so training goes on; or streaming, where a DCP save
planner produces each tensor only as it is written (the Hugging Face import). A snapshot of a
step just saved hard-links that checkpoint's tensor files instead (`link_from`). Then, whichever
way, rank 0 writes state.pt and the files, the manifest and the marker, the directory is
published, and `on_commit` runs. Background collectives run on a gloo group of their own
(`checkpoint_group`), so they never interleave with the training loop's collectives on the
default group (the PyTorch DCP async-save guidance).
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ultratron.checkpoint.state import ModelState
from ultratron.checkpoint.storage import Location, Storage, first_oserror, space_problem
from ultratron.checkpoint.store import CheckpointRoot, resolve_checkpoint_dir
from ultratron.checkpoint.verify import verify, write_manifest
from ultratron.errors import CheckpointError, CheckpointStorageError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import SavePlanner

DCP_DIR = "dcp"
STATE_FILE = "state.pt"
# DCP warns whenever it runs without a process group; in one process that is intended here (the
# asynchronous path warns from its own thread, where a catch_warnings block cannot reach).
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _cause(err: BaseException) -> str:
    """The underlying error's own line: DCP's message is a header, then each rank's traceback."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@contextmanager
def _one_process_is_intended():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _stager():
    """The host-memory staging of background writes, kept across writes: its buffers are allocated
    at the first one and reused by the next (a fresh allocation each time costs page faults, which on
    CPU dominate the copy). Pinned memory where there is a GPU, for fast device-to-host copies.
    Reuse is safe because at most one write is in flight. The copy itself runs in a background
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


@dataclass(frozen=True)
class WriteOptions:
    """How a write puts the tensors down; the default is blocking, from the tensors in memory."""

    background: bool = False  # return once they are copied to host memory; a thread writes them
    planner: SavePlanner | None = None  # a DCP SavePlanner producing each tensor only as it is written; blocks
    link_from: Location | None = None  # a local checkpoint of the same weights: hard-link its tensor files
    expected_bytes: int | None = None  # what the free-space check expects (default: the tensors' own size)

    def __post_init__(self):
        if self.background + (self.planner is not None) + (self.link_from is not None) > 1:
            raise ValueError("background, planner and link_from are three ways to write: choose one")


def _link_tensors(source: Path, tmp: Path) -> None:
    """`source`'s tensor files hard-linked into `tmp` (so pruning `source` later cannot pull them
    away), copied where a link cannot be made (another filesystem)."""
    (tmp / DCP_DIR).mkdir(exist_ok=True)
    for file in (source / DCP_DIR).iterdir():
        try:
            os.link(file, tmp / DCP_DIR / file.name)
        except OSError:
            shutil.copyfile(file, tmp / DCP_DIR / file.name)


class CheckpointWriter:
    """Writes checkpoints into `root`, each whole or not at all: the trainer's saves, the periodic
    evaluator's snapshots, the Hugging Face import. Every rank makes one (with the same `group`)
    and calls `write` at the same point. `on_commit(final)` runs on rank 0 once a checkpoint is
    whole (the `latest` pointer, retention). The writer keeps background writes' staging buffers
    from one write to the next; `close()` frees them."""

    def __init__(self, root: CheckpointRoot, *, group=None, on_commit: Callable[[Location], None] | None = None):
        self.root, self.storage, self.group, self.on_commit = root, root.storage, group, on_commit
        self._stager = None

    def write(self, step: int, model: Stateful, run_state: Stateful | None = None,
              files: dict[str, str] | None = None, options: WriteOptions = WriteOptions()) -> PendingSave:
        """Write checkpoint `step` of `root`: `model`'s tensors, `run_state` (state.pt) and `files`
        (name → text). Returns at once for a background write, else when it is done; the
        `PendingSave` tells how it went."""
        final = self.root.path_for(step)
        tag = "sharded" if dist.is_initialized() else str(os.getpid())
        tmp = self.root.staging_for(final, tag)
        source = options.link_from
        linking = isinstance(final, Path) and isinstance(source, Path) and (source / DCP_DIR).is_dir()
        state = None if linking else {"app": model.state_dict()}
        # the expected size, before a previous checkpoint tells it: replicated tensors are written
        # once, sharded ones (DTensor) by every rank; links take no space
        needed = 0 if linking else options.expected_bytes or _local_bytes(state) * (
            dist.get_world_size() if dist.is_initialized() and _is_sharded(state) else 1)
        future: Future = Future()
        refusal = self._begin(final, tag, needed)
        if refusal is not None:
            fatal, message = refusal
            future.set_exception(CheckpointStorageError(message) if fatal else CheckpointError(message))
            return PendingSave(step, final, future, self.group, refused=True)
        extra: dict[str, bytes] = {}
        if is_main():
            if run_state is not None:
                buffer = io.BytesIO()
                torch.save(run_state.state_dict(), buffer)  # captured now: training changes it next step
                extra[STATE_FILE] = buffer.getvalue()
            extra |= {name: text.encode("utf-8") for name, text in (files or {}).items()}

        def settle(upload: Callable) -> None:
            """Wait for the tensors and finish the checkpoint; whatever happens, `future` resolves."""
            try:
                future.set_result(self._finish(final, tmp, step, extra, needed, upload))
            except CheckpointError as err:
                future.set_exception(err)
            except BaseException as err:  # noqa: B036 (no one may wait forever)
                future.set_exception(CheckpointError(f"saving {final} failed: {type(err).__name__}: {err}"))

        if linking:
            settle(partial(_link_tensors, source, tmp) if is_main() else lambda: None)
            return PendingSave(step, final, future, self.group)
        writer = self.storage.dcp_writer(self.storage.join(tmp, DCP_DIR), single_file_per_rank=options.planner is None)
        if not options.background:
            with _one_process_is_intended():
                settle(lambda: dcp.save(state, storage_writer=writer, process_group=self.group,
                                        planner=options.planner))
            return PendingSave(step, final, future, self.group)
        self._stager = self._stager or _stager()
        try:
            response = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                      async_stager=self._stager)
        except (Exception, CheckpointException) as err:  # the staging copy itself failed (host memory)
            settle(partial(_reraise, err))
            return PendingSave(step, final, future, self.group)
        # with a background copy DCP answers with two futures: the copy, and the upload after it
        staged, upload = (response.staging_completion, response.upload_completion) if hasattr(
            response, "upload_completion") else (None, response)
        threading.Thread(target=settle, args=(upload.result,), name=f"checkpoint-step-{step}", daemon=True).start()
        return PendingSave(step, final, future, self.group, staged=staged)

    def _begin(self, final: Location, tag: str, needed: int) -> tuple[bool, str] | None:
        """Rank 0 refuses before writing a byte when the disk is too full, else makes the directory;
        every rank learns the verdict (None: go on; else whether fatal, and why)."""
        refusal = None
        if is_main():
            problem = space_problem(self.storage, None, needed)
            if problem is not None:
                refusal = (True, problem)
            else:
                try:
                    self.root.begin(final, tag)
                except Exception as err:  # an object store that is down, a directory that cannot be made
                    failure = _failure(self.storage, err, needed, final)
                    refusal = (isinstance(failure, CheckpointStorageError), str(failure))
        if dist.is_initialized():  # also a barrier: nobody writes before the directory exists
            verdict = [refusal]
            dist.broadcast_object_list(verdict, src=0, group=self.group)
            refusal = verdict[0]
        return refusal

    def _finish(self, final: Location, tmp: Location, step: int, extra: dict[str, bytes], needed: int,
                upload: Callable) -> Location:
        """Wait for the tensors (`upload()`), then rank 0 adds the rest, the manifest and the marker,
        and publishes the checkpoint."""
        try:
            upload()
            if is_main():
                for name, data in extra.items():
                    self.storage.write_bytes(self.storage.join(tmp, name), data)
                write_manifest(self.storage, tmp, step)
                self.root.commit(tmp, final, step)
                if self.on_commit is not None:
                    self.on_commit(final)
            return final
        except (Exception, CheckpointException) as err:  # DCP raises a BaseException per failed rank
            if is_main():
                with suppress(Exception):  # the storage may be unreachable now; cleaned at the next start
                    self.root.abandon(tmp)
            raise _failure(self.storage, err, needed, final) from None

    def close(self) -> None:
        """Free the staging buffers (after the last write has been waited for)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


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
        problems = verify(storage, ckpt) if is_main() else []
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


__all__ = ["CheckpointWriter", "ModelState", "PendingSave", "SaveOutcome", "WriteOptions", "checkpoint_group",
           "holds_run_state", "read_checkpoint"]
