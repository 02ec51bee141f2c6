"""Object-store I/O shared by the data path, curation and checkpoints: which paths are URLs, the
fsspec filesystem of a URL (`s3://bucket/prefix` on AWS or on any S3-compatible server named by an
endpoint URL; `gs://`, `az://`, ... where their fsspec package is installed), and files published
whole.

An object store has no rename: an object appears whole when its PUT (or multipart upload)
completes. `publish_file` still writes under a temporary name first and copies it to its real
name last, so a reader that lists the prefix never takes a half-uploaded file for a finished one,
and a writer killed mid-upload leaves at worst a `NAME.tmpPID` object, which `remove_temp`
clears (the same names as `atomic.temp_path`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ultratron.atomic import is_temp


def is_url(path: str | os.PathLike | None) -> bool:
    text = str(path or "")
    return "://" in text and not text.startswith("file://")


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def fs_options(url: str, endpoint: str | None = None) -> dict:
    """Keyword arguments of the filesystem of `url`: for S3, a few quick attempts (not botocore's
    default of minutes of retries) and the endpoint of an S3-compatible server."""
    if url.startswith(("s3://", "s3a://")):
        opts: dict = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                                        "retries": {"max_attempts": 2, "mode": "standard"}}}
        if endpoint:
            opts["endpoint_url"] = endpoint
        return opts
    return {}


def filesystem(url: str, endpoint: str | None = None):
    """(fsspec filesystem, options) of `url`; a missing fsspec backend (s3fs for s3://) raises
    ImportError naming it, a malformed URL ValueError."""
    from fsspec.core import url_to_fs

    options = fs_options(url, endpoint)
    fs, _ = url_to_fs(url, **options)
    return fs, options


def key(fs, url: str) -> str:
    """The fsspec path of a URL (the protocol stripped, as fsspec's own methods return them)."""
    return fs._strip_protocol(str(url))


class Remote:
    """One prefix of an object store: read, list and publish files under it."""

    def __init__(self, url: str, endpoint: str | None = None):
        self.url = url.rstrip("/")
        self.endpoint = endpoint or None
        self.fs, self.options = filesystem(self.url, self.endpoint)

    def child(self, *names: str) -> str:
        return join(self.url, *names)

    def exists(self, url: str) -> bool:
        return self.fs.exists(key(self.fs, url))

    def read_bytes(self, url: str) -> bytes:
        return self.fs.cat_file(key(self.fs, url))

    def size(self, url: str) -> int:
        return int(self.fs.size(key(self.fs, url)))

    def files(self, url: str | None = None) -> dict[str, int]:
        """Every file under `url` (default: the prefix), by path relative to it, with its size."""
        base = key(self.fs, url or self.url).rstrip("/")
        self.fs.invalidate_cache()  # another process may have written since
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {path[len(base) + 1:]: int(info["size"]) for path, info in sorted(found.items())
                if info.get("type") != "directory" and path != base}

    def download(self, url: str, local: Path) -> None:
        """The object at `url` into the local file `local` (overwritten)."""
        self.fs.get_file(key(self.fs, url), str(local))

    def publish_file(self, local: Path, url: str) -> None:
        """Upload `local` to `url`: under a temporary name, then copied to its real name."""
        tmp = f"{url}.tmp{os.getpid()}"
        self.fs.put_file(str(local), key(self.fs, tmp))
        self.fs.copy(key(self.fs, tmp), key(self.fs, url))
        self.fs.rm_file(key(self.fs, tmp))

    def publish_bytes(self, data: bytes, url: str) -> None:
        tmp = f"{url}.tmp{os.getpid()}"
        self.fs.pipe_file(key(self.fs, tmp), data)
        self.fs.copy(key(self.fs, tmp), key(self.fs, url))
        self.fs.rm_file(key(self.fs, tmp))

    def remove(self, url: str) -> None:
        try:
            self.fs.rm(key(self.fs, url), recursive=True)
        except FileNotFoundError:
            pass

    def remove_temp(self, listing: dict[str, int] | None = None) -> list[str]:
        """Remove what an interrupted upload left under the prefix (`listing`: its `files()`, if the
        caller has it); returns their relative names."""
        stale = [name for name in (self.files() if listing is None else listing) if is_temp(name.rsplit("/", 1)[-1])]
        for name in stale:
            self.remove(self.child(name))
        return stale
