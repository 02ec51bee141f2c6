"""The one owner of checkpoints: every save and every load of ultratron goes through here.

One format for every layout, one process or many: `dcp/` holds the model (and optimizer) as a
`torch.distributed.checkpoint` of name-keyed tensors with their global shapes, which loads into
any other layout; `state.pt` holds the run's own state (step, data-loader position, RNG), written
by rank 0; `config.toml` and `tokenizer.json` make the directory self-contained, so evaluation,
serving and export need nothing else. Directory conventions and atomicity: `store.py`.
"""

from __future__ import annotations

import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ultratron.checkpoint.state import ModelState
from ultratron.checkpoint.store import CheckpointRoot, begin, commit, resolve_checkpoint_dir, step_of, temp_dir_for
from ultratron.errors import CheckpointError

DCP_DIR = "dcp"
STATE_FILE = "state.pt"


def _cause(err: BaseException) -> str:
    """The underlying error's own line: DCP's message is a header, then each rank's traceback."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def _one_process_is_intended():
    """DCP warns when no process group exists; reading or writing in one process is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def write_checkpoint(final: Path, step: int, model: Stateful, train_state: Stateful | None = None,
                     files: dict[str, str] | None = None, planner=None) -> Path:
    """Write one checkpoint directory atomically. Every rank calls this; returns `final`.

    `model` is a `ModelState`, or any Stateful with its state_dict's names and shapes. A `planner`
    (a DCP SavePlanner) may produce each tensor only when it is written: the Hugging Face import
    streams a model larger than memory that way, one file per tensor, so each tensor is freed
    once written (in one file DCP would keep them all until the file is done)."""
    tag = "sharded" if dist.is_initialized() else str(os.getpid())
    tmp = temp_dir_for(final, tag)
    if _is_main():
        begin(final, tag)
    _barrier()
    with _one_process_is_intended():
        if planner is None:
            dcp.save({"app": model}, checkpoint_id=str(tmp / DCP_DIR))
        else:
            writer = dcp.FileSystemWriter(str(tmp / DCP_DIR), single_file_per_rank=False)
            dcp.save({"app": model}, storage_writer=writer, planner=planner)
    if _is_main():
        if train_state is not None:
            torch.save(train_state.state_dict(), tmp / STATE_FILE)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        commit(tmp, final, step)
    _barrier()
    return final


def read_checkpoint(path: str | Path, model: ModelState, train_state: Stateful | None = None) -> Path:
    """Load a checkpoint (a step, run or checkpoints directory) into `model` — whatever layout it
    was written under — and `train_state`. Every rank calls this; returns the checkpoint directory."""
    ckpt = resolve_checkpoint_dir(path)
    if not (ckpt / DCP_DIR / ".metadata").is_file():
        old = " (it holds model.pt: written by an older ultratron, whose format this one does not read)"
        raise CheckpointError(f"{ckpt}: no {DCP_DIR}/ weights{old if (ckpt / 'model.pt').exists() else ''}")
    try:
        with _one_process_is_intended():
            dcp.load({"app": model}, checkpoint_id=str(ckpt / DCP_DIR))
    except (Exception, CheckpointException) as err:  # DCP wraps each rank's error (a BaseException)
        raise CheckpointError(f"{ckpt}: the saved weights do not fit this model ({_cause(err)})") from None
    if train_state is not None:
        file = ckpt / STATE_FILE
        if not file.exists():
            raise CheckpointError(f"{ckpt} holds weights only (no {STATE_FILE}, e.g. an imported model), so there is "
                                  "no run to resume; start a run from it with --model.init_from")
        try:
            state = torch.load(file, map_location="cpu", weights_only=False)
        except Exception as err:  # torch raises several types for truncated or foreign files
            raise CheckpointError(f"{file}: cannot be read ({type(err).__name__}: {err})") from None
        train_state.load_state_dict(state)
    return ckpt


def holds_run_state(path: str | Path) -> bool:
    """Whether a checkpoint carries a run's state (step, data position) besides its weights."""
    return (resolve_checkpoint_dir(path) / STATE_FILE).is_file()


class Checkpointer:
    """A run's checkpoints under `root`: save with `latest` and retention, load, find the latest."""

    def __init__(self, root: str | Path, keep: int = 3):
        self.root = CheckpointRoot(root, keep)

    def latest(self) -> Path | None:
        return self.root.latest()

    def save(self, step: int, model: ModelState, train_state: Stateful, files: dict[str, str]) -> Path:
        final = write_checkpoint(self.root.path_for(step), step, model, train_state, files)
        if _is_main():
            self.root.point_latest(final)
            self.root.prune()
        _barrier()
        return final

    def load(self, path: str | Path, model: ModelState, train_state: Stateful | None = None) -> Path:
        return read_checkpoint(path, model, train_state)


def snapshot(dest: Path, step: int, files: dict[str, str], model: ModelState | None = None,
             source: Path | None = None) -> Path:
    """A weights-only checkpoint at `dest` for a reader in another process (periodic evaluation):
    hard links to the files of `source` (a checkpoint of this step, so pruning it later cannot
    pull them away), or else the model written out. One process only."""
    if source is None or not (source / DCP_DIR).is_dir():
        return write_checkpoint(dest, step, model, None, files)
    tmp = begin(dest, str(os.getpid()))
    for file in (source / DCP_DIR).iterdir():
        (tmp / DCP_DIR).mkdir(exist_ok=True)
        try:
            os.link(file, tmp / DCP_DIR / file.name)
        except OSError:
            shutil.copyfile(file, tmp / DCP_DIR / file.name)
    for name, text in files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    return commit(tmp, dest, step)


__all__ = ["Checkpointer", "ModelState", "holds_run_state", "read_checkpoint", "resolve_checkpoint_dir", "snapshot",
           "step_of", "write_checkpoint"]
