"""Where checkpoint bytes live: a local directory, or any fsspec URL (`s3://bucket/prefix` on AWS or
on any S3-compatible server named by an endpoint URL; `gs://`, `az://`, ... where their fsspec
package is installed).

A location is a `Path` on local disk and a `str` URL elsewhere; `Storage` answers the few
questions the checkpoint code asks of either (exists, list, read, write, remove, free space) and
hands out the matching `torch.distributed.checkpoint` reader and writer. Local storage keeps the
POSIX guarantees the store relies on (fsync, atomic rename); an object store has no rename, so a
checkpoint is written in place there and its `complete` marker, written last, is what makes it
visible (see store.py).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ultratron import atomic
from ultratron.data.objstore import filesystem, is_url
from ultratron.errors import CheckpointError

Location = Path | str


__all__ = ["Location", "Storage", "is_url", "name_of", "gib", "space_problem", "first_oserror"]


def name_of(loc: Location) -> str:
    return str(loc).rstrip("/").rsplit("/", 1)[-1]


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GB" if n_bytes >= 2**30 / 100 else f"{n_bytes / 2**20:.1f} MB"


class Storage:
    """A checkpoint root and the filesystem it lives on."""

    def __init__(self, root: str | Path, endpoint: str | None = None):
        self.endpoint = endpoint or None
        self.remote = is_url(root)
        if self.remote:
            try:
                self.fs, self.options = filesystem(str(root), self.endpoint)
            except (ImportError, ValueError) as err:
                raise CheckpointError(f"checkpoint.dir {str(root)!r}: {err}") from None
            self.root: Location = str(root).rstrip("/")
        else:
            self.fs, self.options = None, {}
            self.root = Path(str(root).removeprefix("file://"))

    def __str__(self) -> str:
        return str(self.root)

    # ---- paths --------------------------------------------------------------------------------
    def join(self, loc: Location, *names: str) -> Location:
        if isinstance(loc, Path):
            return loc.joinpath(*names)
        return "/".join([loc.rstrip("/"), *names])

    def child(self, *names: str) -> Location:
        return self.join(self.root, *names)

    def _key(self, loc: Location) -> str:
        """The fsspec path of a URL (the protocol stripped, as fsspec's own methods return them)."""
        return self.fs._strip_protocol(str(loc))

    # ---- queries ------------------------------------------------------------------------------
    def exists(self, loc: Location) -> bool:
        return loc.exists() if isinstance(loc, Path) else self.fs.exists(self._key(loc))

    def is_file(self, loc: Location) -> bool:
        return loc.is_file() if isinstance(loc, Path) else self.fs.isfile(self._key(loc))

    def is_dir(self, loc: Location) -> bool:
        return loc.is_dir() if isinstance(loc, Path) else self.fs.isdir(self._key(loc))

    def names(self, loc: Location | None = None) -> list[str]:
        """The entries directly under `loc` (default: the root); [] if it does not exist."""
        loc = self.root if loc is None else loc
        if isinstance(loc, Path):
            return sorted(p.name for p in loc.iterdir()) if loc.is_dir() else []
        self.fs.invalidate_cache()  # another process (another rank, a restarted run) may have written
        try:
            return sorted(name_of(p) for p in self.fs.ls(self._key(loc), detail=False))
        except FileNotFoundError:
            return []

    def files(self, loc: Location) -> dict[str, int]:
        """Every file under `loc`, by path relative to it, with its size."""
        if isinstance(loc, Path):
            return {p.relative_to(loc).as_posix(): p.stat().st_size for p in sorted(loc.rglob("*")) if p.is_file()}
        base = self._key(loc).rstrip("/") + "/"
        self.fs.invalidate_cache()
        found = self.fs.find(self._key(loc), detail=True)
        return {path[len(base):]: int(info["size"]) for path, info in sorted(found.items())
                if info.get("type") != "directory"}

    def size(self, loc: Location) -> int:
        return loc.stat().st_size if isinstance(loc, Path) else int(self.fs.size(self._key(loc)))

    def free_bytes(self) -> int | None:
        """Free space where the root is (None for an object store, which reports none)."""
        if self.remote:
            return None
        probe = self.root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        return shutil.disk_usage(probe).free

    def device(self) -> str:
        """The mount point of a local root (what 'no space left on ...' names)."""
        if self.remote:
            return str(self.root)
        probe = self.root.resolve()
        while not probe.exists():
            probe = probe.parent
        while not os.path.ismount(probe):
            probe = probe.parent
        return str(probe)

    # ---- bytes --------------------------------------------------------------------------------
    def open(self, loc: Location, mode: str = "rb"):
        return open(loc, mode) if isinstance(loc, Path) else self.fs.open(self._key(loc), mode)

    def read_bytes(self, loc: Location) -> bytes:
        return loc.read_bytes() if isinstance(loc, Path) else self.fs.cat_file(self._key(loc))

    def read_text(self, loc: Location) -> str:
        return self.read_bytes(loc).decode("utf-8")

    def write_bytes(self, loc: Location, data: bytes) -> None:
        """Write a whole file. Local: under a temporary name, flushed, renamed (never half a file)."""
        if isinstance(loc, Path):
            atomic.write_bytes(loc, data, durable=True)
            return
        self.fs.pipe_file(self._key(loc), data)  # one PUT: an object appears whole or not at all

    def write_text(self, loc: Location, text: str) -> None:
        self.write_bytes(loc, text.encode("utf-8"))

    def mkdir(self, loc: Location) -> None:
        if isinstance(loc, Path):
            loc.mkdir(parents=True, exist_ok=True)  # object stores have no directories to make

    def remove(self, loc: Location) -> None:
        """Remove a file or a directory tree; missing is fine."""
        if isinstance(loc, Path):
            if loc.is_dir() and not loc.is_symlink():
                shutil.rmtree(loc, ignore_errors=True)
            else:
                loc.unlink(missing_ok=True)
            return
        try:
            self.fs.rm(self._key(loc), recursive=True)
        except FileNotFoundError:
            pass

    # ---- torch.distributed.checkpoint ---------------------------------------------------------
    def dcp_writer(self, loc: Location, single_file_per_rank: bool = True):
        if isinstance(loc, Path):
            from torch.distributed.checkpoint import FileSystemWriter

            return FileSystemWriter(loc, single_file_per_rank=single_file_per_rank)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(str(loc), single_file_per_rank=single_file_per_rank, **self.options)

    def dcp_reader(self, loc: Location):
        if isinstance(loc, Path):
            from torch.distributed.checkpoint import FileSystemReader

            return FileSystemReader(loc)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(loc), **self.options)


def space_problem(storage: Storage, err: BaseException | None, needed: int) -> str | None:
    """The one-line reason a write to local `storage` failed (or would fail) for lack of space or
    permission, else None. Disk-full shows up in many guises (torch's zip writer reports only
    'unexpected pos'), so the free space is consulted, not only the errno."""
    if storage.remote:
        return None
    code = getattr(err, "errno", None)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = "read-only filesystem" if code == errno.EROFS else "permission denied"
        return f"cannot write checkpoints to {storage.root}: {what}"
    free = storage.free_bytes()
    if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < needed):
        return (f"no space left on {storage.device()} (checkpoint.dir {storage.root}): the checkpoint needs "
                f"~{gib(needed)}, {gib(free or 0)} free; free space, lower checkpoint.keep or choose another "
                "checkpoint.dir")
    return None


def first_oserror(err: BaseException) -> BaseException:
    """The OSError inside `err` (DCP wraps each rank's exception), else `err` itself."""
    seen = err
    failures = getattr(err, "failures", None)
    if failures:
        for exc, _trace in failures.values():
            return first_oserror(exc)
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return err
