"""Where training text comes from: the built-in corpus, directories of text files, JSONL files.

The built-in corpus is the running interpreter's standard library (`.py` files: code and
docstrings), present on every machine with nothing to download. Documents are split into
train and held-out deterministically by a hash of their name, so the split never depends on
the order files are listed in.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NamedTuple

from ultratron.errors import DataError

# Parts of the standard library that are test data rather than library code (and hold files
# in deliberately odd encodings), or that are not part of the stdlib proper.
BUILTIN_EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
    "config-3", "ensurepip",
})


@dataclass(frozen=True)
class Document:
    id: str
    text: str


class JsonLine(NamedTuple):
    """One non-blank line of a JSONL file: its number (from 1), its bytes, and its parsed value —
    or, for a line that is not UTF-8 JSON, the problem (`invalid_utf8` or `malformed_jsonl`) and
    the decoder's message."""

    number: int
    raw: bytes
    value: object = None
    problem: str | None = None
    detail: str | None = None


def iter_jsonl(path: str | Path | IO[bytes]) -> Iterator[JsonLine]:
    """Every non-blank line of a JSONL file (a path, or a binary file object: a decompressing
    stream, an object-store file), parsed; a bad line comes with its problem instead of stopping
    the reader, so each reader counts it and goes on (its own rules say what a good value is)."""
    with (open(path, "rb") if isinstance(path, str | Path) else nullcontext(path)) as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield JsonLine(number, raw, json.loads(raw.decode("utf-8")))
            except UnicodeDecodeError as err:
                yield JsonLine(number, raw, problem="invalid_utf8", detail=str(err))
            except json.JSONDecodeError as err:
                yield JsonLine(number, raw, problem="malformed_jsonl", detail=err.msg)


def builtin_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def walk_files(root: Path, extensions: tuple[str, ...], excluded_dirs: frozenset[str] = frozenset()) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in excluded_dirs and not d.startswith("."))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(extensions))
    return files


def held_out(doc_id: str, fraction: float) -> bool:
    """Deterministic split: a document is held out when its id hashes into the first `fraction`."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _decode(raw: bytes, where: str, strict: bool) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if strict:
            raise DataError(
                f"{where}: not valid UTF-8 at byte {err.start} ({raw[err.start:err.start + 4]!r}); "
                "convert the file to UTF-8 or remove it"
            ) from None
        return None


def iter_builtin() -> Iterator[Document]:
    """The standard library's .py files. Files that are not UTF-8 are skipped (there are none
    outside the excluded test directories in CPython 3.11, but other builds may differ)."""
    root = builtin_corpus_root()
    for path in walk_files(root, (".py",), BUILTIN_EXCLUDED_DIRS):
        text = _decode(path.read_bytes(), str(path), strict=False)
        if text and text.strip():
            yield Document(id=str(path.relative_to(root)), text=text)


def _iter_jsonl(path: Path, doc_prefix: str) -> Iterator[Document]:
    for line in iter_jsonl(path):
        where = f"{path}:{line.number}"
        if line.problem == "invalid_utf8":
            _decode(line.raw, where, strict=True)  # raises, saying where the bad byte is
        if line.problem is not None:
            raise DataError(f"{where}: not valid JSON ({line.detail})")
        record = line.value
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{where}: each JSONL line must be an object with a string "text" field')
        yield Document(id=str(record.get("id", f"{doc_prefix}:{line.number}")), text=record["text"])


def iter_path(path: str | Path, extensions: tuple[str, ...] = (".txt",)) -> Iterator[Document]:
    """Documents from a file (text or .jsonl) or a directory of such files. Non-UTF-8 is an error."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"data.path {str(root)!r} does not exist")
    files = [root] if root.is_file() else walk_files(root, extensions)
    for file in files:
        rel = file.name if root.is_file() else str(file.relative_to(root))
        if file.suffix == ".jsonl":
            yield from _iter_jsonl(file, rel)
        else:
            text = _decode(file.read_bytes(), str(file), strict=True)
            if text and text.strip():
                yield Document(id=rel, text=text)


def iter_documents(path: str | None, extensions: str = ".txt", max_bytes: int = 0) -> Iterator[Document]:
    """The corpus for `data.path` (None: built-in), stopping after `max_bytes` of text if > 0."""
    docs = iter_builtin() if path is None else iter_path(path, tuple(e.strip() for e in extensions.split(",")))
    total = 0
    for doc in docs:
        yield doc
        total += len(doc.text.encode("utf-8"))
        if max_bytes and total >= max_bytes:
            return
