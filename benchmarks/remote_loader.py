"""Tokens/s of the loader over shards on an object store with a warm cache, against the local
memmap loader over the same shards (issue 46: at least 95 %).

  python benchmarks/remote_loader.py [--shards 16] [--shard-tokens 1000000] [--batches 3000] [--rounds 5]

Writes a synthetic shard set, serves it from moto's S3 server on loopback (the tests' server), and
reads it both ways: `TokenLoader` over the memory-mapped local set (its global order) and over
`RemoteShardSet` (windowed order, data.cache_limit = every shard, warmed by one pass first, so the
shards are in the local cache). Rounds alternate A B and B A; each figure is the median of the rounds'
tokens/s (micro-batches of seq_len 2,048 × 8 rows, one rank). Also the time to the first batch
after a resume at a random position with a cold cache.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ultratron.data.loader import TokenLoader
from ultratron.data.remote import RemoteShardSet
from ultratron.data.shards import ShardSet, ShardWriter

SEQ, ROWS = 2048, 8


def serve() -> str:
    from moto.server import ThreadedMotoServer

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False).start()
    return f"http://127.0.0.1:{port}"


def tokens_per_second(loader: TokenLoader, batches: int) -> float:
    started = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    return batches * ROWS * SEQ / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--shard-tokens", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="remote-loader-"))
    rng = np.random.default_rng(0)
    writer = ShardWriter(work / "set", vocab_size=32000, eos_id=0, tokenizer_sha256="bench",
                         tokens_per_shard=args.shard_tokens)
    for _ in range(args.shards * args.shard_tokens // 5000):
        writer.add(rng.integers(1, 32000, 4999))
    meta = writer.close()
    endpoint = serve()
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    fs.mkdir("bench")
    fs.put(str(work / "set") + "/", "bench/set/", recursive=True)
    n = len(meta["shards"])
    local = TokenLoader(ShardSet.open(work / "set"), seq_len=SEQ, micro_batch_size=ROWS)
    shards = RemoteShardSet("s3://bench/set", work / "cache", limit=n, endpoint=endpoint)
    remote = TokenLoader(shards, seq_len=SEQ, micro_batch_size=ROWS)
    warm = 0
    while remote.consumed < remote.n_sequences:  # one pass: every shard fetched into the cache
        remote.next_batch()
        warm += 1
    fetched = shards.metrics()["data/fetched_bytes"]
    figures = {"local memmap": [], "object store, warm cache": []}
    loaders = {"local memmap": local, "object store, warm cache": remote}
    for i in range(args.rounds):  # A B, then B A: neither always goes first
        for name in (list(loaders) if i % 2 == 0 else list(loaders)[::-1]):
            figures[name].append(tokens_per_second(loaders[name], args.batches))
    print(f"{n} shards, {meta['n_tokens']:,} tokens ({sum(s['bytes'] for s in meta['shards']) / 2**20:.0f} MiB); "
          f"warm-up pass {warm} batches fetched {fetched / 2**20:.0f} MiB")
    medians = {name: statistics.median(values) for name, values in figures.items()}
    for name, values in figures.items():
        print(f"{name:<26} median {medians[name] / 1e6:7.2f} M tokens/s  (rounds: "
              + ", ".join(f"{v / 1e6:.2f}" for v in values) + ")")
    best = {name: max(values) for name, values in figures.items()}  # the least disturbed round of each
    print(f"ratio of the medians {medians['object store, warm cache'] / medians['local memmap']:.3f}, "
          f"of the best rounds {best['object store, warm cache'] / best['local memmap']:.3f}")
    cold = []
    for i, position in enumerate(rng.integers(0, 3 * remote.n_sequences, 3)):
        loader = TokenLoader(RemoteShardSet("s3://bench/set", work / f"cold{i}", limit=4, endpoint=endpoint),
                             seq_len=SEQ, micro_batch_size=ROWS)
        loader.load_state_dict(loader.state_dict() | {"consumed": int(position)})
        started = time.perf_counter()
        loader.next_batch()
        cold.append(time.perf_counter() - started)
    print("first batch after a resume with a cold cache (limit 4): " + ", ".join(f"{t:.2f} s" for t in cold))


if __name__ == "__main__":
    main()
