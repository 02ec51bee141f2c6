import numpy as np
import pytest
import torch

from ultratron.data.loader import TokenLoader
from ultratron.data.shards import ShardSet, write_shards
from ultratron.errors import DataError


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 1000, size=int(rng.integers(5, 300))).tolist() for _ in range(200)]
    write_shards(docs, tmp_path / "s", vocab_size=1000, eos_id=0, tokenizer_sha256="x", tokens_per_shard=5000)
    return ShardSet.open(tmp_path / "s")


def stream(loader, n):
    return [loader.next_batch()[0] for _ in range(n)]


def test_shards_hold_every_document_followed_by_eos(shards):
    assert len(shards.meta["shards"]) > 3  # the small shard size forced several shards
    assert shards.meta["n_documents"] == 200
    starts = shards.document_starts(0)
    assert shards.tokens[0][starts[1] - 1] == 0 and shards.tokens[0].dtype == np.uint16


def test_two_ranks_are_disjoint_and_together_equal_one_rank(shards):
    one = TokenLoader(shards, seq_len=16, micro_batch_size=4, seed=3)
    ranks = [TokenLoader(shards, seq_len=16, micro_batch_size=2, dp_rank=r, dp_world=2, seed=3) for r in (0, 1)]
    for _ in range(1000):  # enough steps to wrap into a second epoch
        whole = one.next_indices()
        parts = [r.next_indices() for r in ranks]
        assert not set(parts[0]) & set(parts[1])
        assert np.array_equal(np.concatenate(parts), whole)
    assert one.epoch >= 1 and one.epoch == ranks[0].epoch


def test_targets_are_inputs_shifted_by_one(shards):
    loader = TokenLoader(shards, seq_len=16, micro_batch_size=4)
    inputs, targets = loader.next_batch()
    assert inputs.shape == (4, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_state_dict_resumes_the_exact_sequence(shards):
    loader = TokenLoader(shards, seq_len=16, micro_batch_size=4, seed=1)
    stream(loader, 37)
    state = loader.state_dict()
    expected = stream(loader, 30)
    resumed = TokenLoader(shards, seq_len=16, micro_batch_size=4, seed=1)
    resumed.load_state_dict(state)
    for a, b in zip(expected, stream(resumed, 30), strict=True):
        assert torch.equal(a, b)


def test_a_different_seed_gives_a_different_order(shards):
    a = TokenLoader(shards, seq_len=16, micro_batch_size=4, seed=1).next_indices()
    b = TokenLoader(shards, seq_len=16, micro_batch_size=4, seed=2).next_indices()
    assert not np.array_equal(a, b)


def test_state_from_other_data_is_refused(shards):
    loader = TokenLoader(shards, seq_len=16, micro_batch_size=4)
    other = TokenLoader(shards, seq_len=32, micro_batch_size=4)
    with pytest.raises(DataError, match="seq_len"):
        other.load_state_dict(loader.state_dict())


def test_unfinished_shard_directory_is_refused(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "shard_00000.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match="not a finished shard directory"):
        ShardSet.open(tmp_path / "half")


def _steps(ranks: list[TokenLoader], n_steps: int, per_step: int) -> list[list[int]]:
    """The sorted sequence ids each of `n_steps` optimizer steps consumed over all ranks of a layout
    (each rank reads per_step / (ranks × micro-batch) micro-batches a step: gradient accumulation)."""
    accumulation = per_step // (ranks[0].micro_batch_size * len(ranks))
    return [sorted(int(i) for _ in range(accumulation) for rank in ranks for i in rank.next_indices())
            for _ in range(n_steps)]


def test_the_position_is_global_so_any_layout_resumes_with_every_sequence_once(shards):
    """24 sequences a step: dp2 × 4 × 3 micro-batches, stopped after 77 steps and resumed at dp4 × 3,
    dp1 × 8, dp3 × 8 (and with a state from before the position was global): each step consumes the
    same sequences as the run that never stopped, over two epochs' boundaries."""
    layout = lambda world, mbs: [TokenLoader(shards, seq_len=16, micro_batch_size=mbs, dp_rank=r, dp_world=world,
                                             seed=3) for r in range(world)]
    per_step, total = 24, 200
    n = layout(1, 1)[0].n_sequences
    assert total * per_step > 2 * n and n % 8 != 0  # crosses epochs at a point no micro-batch step divides
    straight = _steps(layout(2, 4), total, per_step)
    counts = np.bincount([i for step in straight for i in step], minlength=n)
    assert counts.max() - counts.min() <= 1  # every sequence read once an epoch, none twice before all once
    for world, mbs in ((4, 3), (1, 8), (3, 8)):
        first = layout(2, 4)
        before = _steps(first, 77, per_step)
        state = first[0].state_dict()
        assert state["consumed"] == 77 * per_step and all(r.state_dict() == state for r in first)
        resumed = layout(world, mbs)
        for rank in resumed:
            rank.load_state_dict(state)
        assert before + _steps(resumed, total - 77, per_step) == straight, (world, mbs)
    old = layout(1, 8)[0]  # a checkpoint written before the position was global
    old.load_state_dict({"epoch": 1, "position": 40, "seed": 3, "n_sequences": n, "seq_len": 16})
    reference = layout(1, 1)[0]
    assert old.consumed == n + 40 and list(old.next_indices()) == list(reference.indices_at(n + 40, 8))
    assert list(reference.indices_at(n + 40, 8)) == list(np.random.default_rng([3, 1]).permutation(n)[40:48])
