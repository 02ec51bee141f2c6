"""Stage `read`: raw sources → JSONL parts, counting every unusable input with a reason.

Sources: the built-in corpus (`builtin`), a directory or file of text (.txt/.md/.py…), JSONL
(`text`, optional `id`, other fields carried along; also .jsonl.gz and .jsonl.zst), Parquet and
Arrow IPC (a `text` column, optional `id`) and WARC (its text records: a WET file's conversions;
needs `warcio`); local, or under an fsspec URL (`s3://bucket/prefix`, listed in name order, each
file streamed from the store); with `read.format = "chat"`, JSONL conversations in the messages
format (or the built-in conversation set for `builtin`), one conversation a document. Unlike
`ultratron.data.sources` (which the trainer's short road uses and which stops at the first bad
file), this reader never stops: invalid UTF-8, binary files, empty and oversized documents,
malformed JSONL lines and bad Parquet rows are each logged as removed, with a reason; so are
conversations the trainer would reject (no messages, a missing or unknown role, content that is
not text, no assistant turn), under the trainer's reasons.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from ultratron.curation.frame import PartWriter, StageContext, part_done
from ultratron.data.chat import Reject, check_messages, conversation_text
from ultratron.data.conversations import builtin_conversations
from ultratron.data.objstore import Remote, is_url, key
from ultratron.data.sources import BUILTIN_EXCLUDED_DIRS, builtin_corpus_root, iter_jsonl, walk_files
from ultratron.errors import DataError

BUILTIN_CHAT = "builtin.jsonl"  # the source name of the built-in conversation set (read.format = "chat")

# An item is (id, record or None, reason or None, raw size in bytes, snippet for the report).
Item = tuple[str, dict | None, str | None, int, str | None]


def classify_bytes(raw: bytes, max_doc_bytes: int, control_fraction: float) -> tuple[str | None, str | None]:
    """(text, None) for a usable document, else (None, reason)."""
    if len(raw) > max_doc_bytes:
        return None, "too_large"
    if b"\x00" in raw:
        return None, "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "invalid_utf8"
    if not text.strip():
        return None, "empty"
    controls = sum(1 for ch in text[:65536] if ord(ch) < 32 and ch not in "\t\n\r\f\v")
    if controls > control_fraction * min(len(text), 65536):
        return None, "binary"
    return text, None


def walk_sources(root: Path, extensions: tuple[str, ...]) -> Iterator[tuple[Path, str | None]]:
    """Files under `root` in a fixed order, as (path, None) — or (path, reason) for an entry that
    cannot be read: a symlink whose target is gone (`dangling_symlink`), one that leads back into a
    directory already being read (`symlink_loop`), a directory that cannot be listed (`unreadable`).
    Directory symlinks are followed once; hidden directories are skipped, as everywhere."""
    seen = {root.resolve()}

    def visit(directory: Path, ancestors: frozenset) -> Iterator[tuple[Path, str | None]]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            yield directory, "unreadable"
            return
        for entry in entries:
            path = Path(entry.path)
            try:
                target = path.resolve(strict=True) if entry.is_symlink() else None
            except FileNotFoundError:  # reported when it names a file that would be read
                if entry.name.endswith(extensions):
                    yield path, "dangling_symlink"
                continue
            except (OSError, RuntimeError):  # ELOOP: links that point at each other
                yield path, "symlink_loop"
                continue
            is_dir = (target or path).is_dir()
            if is_dir and not entry.name.startswith("."):
                real = target or path.resolve()
                if real in ancestors or real in seen:
                    yield path, "symlink_loop"
                    continue
                seen.add(real)
                yield from visit(path, ancestors | {real})
            elif not is_dir and entry.name.endswith(extensions):
                yield path, None

    yield from visit(root, frozenset({root.resolve()}))


def _iter_text_file(path: Path, doc_id: str, cfg) -> Iterator[Item]:
    try:
        size = path.stat().st_size
    except OSError as err:  # removed while being read, no permission
        yield doc_id, None, "unreadable", 0, f"{type(err).__name__}: {err.strerror or err}"
        return
    yield from _iter_text(doc_id, size, lambda: open(path, "rb"), cfg)


def _iter_text(doc_id: str, size: int, opener: Callable[[], IO[bytes]], cfg) -> Iterator[Item]:
    if size > cfg.read.max_doc_bytes and not doc_id.endswith(COMPRESSED):  # never read a huge file just to reject it
        yield doc_id, None, "too_large", size, None
        return
    try:
        with opener() as fh:
            raw = _decompressed(fh, doc_id).read(cfg.read.max_doc_bytes + 1)
    except OSError as err:  # removed while being read, no permission
        yield doc_id, None, "unreadable", 0, f"{type(err).__name__}: {err.strerror or err}"
        return
    text, reason = classify_bytes(raw, cfg.read.max_doc_bytes, cfg.read.binary_control_fraction)
    yield doc_id, ({"id": doc_id, "text": text} if text is not None else None), reason, len(raw), None


COMPRESSED = (".gz", ".zst")


def _decompressed(fh: IO[bytes], name: str) -> IO[bytes]:
    """`fh` read through the decompressor its name calls for (.gz, .zst), else as it is."""
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=fh)
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{name}: reading .zst files needs the zstandard package (pip install zstandard)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(fh))
    return fh


def _base_name(name: str) -> str:
    """The name without its compression suffix: what says the file's format."""
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _iter_jsonl(path: Path | IO[bytes], prefix: str, cfg, document: Callable) -> Iterator[Item]:
    """Each line of a JSONL file (a path or a binary stream) as `document(value, prefix, line number,
    raw line, cfg)`'s items, or as a bad line."""
    for line in iter_jsonl(path):
        where = f"{prefix}:{line.number}"
        if line.problem is not None:
            snippet = line.raw[:80].decode("utf-8", "replace") if line.problem == "malformed_jsonl" else None
            yield where, None, line.problem, len(line.raw), snippet
        else:
            yield from document(line.value, prefix, line.number, line.raw, cfg)


def _text_record(record, prefix: str, line_no: int, raw: bytes, cfg) -> Iterator[Item]:
    where = f"{prefix}:{line_no}"
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        yield where, None, "bad_record", len(raw), raw[:80].decode("utf-8", "replace")
        return
    yield from _checked(record, str(record.get("id", where)), cfg)


def _conversation(record, prefix: str, line_no: int, raw: bytes, cfg) -> Iterator[Item]:
    """A chat record (read.format = "chat") as a document: its text is `conversation_text` (what
    dedup and filters measure), the record itself rides along unchanged for `write-chat`."""
    where = f"{prefix}:{line_no}"
    try:
        messages = check_messages(record)
    except Reject as reject:  # the trainer's own rules, so what survives here it can train on
        yield where, None, reject.reason, len(raw), raw[:80].decode("utf-8", "replace")
        return
    document = {"text": conversation_text(messages), "source": prefix, "conversation": record}
    yield from _checked(document, str(record.get("id", where)), cfg)


def _checked(record: dict, doc_id: str, cfg) -> Iterator[Item]:
    text = record["text"]
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > cfg.read.max_doc_bytes:
        reason = "too_large"
    elif "\x00" in text:
        reason = "binary"
    elif not text.strip():
        reason = "empty"
    else:
        try:
            text.encode("utf-8")
            reason = None
        except UnicodeEncodeError:  # lone surrogates from \udXXX escapes
            reason = "invalid_utf8"
    yield doc_id, ({**record, "id": doc_id} if reason is None else None), reason, size, None


def _iter_parquet(path: Path | IO[bytes], prefix: str, size: int, cfg) -> Iterator[Item]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a corrupt file
        yield prefix, None, "bad_parquet", size, str(err)[:120]
        return
    yield from _iter_table(pf.schema_arrow.names, pf.iter_batches(batch_size=1024), prefix, size, "bad_parquet", cfg)


def _iter_arrow(fh: IO[bytes], prefix: str, size: int, cfg) -> Iterator[Item]:
    """An Arrow IPC file (random access, .arrow/.feather v2) or stream."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        reader = ipc.open_file(fh)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        try:
            fh.seek(0)
            reader = ipc.open_stream(fh)
            batches = iter(reader)
        except Exception as err:
            yield prefix, None, "bad_arrow", size, str(err)[:120]
            return
    yield from _iter_table(reader.schema.names, batches, prefix, size, "bad_arrow", cfg)


def _iter_table(names: list[str], batches, prefix: str, size: int, bad: str, cfg) -> Iterator[Item]:
    if "text" not in names:
        yield prefix, None, bad, size, "no 'text' column"
        return
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            row += 1
            where = f"{prefix}:{row}"
            if not isinstance(record.get("text"), str):
                yield where, None, "bad_record", 0, None
                continue
            yield from _checked(record, str(record.get("id") or where), cfg)


def _iter_warc(fh: IO[bytes], prefix: str, cfg) -> Iterator[Item]:
    """A WARC file's text records: a WET file's `conversion` records (the extracted text) and
    `resource` records of type text/plain; each record's id is its WARC-Record-ID."""
    try:
        from warcio.archiveiterator import ArchiveIterator
    except ImportError:
        raise DataError(f"{prefix}: reading WARC files needs the warcio package (pip install warcio)") from None
    for n, record in enumerate(ArchiveIterator(fh), start=1):
        kind = record.rec_type
        mime = (record.rec_headers.get_header("Content-Type") or "").split(";")[0].strip()
        if kind != "conversion" and not (kind == "resource" and mime == "text/plain"):
            continue
        doc_id = record.rec_headers.get_header("WARC-Record-ID") or f"{prefix}:{n}"
        raw = record.content_stream().read()
        text, reason = classify_bytes(raw, cfg.read.max_doc_bytes, cfg.read.binary_control_fraction)
        yield doc_id, ({"id": doc_id, "text": text, "url": record.rec_headers.get_header("WARC-Target-URI")}
                       if text is not None else None), reason, len(raw), None


def _iter_file(rel: str, size: int, opener: Callable[[], IO[bytes]], cfg, chat: bool) -> Iterator[Item]:
    """One input file by its format (its name without the compression suffix says which)."""
    base = _base_name(rel)
    if chat or base.endswith(".jsonl"):
        with opener() as fh:
            yield from _iter_jsonl(_decompressed(fh, rel), rel, cfg, _conversation if chat else _text_record)
    elif base.endswith(".parquet"):
        with opener() as fh:
            yield from _iter_parquet(fh, rel, size, cfg)
    elif base.endswith((".arrow", ".feather", ".ipc")):
        with opener() as fh:
            yield from _iter_arrow(fh, rel, size, cfg)
    elif base.endswith(".warc"):
        with opener() as fh:
            yield from _iter_warc(fh, rel, cfg)  # warcio reads .warc.gz itself
    else:
        yield from _iter_text(rel, size, opener, cfg)


def _iter_remote(url: str, extensions: tuple[str, ...], cfg, chat: bool) -> Iterator[Item]:
    """Every file under an object-store prefix (or the one object at `url`), in name order."""
    try:
        remote = Remote(url, cfg.pipeline.endpoint)
        files = remote.files()
        if not files and remote.exists(url):  # one object, not a prefix
            name = url.rstrip("/").rsplit("/", 1)[-1]
            remote, files = Remote(url.rstrip("/").rsplit("/", 1)[0], cfg.pipeline.endpoint), {name: remote.size(url)}
    except (ImportError, ValueError, OSError) as err:
        raise DataError(f"pipeline.input {url!r}: {err}") from None
    if not files:
        raise DataError(f"pipeline.input {url!r}: no such object or prefix")
    for rel, size in files.items():
        name = rel.rsplit("/", 1)[-1]
        if name.startswith(".") or not _base_name(name).endswith(extensions) and not name.endswith(extensions):
            continue
        yield from _iter_file(rel, size, lambda rel=rel: remote.fs.open(key(remote.fs, remote.child(rel)), "rb"),
                              cfg, chat)


def iter_source(source: str, cfg) -> Iterator[Item]:
    """Every input item of `source` ("builtin", a file or a directory), in a fixed order."""
    chat = cfg.read.format == "chat"
    if source == "builtin" and chat:
        for n, record in enumerate(builtin_conversations(), start=1):
            yield from _conversation(record, BUILTIN_CHAT, n, json.dumps(record).encode(), cfg)
        return
    if source == "builtin":
        root = builtin_corpus_root()
        for path in walk_files(root, (".py",), BUILTIN_EXCLUDED_DIRS):
            yield from _iter_text_file(path, str(path.relative_to(root)), cfg)
        return
    extensions = (".jsonl",) if chat else tuple(e.strip() for e in cfg.read.extensions.split(",") if e.strip())
    if is_url(source):
        yield from _iter_remote(source, extensions, cfg, chat)
        return
    root = Path(source)
    if not root.exists():
        raise DataError(f"pipeline.input {source!r} does not exist (use 'builtin' for the built-in corpus)")
    compressed = tuple(e + c for e in extensions for c in COMPRESSED)
    files = [(root, None)] if root.is_file() else walk_sources(root, extensions + compressed)
    for path, problem in files:
        rel = path.name if root.is_file() else str(path.relative_to(root))
        if problem is not None:
            yield rel, None, problem, 0, f"{rel} -> {os.readlink(path)}" if path.is_symlink() else rel
        elif (chat or path.suffix == ".jsonl") and not rel.endswith(COMPRESSED):
            yield from _iter_jsonl(path, rel, cfg, _conversation if chat else _text_record)
        elif path.suffix in (".jsonl", ".parquet", ".arrow", ".feather", ".ipc", ".warc") or rel.endswith(COMPRESSED):
            yield from _iter_file(rel, path.stat().st_size, lambda path=path: open(path, "rb"), cfg, chat)
        else:
            yield from _iter_text_file(path, rel, cfg)


def run(ctx: StageContext) -> dict:
    """Sequential by nature (one stream of sources); cuts it into parts of docs_per_part items."""
    cfg = ctx.cfg
    per_part = cfg.pipeline.docs_per_part
    part_index, in_part, accepted_bytes = 0, 0, 0
    writer: PartWriter | None = None
    skipping = False

    def open_part() -> tuple[PartWriter | None, bool]:
        name = f"part-{part_index:05d}"
        if part_done(ctx.out_dir, name):
            return None, True
        return PartWriter(ctx.out_dir, name), False

    for doc_id, record, reason, size, snippet in iter_source(str(ctx.input), cfg):
        if in_part == 0:
            writer, skipping = open_part()
        if record is not None:
            accepted_bytes += len(record["text"].encode("utf-8"))
        if not skipping:
            if record is None:
                writer.bad_input(doc_id, reason, size, snippet)
            else:
                writer.kept(record)
        in_part += 1
        if in_part == per_part:
            if writer is not None:
                writer.close()
            writer, in_part, part_index = None, 0, part_index + 1
        if cfg.read.max_bytes and accepted_bytes >= cfg.read.max_bytes:
            break
    if writer is not None:
        writer.close()
    if in_part == 0 and part_index == 0:
        PartWriter(ctx.out_dir, "part-00000").close()  # an empty source still yields a (empty) part
    return {"input": str(ctx.input)}

