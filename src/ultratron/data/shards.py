"""Token shards: flat token streams the trainer memory-maps.

A shard directory holds `meta.json` (tokenizer hash, dtype, counts, the shard list) and, per
shard, `NAME.bin` (the tokens, each document followed by EOS) and `NAME.idx.npy` (the offset of
each document's first token). Packed shards (chat data, `data/conversations.py`) hold sequences
of exactly `packed` tokens, without EOS between documents, and per token a flags byte in
`NAME.flags.bin`: LOSS (the token counts in the loss as a target) and DOC_START (a document
begins here). Every file is written under a temporary name and renamed, and
`meta.json` comes last: a directory without it is not a finished shard set. `meta.json` lists each
shard's size in bytes and SHA-256 (`bytes`, `sha256`; a packed set's flags too, `flags_sha256`),
which a reader that fetches a shard from an object store checks (`verify_shard`, data/remote.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ultratron import atomic
from ultratron.errors import DataError

META = "meta.json"
FORMAT_VERSION = 1


LOSS, DOC_START = 1, 2  # bits of a packed shard's flags byte


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_shard(path: Path, entry: dict, where: str, flags: bool = False) -> None:
    """Refuse a fetched shard file whose size or SHA-256 is not what `meta.json` lists
    (`where`: the shard's name in its set, for the error). A set written before hashes were listed
    is checked for its size only."""
    size = entry["n_tokens"] if flags else entry.get("bytes")
    expected = entry.get("flags_sha256" if flags else "sha256")
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        raise DataError(f"shard {where} is corrupt: {actual_size} bytes, meta.json lists {size}")
    if expected is not None and (actual := sha256_file(path)) != expected:
        raise DataError(f"shard {where} is corrupt: its sha256 is {actual}, meta.json lists {expected}")


def write_json_atomic(path: Path, obj) -> None:
    atomic.write_json(path, obj, indent=2, durable=True)


class ShardWriter:
    """Append tokenized documents; a new shard starts once `tokens_per_shard` is reached."""

    def __init__(self, out_dir: str | Path, *, vocab_size: int, eos_id: int, tokenizer_sha256: str,
                 tokens_per_shard: int = 50_000_000, prefix: str = "shard"):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / META).unlink(missing_ok=True)  # the set is unfinished until close()
        self.dtype = token_dtype(vocab_size)
        self.vocab_size, self.eos_id, self.tokenizer_sha256 = vocab_size, eos_id, tokenizer_sha256
        self.tokens_per_shard, self.prefix = tokens_per_shard, prefix
        self.shards: list[dict] = []
        self._tokens: list[np.ndarray] = []
        self._flags: list[np.ndarray] = []
        self._starts: list[int] = []
        self._count = 0

    def add(self, ids: list[int], flags: np.ndarray | None = None) -> None:
        """A document, followed by EOS; or, with `flags` (one byte per token), a packed sequence
        as it is."""
        if flags is None:
            arr = np.empty(len(ids) + 1, dtype=self.dtype)
            arr[:-1] = ids
            arr[-1] = self.eos_id
        else:
            arr = np.asarray(ids, dtype=self.dtype)
            self._flags.append(np.asarray(flags, dtype=np.uint8))
        self._starts.append(self._count)
        self._tokens.append(arr)
        self._count += len(arr)
        if self._count >= self.tokens_per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self._tokens:
            return
        name = f"{self.prefix}_{len(self.shards):05d}"
        entry: dict = {"name": name, "n_tokens": self._count, "n_documents": len(self._starts)}
        if self._flags:
            flags = np.concatenate(self._flags).tobytes()
            atomic.write_bytes(self.out_dir / f"{name}.flags.bin", flags, durable=True)
            entry["flags_sha256"] = hashlib.sha256(flags).hexdigest()
            self._flags = []
        tokens = np.concatenate(self._tokens).tobytes()
        atomic.write_bytes(self.out_dir / f"{name}.bin", tokens, durable=True)
        with atomic.atomic_path(self.out_dir / f"{name}.idx.npy", keep_suffix=True) as tmp:  # np.save wants .npy
            np.save(tmp, np.asarray(self._starts, dtype=np.int64))
        self.shards.append(entry | {"bytes": len(tokens), "sha256": hashlib.sha256(tokens).hexdigest()})
        self._tokens, self._starts, self._count = [], [], 0

    def close(self, extra: dict | None = None) -> dict:
        self._flush()
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer_sha256": self.tokenizer_sha256,
            "n_tokens": sum(s["n_tokens"] for s in self.shards),
            "n_documents": sum(s["n_documents"] for s in self.shards),
            "shards": self.shards,
            **(extra or {}),
        }
        write_json_atomic(self.out_dir / META, meta)
        return meta


def write_shards(token_lists: Iterable[list[int]], out_dir: str | Path, **kwargs) -> dict:
    writer = ShardWriter(out_dir, **kwargs)
    for ids in token_lists:
        writer.add(ids)
    return writer.close()


@dataclass
class ShardSet:
    """A finished shard directory, memory-mapped."""

    root: Path
    meta: dict
    tokens: list[np.ndarray]  # one memmap per shard
    flags: list[np.ndarray] | None = None  # a packed set's flag bytes, one memmap per shard

    @classmethod
    def open(cls, root: str | Path) -> ShardSet:
        root = Path(root)
        meta_path = root / META
        if not meta_path.is_file():
            raise DataError(f"{root}: not a finished shard directory (no {META})")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        dtype = np.dtype(meta["dtype"])
        tokens = []
        for shard in meta["shards"]:
            path = root / f"{shard['name']}.bin"
            expected = shard["n_tokens"] * dtype.itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise DataError(f"{path}: missing or truncated (expected {expected} bytes)")
            tokens.append(np.memmap(path, dtype=dtype, mode="r"))
        flags = None
        if meta.get("packed"):
            flags = []
            for shard in meta["shards"]:
                path = root / f"{shard['name']}.flags.bin"
                if not path.is_file() or path.stat().st_size != shard["n_tokens"]:
                    raise DataError(f"{path}: missing or truncated (expected {shard['n_tokens']} bytes)")
                flags.append(np.memmap(path, dtype=np.uint8, mode="r"))
        return cls(root=root, meta=meta, tokens=tokens, flags=flags)

    @property
    def n_tokens(self) -> int:
        return self.meta["n_tokens"]

    def document_starts(self, shard_index: int) -> np.ndarray:
        return np.load(self.root / f"{self.meta['shards'][shard_index]['name']}.idx.npy")
