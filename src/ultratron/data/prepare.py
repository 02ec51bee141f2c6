"""Corpus → tokenizer → train/held-out token shards, as the trainer needs them.

Results are cached in the data directory under a fingerprint of the inputs, so a resumed or
repeated run reuses them. (The full curation pipeline — dedup, filters, audit — is
`ultratron data`; this is the short road from text to shards.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ultratron.data.conversations import prepare_chat
from ultratron.data.mixture_spec import MixtureSpec, parse_mixture
from ultratron.data.objstore import is_url, join
from ultratron.data.shards import META, ShardSet, ShardWriter, write_json_atomic
from ultratron.data.sources import Document, held_out, iter_documents
from ultratron.data.tokenizer import CONFIG_FILE, Tokenizer, train_tokenizer
from ultratron.errors import DataError

ENCODE_BATCH = 256


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train_dir: Path | None  # None for a mixture, whose splits are in `sources`
    val_dir: Path | None  # None when no document was held out
    summary: dict
    mixture: MixtureSpec | None = None
    sources: tuple[tuple[Path, Path | None], ...] = ()  # a mixture's (train, val) directories, in spec order
    val_sources: dict[str, Path] | None = None  # several chat files: each one's held-out shards, by name
    remote: dict | None = None  # shards on an object store: data.endpoint, cache_limit, window, the cache root


def _chat_prepared(tokenizer: Tokenizer, out_dir: Path, summary: dict) -> PreparedData:
    return PreparedData(tokenizer, out_dir / "train", out_dir / "val" if summary["val"]["n_tokens"] else None,
                        summary, val_sources={n: out_dir / d for n, d in summary.get("val_sources", {}).items()})


def _fingerprint(data_cfg, vocab_size: int, seq_len: int) -> str:
    source = data_cfg.path if data_cfg.path is None else str(Path(data_cfg.path).resolve())
    tok = None if data_cfg.tokenizer is None else hashlib.sha256(Path(data_cfg.tokenizer).read_bytes()).hexdigest()
    key = {"path": source, "tokenizer": tok, "held_out_fraction": data_cfg.held_out_fraction,
           "max_bytes": data_cfg.max_bytes, "extensions": data_cfg.extensions, "vocab_size": vocab_size}
    if data_cfg.format == "chat":  # conversations are packed into sequences, and the template is the tokenizer's
        config = Path(data_cfg.tokenizer).with_name(CONFIG_FILE) if data_cfg.tokenizer else None
        content = _content_hash(Path(data_cfg.path)) if data_cfg.path else "builtin"
        key |= {"format": "chat", "seq_len": seq_len, "content": content,
                "tokenizer_config": config.read_text() if config and config.is_file() else None}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _content_hash(path: Path) -> str:
    """Of the chat files' sizes and modification times (a changed file is prepared again)."""
    files = [path] if path.is_file() else sorted(path.rglob("*.jsonl"))
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def _split(data_cfg, want_held_out: bool) -> Iterator[Document]:
    for doc in iter_documents(data_cfg.path, data_cfg.extensions, data_cfg.max_bytes):
        if held_out(doc.id, data_cfg.held_out_fraction) == want_held_out:
            yield doc


def _write(docs: Iterator[Document], tokenizer: Tokenizer, out_dir: Path) -> dict:
    writer = ShardWriter(out_dir, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                         tokenizer_sha256=tokenizer.sha256)
    batch: list[str] = []
    n_bytes = 0
    for doc in docs:
        batch.append(doc.text)
        n_bytes += len(doc.text.encode("utf-8"))
        if len(batch) == ENCODE_BATCH:
            for ids in tokenizer.encode_batch(batch):
                writer.add(ids)
            batch = []
    for ids in tokenizer.encode_batch(batch):
        writer.add(ids)
    return writer.close({"n_bytes": n_bytes})


def is_prepared_dir(path: str | Path | None) -> bool:
    """A directory that already holds a tokenizer and train shards (e.g. `ultratron data`'s shard stage);
    an object-store URL is taken for one (and checked when it is opened)."""
    if is_url(path):
        return True
    return path is not None and (Path(path) / "tokenizer.json").is_file() and (Path(path) / "train" / META).is_file()


def remote_settings(data_cfg, out_dir: str | Path) -> dict:
    """How shards on an object store are read: the endpoint, the cache's bound and window, where it lives."""
    return {"endpoint": data_cfg.endpoint or None, "limit": data_cfg.cache_limit, "window": data_cfg.window,
            "cache_root": str(Path(out_dir) / "remote")}


def open_prepared_remote(url: str, vocab_size: int, settings: dict, log: Callable[[str], None] = print):
    """A prepared directory on an object store: its small files copied into the local cache root and
    checked as a local one's; the shards themselves are fetched as they are read (data/remote.py)."""
    from ultratron.data.remote import fetch_prepared

    url = url.rstrip("/")
    local = Path(settings["cache_root"]) / hashlib.sha256(url.encode()).hexdigest()[:16]
    prepared = open_prepared(fetch_prepared(url, local, settings["endpoint"]), vocab_size, log)
    prepared.summary["source"] = url
    prepared.train_dir = join(url, "train")
    prepared.val_dir = join(url, "val") if prepared.val_dir is not None else None
    prepared.remote = settings
    return prepared


def open_prepared(path: str | Path, vocab_size: int, log: Callable[[str], None] = print) -> PreparedData:
    """Use a prepared directory as it is: tokenizer.json, train/ and optionally val/ shards."""
    path = Path(path)
    tokenizer = Tokenizer.load(path / "tokenizer.json")
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"{path}/tokenizer.json has {tokenizer.vocab_size} tokens but model.vocab_size={vocab_size}; "
                        "raise model.vocab_size")
    summary = {"source": str(path)}
    splits = {}
    for split in ("train", "val"):
        meta_path = path / split / META
        if not meta_path.is_file():
            continue
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("tokenizer_sha256") != tokenizer.sha256:
            raise DataError(f"{path / split}: shards were written with another tokenizer than {path}/tokenizer.json")
        splits[split] = path / split
        summary[split] = {k: meta.get(k) for k in ("n_documents", "n_tokens")}
    log(f"data: using prepared shards in {path} (train {summary['train']['n_tokens']:,} tokens"
        + (f", held-out {summary['val']['n_tokens']:,} tokens)" if "val" in splits else ", no held-out split)"))
    return PreparedData(tokenizer, splits["train"], splits.get("val"), summary)


def open_mixture(data_cfg, vocab_size: int, log: Callable[[str], None] = print,
                 settings: dict | None = None) -> PreparedData:
    """A mixture's prepared sources, which must share one tokenizer (and data.tokenizer, if set);
    local and object-store sources alike (`settings`: `remote_settings`)."""
    spec, problems = parse_mixture(data_cfg.sources, data_cfg.weights, data_cfg.schedule)
    if problems:
        raise DataError(problems)
    opened = []
    for name, path in zip(spec.names, spec.paths, strict=True):
        if not is_prepared_dir(path):
            raise DataError(f"data source {name!r}: {path} is not a prepared directory (tokenizer.json + train/ "
                            "shards, as `ultratron data run` writes)")
        named = lambda message, name=name: log(f"{name}: {message}")
        opened.append(open_prepared_remote(path, vocab_size, settings, named) if is_url(path)
                      else open_prepared(path, vocab_size, named))
    tokenizers = {name: p.tokenizer.sha256 for name, p in zip(spec.names, opened, strict=True)}
    if data_cfg.tokenizer:
        tokenizers["data.tokenizer"] = Tokenizer.load(data_cfg.tokenizer).sha256
    if len(set(tokenizers.values())) > 1:
        raise DataError("the sources of a mixture must share one tokenizer, and these differ: "
                        + ", ".join(f"{name} (tokenizer {sha[:12]})" for name, sha in tokenizers.items()))
    log("data: mixture of " + ", ".join(f"{n} {w:.1%}" for n, w in zip(spec.names, spec.weights, strict=True))
        + (f", then a schedule of {len(spec.schedule)} points" if spec.schedule else ""))
    summary = {"mixture": {n: p.summary for n, p in zip(spec.names, opened, strict=True)}}
    return PreparedData(opened[0].tokenizer, None, None, summary, spec,
                        tuple((p.train_dir, p.val_dir) for p in opened), remote=settings)


def prepare_data(data_cfg, vocab_size: int, out_dir: str | Path, log: Callable[[str], None] = print,
                 seq_len: int = 0) -> PreparedData:
    """Tokenizer and shards for `data_cfg`: a mixture of prepared directories (data.sources), a
    prepared directory used as it is, or else built from the text or, with data.format=chat, from
    conversations packed into sequences of `seq_len` tokens (and cached in `out_dir`)."""
    if data_cfg.sources:
        return open_mixture(data_cfg, vocab_size, log, remote_settings(data_cfg, out_dir))
    if is_url(data_cfg.path):
        return open_prepared_remote(data_cfg.path, vocab_size, remote_settings(data_cfg, out_dir), log)
    if is_prepared_dir(data_cfg.path):
        return open_prepared(data_cfg.path, vocab_size, log)
    out_dir = Path(out_dir)
    stamp = out_dir / "prepared.json"
    fingerprint = _fingerprint(data_cfg, vocab_size, seq_len)
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        summary = json.loads(stamp.read_text())
        log(f"data: reusing tokenizer and shards in {out_dir}")
        if summary.get("format") == "chat":
            return _chat_prepared(Tokenizer.load(out_dir / "tokenizer.json"), out_dir, summary)
        val = out_dir / "val"
        return PreparedData(Tokenizer.load(out_dir / "tokenizer.json"), out_dir / "train",
                            val if summary["val"]["n_tokens"] else None, summary)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    if data_cfg.format == "chat":
        tokenizer, summary = prepare_chat(data_cfg, vocab_size, seq_len, out_dir, log)
        write_json_atomic(stamp, {"fingerprint": fingerprint, **summary})
        return _chat_prepared(tokenizer, out_dir, summary)
    source = "built-in corpus (Python standard library)" if data_cfg.path is None else data_cfg.path
    if next(_split(data_cfg, False), None) is None:
        raise DataError(f"no training documents found in {source} (empty files are skipped; "
                        f"extensions read: {data_cfg.extensions})")

    if data_cfg.tokenizer:
        tokenizer = Tokenizer.load(data_cfg.tokenizer)
        log(f"data: loaded tokenizer {data_cfg.tokenizer} ({tokenizer.vocab_size} tokens)")
    else:
        log(f"data: training a byte-level BPE tokenizer ({vocab_size} tokens) on {source}")
        tokenizer = train_tokenizer((d.text for d in _split(data_cfg, False)), vocab_size)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size={vocab_size}; "
                        "raise model.vocab_size or use a smaller tokenizer")
    tokenizer.save(out_dir / "tokenizer.json")

    log("data: tokenizing into shards")
    train = _write(_split(data_cfg, False), tokenizer, out_dir / "train")
    val = _write(_split(data_cfg, True), tokenizer, out_dir / "val")
    summary = {"fingerprint": fingerprint, "source": source, "tokenizer_vocab_size": tokenizer.vocab_size,
               "train": {k: train[k] for k in ("n_documents", "n_tokens", "n_bytes")},
               "val": {k: val[k] for k in ("n_documents", "n_tokens", "n_bytes")}}
    write_json_atomic(stamp, summary)
    log(f"data: train {train['n_documents']} documents / {train['n_tokens']:,} tokens, "
        f"held-out {val['n_documents']} documents / {val['n_tokens']:,} tokens "
        f"({train['n_bytes'] / max(train['n_tokens'], 1):.2f} bytes per token)")
    if not val["n_tokens"]:
        log("data: warning: no document was held out; validation loss is disabled")
    return PreparedData(tokenizer, out_dir / "train", out_dir / "val" if val["n_tokens"] else None, summary)


def open_shards(data: PreparedData, root: str | Path):
    """The shard set at `root`: memory-mapped where it is local, through the bounded local cache
    where it is on an object store (one cache directory per set and process)."""
    if not is_url(root):
        return ShardSet.open(root)
    import os

    from ultratron.data.remote import open_remote

    settings = data.remote or {}
    cache = Path(settings["cache_root"]) / hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return open_remote(str(root), cache / f"rank{os.environ.get('RANK', '0')}", limit=settings["limit"],
                       window=settings["window"], endpoint=settings["endpoint"])
