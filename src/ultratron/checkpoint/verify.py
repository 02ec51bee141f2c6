"""Checksums: a checkpoint's `manifest.json` lists every file with its size and SHA-256, computed
from the bytes as they landed on storage (read back after the write), and written after every
other file but before the `complete` marker. A load first checks the manifest, so flipped bits,
a truncated shard or an overwritten `state.pt` are found before any of it reaches the model.

SHA-256 (hashlib, hardware-accelerated where the CPU has SHA extensions) is fast enough for this:
the hashing of a save runs in the background with the write, and a load reads each file anyway.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

from ultratron.checkpoint.storage import Location, Storage

MANIFEST = "manifest.json"
MARKER = "complete"  # written after the manifest; see store.py
CHUNK = 8 << 20
NOT_LISTED = {MANIFEST, MARKER}


def sha256_of(storage: Storage, loc: Location) -> str:
    digest = hashlib.sha256()
    with storage.open(loc, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_all(storage: Storage, ckpt: Location, names: list[str]) -> dict[str, str]:
    # hashlib releases the GIL on large buffers, so a few threads hash a few files at once.
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(names)))) as pool:
        digests = pool.map(lambda n: sha256_of(storage, storage.join(ckpt, *n.split("/"))), names)
        return dict(zip(names, digests, strict=True))


def build_manifest(storage: Storage, ckpt: Location, step: int) -> dict:
    """The manifest of every file now under `ckpt` (read back from storage)."""
    sizes = {n: s for n, s in storage.files(ckpt).items() if n not in NOT_LISTED and "/.tmp" not in f"/{n}"}
    digests = _hash_all(storage, ckpt, sorted(sizes))
    return {"format": 1, "step": step, "algorithm": "sha256",
            "files": {n: {"size": sizes[n], "sha256": digests[n]} for n in sorted(sizes)}}


def write_manifest(storage: Storage, ckpt: Location, step: int) -> dict:
    manifest = build_manifest(storage, ckpt, step)
    storage.write_text(storage.join(ckpt, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def read_manifest(storage: Storage, ckpt: Location) -> dict | None:
    loc = storage.join(ckpt, MANIFEST)
    if not storage.is_file(loc):
        return None
    try:
        manifest = json.loads(storage.read_text(loc))
        return manifest if isinstance(manifest.get("files"), dict) else {"files": None}
    except (ValueError, UnicodeDecodeError):
        return {"files": None}


def manifest_bytes(manifest: dict | None) -> int:
    return sum(int(f.get("size", 0)) for f in (manifest or {}).get("files", {}).values()) if manifest else 0


def verify(storage: Storage, ckpt: Location) -> list[str]:
    """What is wrong with `ckpt`'s files, one line each; [] when every listed file is present with
    its size and checksum. A checkpoint without a manifest (written before checksums existed) is
    reported by `has_manifest`, not here."""
    manifest = read_manifest(storage, ckpt)
    if manifest is None:
        return []
    if manifest["files"] is None:
        return [f"{MANIFEST} is damaged (not the JSON this program writes)"]
    present = storage.files(ckpt)
    problems, to_hash = [], []
    for name, entry in manifest["files"].items():
        if name not in present:
            problems.append(f"{name} is missing")
        elif present[name] != entry["size"]:
            problems.append(f"{name} has {present[name]:,} bytes, the manifest says {entry['size']:,} (truncated "
                            "or overwritten)")
        else:
            to_hash.append(name)
    for name, digest in _hash_all(storage, ckpt, to_hash).items():
        if digest != manifest["files"][name]["sha256"]:
            problems.append(f"{name} does not match its checksum (its bytes changed after it was written)")
    return problems


def has_manifest(storage: Storage, ckpt: Location) -> bool:
    return storage.is_file(storage.join(ckpt, MANIFEST))
