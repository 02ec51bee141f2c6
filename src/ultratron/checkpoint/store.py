"""Where checkpoints live and how one becomes visible: `ROOT/step-NNNNNNN/` plus a `latest` pointer.

A checkpoint is written into a hidden temporary directory and renamed into place only when
every file is on disk (the `complete` marker is written last, before the rename); then `latest`
is replaced atomically and old checkpoints are pruned. A crash at any moment leaves the old
checkpoint or the new one, never half of one, and a directory without the marker is never read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ultratron.errors import CheckpointError

LATEST = "latest"
DONE_MARKER = "complete"


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def fsync_tree(path: Path) -> None:
    """Flush every file under `path`, then the directories, so a rename publishes whole files."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_dir_for(final: Path, tag: str) -> Path:
    return final.parent / f".tmp-{final.name}-{tag}"


def begin(final: Path, tag: str) -> Path:
    """A fresh, empty temporary directory that will become `final`."""
    tmp = temp_dir_for(final, tag)
    final.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, final: Path, step: int) -> Path:
    """Mark `tmp` complete and rename it to `final` (replacing a checkpoint of the same step)."""
    (tmp / DONE_MARKER).write_text(f"{step}\n")
    fsync_tree(tmp)
    if final.exists():  # a re-save of the same step replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def is_complete(path: Path) -> bool:
    return (path / DONE_MARKER).is_file()


def step_of(path: Path) -> int | None:
    text = (path / DONE_MARKER).read_text().strip() if is_complete(path) else ""
    return int(text) if text.isdigit() else None


class CheckpointRoot:
    """The checkpoints of one run: listing, the `latest` pointer and retention."""

    def __init__(self, root: str | Path, keep: int = 3):
        self.root = Path(root)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob("step-*") if is_complete(p)), key=lambda p: p.name)

    def latest(self) -> Path | None:
        """The checkpoint `latest` names; if that one is gone or incomplete, the newest complete one."""
        pointer = self.root / LATEST
        if pointer.is_file():
            candidate = self.root / pointer.read_text().strip()
            if is_complete(candidate):
                return candidate
        done = self.complete()
        return done[-1] if done else None

    def point_latest(self, final: Path) -> None:
        tmp = self.root / f".{LATEST}.tmp"
        tmp.write_text(final.name + "\n")
        os.replace(tmp, self.root / LATEST)
        fsync_dir(self.root)

    def prune(self) -> None:
        done = self.complete()
        for path in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint directory, or a run / checkpoints directory whose latest one is meant."""
    path = Path(path)
    if is_complete(path):
        return path
    for root in (path, path / "checkpoints"):
        found = CheckpointRoot(root).latest() if root.is_dir() else None
        if found is not None:
            return found
    if path.name == LATEST and path.parent.is_dir():
        found = CheckpointRoot(path.parent).latest()
        if found is not None:
            return found
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    raise CheckpointError(f"{path}: not a complete checkpoint (no '{DONE_MARKER}' marker) and holds none")
