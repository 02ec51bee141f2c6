"""Where checkpoints live and how one becomes visible: `ROOT/step-NNNNNNN/` plus a `latest` pointer,
on local disk or in an object store (storage.py).

Local disk: a checkpoint is written into a hidden temporary directory and renamed into place only
when every file is on disk (the manifest, then the `complete` marker, written last, before the
rename); then `latest` is replaced atomically and old checkpoints are pruned. An object store has
no rename: the checkpoint is written in place and the `complete` marker, one object PUT after
everything else, is what makes it visible. Either way a crash at any moment leaves the old
checkpoint or the new one, never half of one, and a directory without the marker is never read;
leftovers of an interrupted save are removed when the next run starts (`clean_stale`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ultratron.atomic import fsync, is_temp
from ultratron.checkpoint.storage import Location, Storage, name_of
from ultratron.checkpoint.verify import MARKER
from ultratron.errors import CheckpointError

LATEST = "latest"
DONE_MARKER = MARKER
TEMP_PREFIX = ".tmp-"
CORRUPT_PREFIX = "corrupt-"


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def fsync_tree(path: Path) -> None:
    """Flush every file under `path`, then the directories, so a rename publishes whole files."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync(Path(root))



def temp_dir_for(final: Path, tag: str) -> Path:
    return final.parent / f"{TEMP_PREFIX}{final.name}-{tag}"


def begin(final: Path, tag: str) -> Path:
    """A fresh, empty temporary directory that will become `final` (local disk)."""
    tmp = temp_dir_for(final, tag)
    final.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, final: Path, step: int) -> Path:
    """Publish the checkpoint written in `tmp` as `final` (local disk): the marker goes in last,
    every file is flushed to disk, and one directory rename then makes all of it visible at once.
    (A directory, not a file, so `atomic.py`'s file helper is not the tool; a re-save of the same
    step replaces the old one.)"""
    (tmp / DONE_MARKER).write_text(f"{step}\n")  # not yet visible: it is inside the temporary directory
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)  # the commit point
    fsync(final.parent)  # and the rename itself on disk
    return final


def is_complete(path: Path) -> bool:
    return (path / DONE_MARKER).is_file()


def step_of(path: Path) -> int | None:
    text = (path / DONE_MARKER).read_text().strip() if is_complete(path) else ""
    return int(text) if text.isdigit() else None


class CheckpointRoot:
    """The checkpoints of one run: writing one into place, listing, `latest`, retention, cleanup."""

    def __init__(self, root: str | Path | Storage, keep: int = 3):
        self.storage = root if isinstance(root, Storage) else Storage(root)
        self.root = self.storage.root
        self.keep = keep

    def path_for(self, step: int) -> Location:
        return self.storage.child(step_dir_name(step))

    def is_complete(self, ckpt: Location) -> bool:
        return self.storage.is_file(self.storage.join(ckpt, DONE_MARKER))

    def step_of(self, ckpt: Location) -> int | None:
        text = self.storage.read_text(self.storage.join(ckpt, DONE_MARKER)).strip() if self.is_complete(ckpt) else ""
        return int(text) if text.isdigit() else None

    def complete(self) -> list[Location]:
        names = [n for n in self.storage.names() if n.startswith("step-")]
        return [loc for n in names if self.is_complete(loc := self.storage.child(n))]

    def latest(self) -> Location | None:
        """The checkpoint `latest` names; if that one is gone or incomplete, the newest complete one."""
        pointer = self.storage.child(LATEST)
        if self.storage.is_file(pointer):
            candidate = self.storage.child(self.storage.read_text(pointer).strip())
            if self.is_complete(candidate):
                return candidate
        done = self.complete()
        return done[-1] if done else None

    # ---- writing one into place ------------------------------------------------------------------
    def staging_for(self, final: Location, tag: str) -> Location:
        """Where the files of `final` are written before it is committed (see `begin`)."""
        return temp_dir_for(final, tag) if isinstance(final, Path) else final

    def begin(self, final: Location, tag: str) -> Location:
        """Where the files of `final` are written: a fresh temporary directory on local disk; on an
        object store `final` itself, emptied first (its marker goes first, so it is never read half-replaced)."""
        if isinstance(final, Path):
            return begin(final, tag)
        self.storage.remove(self.storage.join(final, DONE_MARKER))
        self.storage.remove(final)
        return final

    def commit(self, tmp: Location, final: Location, step: int) -> Location:
        if isinstance(final, Path):
            return commit(tmp, final, step)
        self.storage.write_text(self.storage.join(final, DONE_MARKER), f"{step}\n")
        return final

    def abandon(self, tmp: Location) -> None:
        """Remove what a failed save left (on local disk the temporary directory, so a failed save
        cannot keep a disk full)."""
        self.storage.remove(tmp)

    def point_latest(self, final: Location) -> None:
        """`latest` names `final` (a whole file either way: atomic.py on disk, one PUT on an object store)."""
        self.storage.write_text(self.storage.child(LATEST), name_of(final) + "\n")

    # ---- retention and cleanup -------------------------------------------------------------------
    def prune(self, protect: Location | None = None) -> list[Location]:
        """Delete all but the `keep` newest complete checkpoints — never `protect` (the newest one
        known to pass verification, so a run of unverifiable saves cannot push out the last good one)."""
        done = self.complete()
        doomed = [p for p in done[: max(0, len(done) - self.keep)] if protect is None or str(p) != str(protect)]
        for path in doomed:
            self.storage.remove(path)
        return doomed

    def stale(self) -> list[Location]:
        """What interrupted saves left: temporary directories, and (object store) step directories
        that never got their marker."""
        names = self.storage.names()
        found = [self.storage.child(n) for n in names if n.startswith(TEMP_PREFIX) or is_temp(n)]
        if self.storage.remote:
            steps = [self.storage.child(n) for n in names if n.startswith("step-")]
            found += [loc for loc in steps if not self.is_complete(loc)]
        return found

    def clean_stale(self) -> list[Location]:
        """Remove `stale()`; call only when no save of this run is in flight (at start)."""
        found = self.stale()
        for loc in found:
            self.storage.remove(loc)
        return found

    def quarantine(self, ckpt: Location) -> Location | None:
        """Take a checkpoint that failed verification out of the rotation: renamed `corrupt-step-N`
        on local disk (kept for inspection; delete it by hand), its marker removed on an object store."""
        if isinstance(ckpt, Path):
            dest, n = ckpt.with_name(CORRUPT_PREFIX + ckpt.name), 1
            while dest.exists():
                dest, n = ckpt.with_name(f"{CORRUPT_PREFIX}{ckpt.name}.{n}"), n + 1
            os.replace(ckpt, dest)
            return dest
        self.storage.remove(self.storage.join(ckpt, DONE_MARKER))
        return None


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint directory, or a run / checkpoints directory whose latest one is meant (local disk)."""
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
