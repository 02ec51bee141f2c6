"""Token shards on an object store, read through a bounded local cache.

`RemoteShardSet` has `ShardSet`'s interface (`meta`, `tokens[i]`, `flags[i]`, `n_tokens`): its
shards are whole files fetched into a local directory, verified against `meta.json`'s size and
SHA-256 (a corrupt one is refused, naming it and both hashes), renamed into place and
memory-mapped. The cache holds at most `limit` shards, plus the one being downloaded; it evicts the
least recently used shard that the loader does not need now. The loader reads in windows of
`window` shards (data/order.py) and tells the cache (`advise`) which shards the current window
and the next one hold: one background thread fetches the next window's while the current one is
read, so the limit must hold two windows for the prefetch to run ahead (window = limit // 2 by
default). A shard the loader asks for that is not there yet is fetched first.

Each process has its own cache directory (`rank<RANK>`), reused by a restarted run: the files
there were verified before they were renamed into place.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ultratron.atomic import is_temp, temp_path
from ultratron.data.objstore import Remote
from ultratron.data.shards import META, verify_shard
from ultratron.errors import DataError


class ShardCache:
    def __init__(self, remote: Remote, meta: dict, directory: Path, limit: int):
        if limit < 1:
            raise DataError(f"data.cache_limit={limit}: the cache must hold at least one shard")
        self.remote, self.meta, self.dir, self.limit = remote, meta, directory, limit
        self.dtype, self.packed = np.dtype(meta["dtype"]), bool(meta.get("packed"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cached: OrderedDict[int, tuple[np.ndarray, np.ndarray | None]] = OrderedDict()  # LRU first
        self.now: list[int] = []  # the shards of the current window, then of the next one
        self.next: list[int] = []
        self.urgent: int | None = None
        self.errors: dict[int, Exception] = {}
        self.in_flight: int | None = None
        self.fetched_bytes = self.hits = self.misses = 0
        self.lock = threading.Condition()
        self._adopt()
        self.closed = False
        self.worker = threading.Thread(target=self._work, name="shard-prefetch", daemon=True)
        self.worker.start()

    # ---- files --------------------------------------------------------------------------------
    def _files(self, i: int) -> list[Path]:
        name = self.meta["shards"][i]["name"]
        return [self.dir / f"{name}.bin"] + ([self.dir / f"{name}.flags.bin"] if self.packed else [])

    def _adopt(self) -> None:
        """Take over what an earlier run left (whole, verified files), the newest last; remove the rest."""
        by_name = {s["name"]: i for i, s in enumerate(self.meta["shards"])}
        found = []
        for path in self.dir.iterdir():
            if is_temp(path.name) or not path.name.endswith(".bin"):
                path.unlink(missing_ok=True)
                continue
            i = by_name.get(path.name.removesuffix(".flags.bin").removesuffix(".bin"))
            if i is None:
                path.unlink(missing_ok=True)
            elif path.name.endswith(".bin") and not path.name.endswith(".flags.bin"):
                found.append((path.stat().st_mtime, i))
        for _, i in sorted(found):
            if all(p.is_file() for p in self._files(i)) and self._files(i)[0].stat().st_size == \
                    self.meta["shards"][i]["n_tokens"] * self.dtype.itemsize:
                self.cached[i] = self._map(i)
        while len(self.cached) > self.limit:
            self._evict(next(iter(self.cached)))

    def _map(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        files = self._files(i)
        tokens = np.memmap(files[0], dtype=self.dtype, mode="r")
        return tokens, (np.memmap(files[1], dtype=np.uint8, mode="r") if self.packed else None)

    def _evict(self, i: int) -> None:
        self.cached.pop(i)
        for path in self._files(i):
            path.unlink(missing_ok=True)  # an open mapping keeps its pages until it is dropped

    def _download(self, i: int) -> list[Path]:
        """Fetch shard i's files under temporary names and verify them; returns the temporaries
        (renamed into place by `_work` once the cache has room: never limit + 1 whole shards)."""
        entry, done = self.meta["shards"][i], []
        try:
            for path, flags in zip(self._files(i), (False, True), strict=False):
                done.append(tmp := temp_path(path))
                self.remote.download(self.remote.child(path.name), tmp)
                verify_shard(tmp, entry, f"{self.remote.child(path.name)}", flags=flags)
        except BaseException:
            for tmp in done:
                tmp.unlink(missing_ok=True)
            raise
        return done

    # ---- the prefetching thread ---------------------------------------------------------------
    def _pick(self) -> int | None:
        """The next shard to fetch: the one asked for, else the first wanted one missing while there
        is room (a free slot, or a cached shard no window needs)."""
        if self.urgent is not None and self.urgent not in self.cached:
            return self.urgent
        wanted = set(self.now) | set(self.next)
        room = len(self.cached) < self.limit or any(i not in wanted for i in self.cached)
        for i in self.now + self.next:
            if i not in self.cached and i not in self.errors and room:
                return i
        return None

    def _make_room(self, keep: int) -> None:
        wanted = set(self.now) | set(self.next) | {keep}
        while len(self.cached) >= self.limit:
            spare = [i for i in self.cached if i not in wanted] or [i for i in self.cached if i not in self.now]
            self._evict(spare[0] if spare else next(iter(self.cached)))

    def _work(self) -> None:
        while True:
            with self.lock:
                while not self.closed and (i := self._pick()) is None:
                    self.lock.wait()
                if self.closed:
                    return
                self.in_flight = i
            try:
                fetched, error = self._download(i), None
            except Exception as err:  # kept for the reader that needs the shard
                fetched, error = [], err
            with self.lock:
                self.in_flight = None
                if error is not None:
                    self.errors[i] = error
                else:
                    self._make_room(i)  # first, so that the new shard is never one too many
                    for tmp, path in zip(fetched, self._files(i), strict=True):
                        self.fetched_bytes += tmp.stat().st_size
                        tmp.replace(path)
                    self.cached[i] = self._map(i)
                if self.urgent == i:
                    self.urgent = None
                self.lock.notify_all()

    # ---- the reader's side --------------------------------------------------------------------
    def advise(self, now: list[int], next_: list[int]) -> None:
        with self.lock:
            if now != self.now or next_ != self.next:
                self.now, self.next = now, next_
                self.lock.notify_all()

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        entry = self.cached.get(i)  # the warm path takes no lock: one dict operation is atomic
        if entry is not None:
            self.hits += 1
            try:
                self.cached.move_to_end(i)
            except KeyError:  # evicted meanwhile by the prefetching thread; its mapping stays valid
                pass
            return entry
        with self.lock:
            if i in self.cached:
                self.hits += 1
            else:
                self.misses += 1
                while i not in self.cached:
                    if i in self.errors:
                        err = self.errors.pop(i)
                        if isinstance(err, DataError):  # corrupt: refused
                            raise err
                        name = self.remote.child(self._files(i)[0].name)
                        raise DataError(f"fetching shard {name} failed: {type(err).__name__}: {err}") from err
                    self.urgent = i
                    self.lock.notify_all()
                    self.lock.wait()
            self.cached.move_to_end(i)
            return self.cached[i]

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()


class _Lazy:
    """`tokens[i]` / `flags[i]` of a remote set: the cached shard's memmap."""

    def __init__(self, cache: ShardCache, part: int):
        self.cache, self.part = cache, part

    def __getitem__(self, i: int) -> np.ndarray:
        return self.cache.get(i)[self.part]


class _LazyTokens(_Lazy):
    """`tokens[i]`, called once per sequence read: the warm path inlined (`ShardCache.get`)."""

    def __getitem__(self, i: int) -> np.ndarray:
        cache = self.cache
        entry = cache.cached.get(i)
        if entry is None:
            return cache.get(i)[0]
        cache.hits += 1
        try:
            cache.cached.move_to_end(i)  # least recently used first
        except KeyError:  # evicted meanwhile; its mapping stays valid
            pass
        return entry[0]

    def __len__(self) -> int:
        return len(self.cache.meta["shards"])


class RemoteShardSet:
    """A finished shard set at an object-store URL (its `meta.json` written last, as locally)."""

    def __init__(self, url: str, cache_dir: Path, *, limit: int, window: int = 0, endpoint: str | None = None):
        try:
            self.remote = Remote(url, endpoint)
            text = self.remote.read_bytes(self.remote.child(META))
        except FileNotFoundError:
            raise DataError(f"{url}: not a finished shard set (no {META})") from None
        except (ImportError, ValueError, OSError) as err:
            raise DataError(f"{url}: {err}") from None
        import json

        self.root, self.meta = url, json.loads(text)
        self.window = window or max(1, limit // 2)
        if self.window > limit:
            raise DataError(f"data.window={window} shards does not fit data.cache_limit={limit} shards")
        self.cache = ShardCache(self.remote, self.meta, Path(cache_dir), limit)
        self.tokens = _LazyTokens(self.cache, 0)
        self.flags = _Lazy(self.cache, 1) if self.meta.get("packed") else None

    @property
    def n_tokens(self) -> int:
        return self.meta["n_tokens"]

    def advise(self, now: list[int], next_: list[int]) -> None:
        self.cache.advise(now, next_)

    def metrics(self) -> dict[str, float]:
        c = self.cache
        return {"data/fetched_bytes": c.fetched_bytes, "data/cache_hits": c.hits, "data/cache_misses": c.misses}

    def close(self) -> None:
        self.cache.close()


_OPEN: dict[tuple, RemoteShardSet] = {}


def open_remote(url: str, cache_dir: Path, *, limit: int, window: int = 0, endpoint: str | None = None):
    """The set at `url` cached in `cache_dir`, one per process and directory: the validation loader,
    opened anew at every validation, reuses the cache (and its thread) instead of starting another."""
    key = (url, str(cache_dir), limit, window, endpoint)
    if key not in _OPEN:
        _OPEN[key] = RemoteShardSet(url, cache_dir, limit=limit, window=window, endpoint=endpoint)
    return _OPEN[key]


PREPARED_FILES = ("tokenizer.json", "tokenizer_config.json", "train/meta.json", "val/meta.json")


def fetch_prepared(url: str, local: Path, endpoint: str | None = None) -> Path:
    """A prepared directory's small files (tokenizer, the splits' meta.json) copied from `url` into
    `local`, so that the tokenizer loads and the splits are checked as for a local directory."""
    found: dict[str, bytes] = {}
    try:
        remote = Remote(url, endpoint)
        for name in PREPARED_FILES:  # each file asked for by name: listing the prefix would page through every shard
            try:
                found[name] = remote.read_bytes(remote.child(name))
            except FileNotFoundError:
                continue
    except (ImportError, ValueError, OSError) as err:
        raise DataError(f"data.path {url!r}: {err}") from None
    if "tokenizer.json" not in found or "train/meta.json" not in found:
        raise DataError(f"data.path {url!r} is not a prepared directory on the object store (tokenizer.json and "
                        "train/meta.json, as `ultratron data run` writes)")
    from ultratron import atomic

    for name, data in found.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(local / name, data)
    return local
