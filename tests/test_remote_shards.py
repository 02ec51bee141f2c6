"""Token shards on an object store (data/remote.py, data/order.py) on the loopback S3 server: the
windowed order visits every sequence once per epoch and needs one window at a time, the local cache
stays within data.cache_limit + the shard being fetched, a corrupt shard is refused naming it and
both hashes, a resume at any position gets its first batch at once, and the local order is the one
it always was."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import S3_BUCKET
from ultratron.atomic import is_temp
from ultratron.data.loader import TokenLoader
from ultratron.data.order import GlobalOrder, WindowedOrder, permutation
from ultratron.data.remote import RemoteShardSet
from ultratron.data.shards import ShardSet, ShardWriter
from ultratron.errors import DataError

SEQ = 16


def write_set(root, n_docs=240, tokens_per_shard=350) -> dict:
    rng = np.random.default_rng(0)
    writer = ShardWriter(root, vocab_size=500, eos_id=0, tokenizer_sha256="t", tokens_per_shard=tokens_per_shard)
    for _ in range(n_docs):
        writer.add(list(rng.integers(1, 500, int(rng.integers(20, 120)))))
    return writer.close()


def size_of(path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # evicted since it was listed
        return 0


@pytest.fixture
def remote_set(s3, tmp_path):
    server, fs = s3
    meta = write_set(tmp_path / "local")
    prefix = f"{S3_BUCKET}/sets/{tmp_path.name}"
    fs.put(str(tmp_path / "local") + "/", prefix + "/", recursive=True)
    return f"s3://{prefix}", server.endpoint, meta, fs


def test_windowed_order_is_a_permutation_per_epoch_within_windows():
    first = np.concatenate([[0], np.cumsum(np.random.default_rng(1).integers(0, 9, 23))])
    order = WindowedOrder(first, seed=3, window=4)
    n = int(first[-1])
    fresh = WindowedOrder(first, seed=3, window=4)  # a batch at a time, as the loader asks, across epochs
    for epoch in range(3):
        seq = order.in_epoch(epoch, np.arange(n))
        assert sorted(seq.tolist()) == list(range(n))
        assert np.array_equal(np.concatenate([fresh.in_epoch(epoch, np.arange(i, min(i + 5, n)))
                                              for i in range(0, n, 5)]), seq)
        shard_of = np.searchsorted(first, seq, side="right") - 1
        _, starts = order._epoch(epoch)
        for w in range(len(starts) - 1):  # each window's positions read only that window's shards
            assert set(shard_of[starts[w]:starts[w + 1]].tolist()) <= set(order.window_shards(epoch, w))
    assert not np.array_equal(order.in_epoch(0, np.arange(n)), order.in_epoch(1, np.arange(n)))
    tail = np.arange(n - 3, n)  # the same offsets in another epoch (a rollback, a rewind): that epoch's order
    fresh.in_epoch(0, tail)
    assert np.array_equal(fresh.in_epoch(1, tail), WindowedOrder(first, seed=3, window=4).in_epoch(1, tail))


def test_the_local_order_is_the_global_permutation_it_always_was():
    first = np.array([0, 40, 90, 91, 200])
    got = GlobalOrder(first, seed=7).in_epoch(2, np.arange(200))
    assert got.dtype == np.int64 and np.array_equal(got, np.random.default_rng([7, 2]).permutation(200))
    assert GlobalOrder(first, seed=7)._order(0).dtype == np.uint32  # 4 bytes a sequence, not 8
    for n in (1, 2, 1000, 123_457):  # made as uint32 and shuffled in place: numpy's permutation, value for value
        assert np.array_equal(permutation([5, 1], n), np.random.default_rng([5, 1]).permutation(n))


def test_two_epochs_through_a_cache_of_four_shards(remote_set, tmp_path):
    url, endpoint, meta, _ = remote_set
    assert len(meta["shards"]) >= 40  # ≥ 10× the cache
    shards = RemoteShardSet(url, tmp_path / "cache", limit=4, endpoint=endpoint)
    loader = TokenLoader(shards, seq_len=SEQ, micro_batch_size=4, dp_world=2)
    local = TokenLoader(ShardSet.open(tmp_path / "local"), seq_len=SEQ, micro_batch_size=4, dp_world=2)
    biggest, most, seen = max(s["bytes"] for s in meta["shards"]), 0, []
    while loader.consumed < 2 * loader.n_sequences:
        seen += loader.next_indices().tolist()
        loader.consumed -= 8
        inputs, _ = loader.next_batch()
        for row, index in zip(inputs, seen[-4:], strict=True):  # the bytes are the local set's
            assert np.array_equal(row.numpy(), np.asarray(local._sequence(index)[0][:-1], dtype=np.int64))
        files = list((tmp_path / "cache").iterdir())  # the prefetching thread works meanwhile
        most = max(most, sum(size_of(p) for p in files))
        assert len([p for p in files if not is_temp(p.name)]) <= 4  # whole shards: the limit
        assert len(files) <= 5  # and the one being fetched
    assert most <= 5 * biggest
    epoch_one = seen[:loader.n_sequences // 2 // 4 * 4]
    assert len(set(epoch_one)) == len(epoch_one)  # rank 0's half of epoch 1: no repeat
    dataset = sum(s["bytes"] for s in meta["shards"])
    metrics = loader.metrics()
    assert metrics["data/fetched_bytes"] <= 2 * 1.1 * dataset
    assert metrics["data/cache_hits"] > 10 * metrics["data/cache_misses"]
    shards.close()


def test_a_flipped_byte_in_a_remote_shard_is_refused_naming_it(remote_set, tmp_path):
    url, endpoint, meta, fs = remote_set
    key = url.removeprefix("s3://") + "/shard_00003.bin"
    data = bytearray(fs.cat_file(key))
    data[17] ^= 0x01
    fs.pipe_file(key, bytes(data))
    shards = RemoteShardSet(url, tmp_path / "cache", limit=4, endpoint=endpoint)
    with pytest.raises(DataError, match=rf"shard {url}/shard_00003.bin is corrupt: its sha256 is [0-9a-f]{{64}}, "
                                        rf"meta.json lists {meta['shards'][3]['sha256']}"):
        shards.tokens[3]
    assert not [p for p in (tmp_path / "cache").iterdir() if "shard_00003" in p.name]  # nothing corrupt kept
    assert shards.tokens[4] is not None  # the others read on
    shards.close()


def test_the_first_batch_after_a_resume_anywhere_comes_at_once(remote_set, tmp_path):
    url, endpoint, meta, _ = remote_set
    for i, position in enumerate((0, 977, 3 * 1000 + 5)):
        shards = RemoteShardSet(url, tmp_path / f"cold{i}", limit=4, endpoint=endpoint)
        loader = TokenLoader(shards, seq_len=SEQ, micro_batch_size=4, dp_world=2)
        loader.load_state_dict(loader.state_dict() | {"consumed": position})
        started = time.perf_counter()
        loader.next_batch()
        assert time.perf_counter() - started < 30
        shards.close()


def test_a_resume_with_another_window_is_refused(remote_set, tmp_path):
    url, endpoint, _, _ = remote_set
    saved = TokenLoader(RemoteShardSet(url, tmp_path / "a", limit=4, endpoint=endpoint), seq_len=SEQ,
                        micro_batch_size=4).state_dict()
    other = TokenLoader(RemoteShardSet(url, tmp_path / "b", limit=8, endpoint=endpoint), seq_len=SEQ,
                        micro_batch_size=4)
    with pytest.raises(DataError, match="saved window=2, now 4"):
        other.load_state_dict(saved)


def test_a_missing_set_is_named(s3, tmp_path):
    server, _ = s3
    with pytest.raises(DataError, match="not a finished shard set"):
        RemoteShardSet(f"s3://{S3_BUCKET}/nothing-here", tmp_path / "c", limit=2, endpoint=server.endpoint)


def test_a_failed_fetch_is_named(remote_set, tmp_path):
    url, endpoint, _, _ = remote_set
    shards = RemoteShardSet(url, tmp_path / "cache", limit=4, endpoint=endpoint)

    def unreachable(remote_url, local):
        raise ConnectionError("Cannot connect to host")

    shards.remote.download = unreachable
    with pytest.raises(DataError, match=rf"fetching shard {url}/shard_00002.bin failed: ConnectionError: Cannot"):
        shards.tokens[2]
    shards.close()


def test_a_mixture_of_a_local_and_a_remote_source_trains_and_resumes_exactly(s3, small_corpus, tmp_path):
    from conftest import TINY
    from tolerances import REPLAY
    from ultratron.config import load_config
    from ultratron.config.data import DataConfig
    from ultratron.data.prepare import prepare_data
    from ultratron.training.metrics import read_metrics
    from ultratron.training.trainer import train

    server, fs = s3
    prepare_data(DataConfig(path=str(small_corpus), extensions=".py", held_out_fraction=0.1), 512,
                 tmp_path / "local", log=lambda m: None)
    fs.put(str(tmp_path / "local") + "/", f"{S3_BUCKET}/mix/", recursive=True)
    common = TINY + ["--data.sources", f"here={tmp_path / 'local'},there=s3://{S3_BUCKET}/mix",
                     "--data.endpoint", server.endpoint, "--data.cache_limit", "2", "--training.steps", "4",
                     "--eval.interval", "2"]
    train(load_config(None, common + ["--run.dir", str(tmp_path / "full")]), echo=False)
    split = ["--run.dir", str(tmp_path / "split")]
    train(load_config(None, common + split + ["--training.stop_after", "2"]), echo=False)
    train(load_config(None, common + split + ["--checkpoint.resume", "auto"]), echo=False)
    full = {r["step"]: r for r in read_metrics(tmp_path / "full") if "loss" in r}
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "split") if "loss" in r}
    for step in range(3, 5):
        assert abs(resumed[step]["loss"] - full[step]["loss"]) <= REPLAY * abs(full[step]["loss"]), step
    assert full[4]["data/fetched_bytes"] > 0 and "val_loss/there" in full[4]
    assert "data fetched" in (tmp_path / "full" / "train.log").read_text()  # the progress line
