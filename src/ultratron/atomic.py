"""Files that appear whole or not at all. Whatever ultratron writes for another reader to find (a
checkpoint's small files, metrics, caches, reports, curated parts, token shards, an export) is
written under a temporary name beside its real one and renamed over it, which POSIX makes atomic:
a crash leaves the old file or the new one, at worst a temporary beside them, never half a file.
`is_temp` recognises such leftovers so that the next run can remove them.

A temporary is named `NAME.tmpPID` (`NAME.tmpPID.EXT` with `keep_suffix`, for writers that choose
the format by the extension or append their own, like `np.save` and `savefig`); the process id
keeps two processes writing the same file (the ranks of a run) out of each other's way.

`atomic_path` is the mechanism, for any writer that takes a path (a library's, or a whole
directory); `atomic_open` and the `write_*` functions are it for the common cases. Checkpoint
directories are published by their own protocol, with a marker and a `latest` pointer
(`checkpoint/store.py`). Torch-free and at the bottom of the layers: every package may use it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TEMP_NAME = re.compile(r"\.tmp\d*(\.\w+)?$")


def temp_path(path: str | os.PathLike, keep_suffix: bool = False) -> Path:
    """Where `path` is written before it is renamed into place."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}{path.suffix if keep_suffix else ''}")


def is_temp(name: str) -> bool:
    """Whether a file name is one of `temp_path`'s (or of the `NAME.tmp` the project wrote before it)."""
    return TEMP_NAME.search(name) is not None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def cache_dir(*parts: str) -> Path:
    """Where ultratron keeps what it can always make again: `$XDG_CACHE_HOME/ultratron/PARTS`, or
    `~/.cache/ultratron/PARTS` (curation's staging, the built-in suite's tasks)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "ultratron", *parts)


def fsync(path: Path) -> None:
    """Flush a file's or a directory's entries (a rename's) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, *, keep_suffix: bool = False, durable: bool = False) -> Iterator[Path]:
    """A temporary sibling of `path` for the block to write (a file, or a directory); when the
    block ends it replaces `path` (an existing file, or an empty directory), and if the block
    raises it is removed instead. `durable`: the file is flushed to disk before the rename and the
    rename after it, for what must survive a power loss, not only a crash of this process."""
    path = Path(path)
    tmp = temp_path(path, keep_suffix)
    if tmp.exists() or tmp.is_symlink():  # left by an earlier process that had this id
        _remove(tmp)
    try:
        yield tmp
        if durable and tmp.is_file():
            fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    if durable:
        fsync(path.parent)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, durable: bool = False) -> Iterator[IO]:
    """`open(path, mode)` for writing, published atomically when the block ends (see `atomic_path`).
    Text is UTF-8."""
    with atomic_path(path, durable=durable) as tmp, open(tmp, mode, encoding=None if "b" in mode else "utf-8") as fh:
        yield fh


def write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = False) -> None:
    with atomic_open(path, "wb", durable=durable) as fh:
        fh.write(data)


def write_text(path: str | os.PathLike, text: str, *, durable: bool = False) -> None:
    with atomic_open(path, "w", durable=durable) as fh:
        fh.write(text)


def write_json(path: str | os.PathLike, obj: Any, *, durable: bool = False, **dumps_options) -> None:
    """`obj` as JSON (`json.dumps` with `dumps_options`, e.g. indent), one newline at the end."""
    write_text(path, json.dumps(obj, **dumps_options) + "\n", durable=durable)
