"""Layout-independent initialization (`models/init.py`): any part of a parameter filled on its own
holds exactly (bitwise) what filling the whole parameter puts at those positions, whatever the cut —
rows, columns, both, a middle dimension of a 3-D expert tensor, a vector's range, an empty part —
including cuts that straddle initialization's row blocks (the block size is shrunk here, so a small
tensor spans many blocks). Exact equality is the right check: both sides copy the same drawn
numbers, no arithmetic is involved, on any CPU.
"""

from __future__ import annotations

import pytest
import torch

from ultratron.models import init, init_blocks
from ultratron.models.init import InitRule, block_seed, fill


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 24 elements: a (10, 6) matrix is 3 blocks of 4 rows (the last of 2)."""
    monkeypatch.setattr(init_blocks, "INIT_BLOCK_ELEMENTS", 24)
    assert init_blocks.block_rows((10, 6)) == 4


NORMAL = InitRule.normal(0.02)


def _whole(shape, rule=NORMAL, name="layers.0.w", seed=7) -> torch.Tensor:
    out = torch.empty(shape)
    fill(out, rule, name, shape, seed=seed)
    return out


def _part(shape, region, rule=NORMAL, name="layers.0.w", seed=7) -> torch.Tensor:
    out = torch.empty([b - a for a, b in region])
    fill(out, rule, name, shape, region, seed=seed)
    return out


CUTS_2D = [
    ((0, 10), (0, 6)),  # the whole
    ((3, 7), (0, 6)),  # rows across a block boundary (fsdp, or tp's column-wise cut)
    ((0, 10), (2, 5)),  # columns (tp's row-wise cut)
    ((1, 9), (4, 6)),  # both (fsdp over tp)
    ((4, 8), (0, 6)),  # exactly one block
    ((9, 10), (5, 6)),  # one element of the last, short block
    ((5, 5), (0, 6)),  # an empty shard (more ranks than rows)
]


@pytest.mark.parametrize("region", CUTS_2D, ids=[str(c) for c in CUTS_2D])
def test_a_matrix_part_equals_the_whole_fills_slice(small_blocks, region):
    shape = (10, 6)
    expected = _whole(shape)[region[0][0]:region[0][1], region[1][0]:region[1][1]]
    assert torch.equal(_part(shape, region), expected)


CUTS_3D = [
    ((1, 3), (0, 5), (0, 4)),  # experts split over ep
    ((0, 4), (2, 5), (0, 4)),  # the middle dim (an expert's rows cut by fsdp under ep, or tp)
    ((1, 4), (1, 4), (1, 3)),  # every dim
]


@pytest.mark.parametrize("region", CUTS_3D, ids=[str(c) for c in CUTS_3D])
def test_a_3d_part_equals_the_whole_fills_slice(small_blocks, region):
    shape = (4, 5, 4)  # 20 rows of 4: blocks of 6 rows
    whole = _whole(shape)
    expected = whole[tuple(slice(a, b) for a, b in region)]
    assert torch.equal(_part(shape, region), expected)


def test_a_vector_range_and_the_uniform_rule(small_blocks):
    shape = (50,)  # 50 rows of one column: blocks of 24
    rule = InitRule.uniform(0.5)
    whole = _whole(shape, rule)
    assert torch.equal(_part(shape, ((20, 31),), rule), whole[20:31])
    assert whole.abs().max() <= 0.5 and whole.std() > 0.1  # drawn from ±0.5, not left empty


def test_constant_rule_and_blocks_are_independent_draws(small_blocks):
    assert torch.equal(_part((10, 6), ((2, 4), (1, 3)), InitRule.constant(1.0)), torch.ones(2, 2))
    whole = _whole((10, 6))
    assert not torch.equal(whole[0:4], whole[4:8])  # each block from its own seed
    # the block's seed is (seed, name, block): another name or seed draws other numbers
    assert not torch.equal(whole, _whole((10, 6), name="layers.1.w"))
    assert not torch.equal(whole, _whole((10, 6), seed=8))
    assert len({block_seed(7, "layers.0.w", b) for b in range(3)}) == 3


def test_the_whole_is_what_its_blocks_draw(small_blocks):
    """One process's value is defined by the block rule itself: block b of rows [4b, 4b+4) is a fresh
    generator seeded with block_seed(seed, name, b)."""
    whole = _whole((10, 6))
    for b, rows in enumerate(((0, 4), (4, 8), (8, 10))):
        g = torch.Generator().manual_seed(block_seed(7, "layers.0.w", b))
        drawn = torch.empty(rows[1] - rows[0], 6).normal_(0.0, 0.02, generator=g)
        assert torch.equal(whole[rows[0]:rows[1]], drawn)


def test_only_the_overlapping_blocks_are_drawn(small_blocks, monkeypatch):
    """A shard draws the blocks its rows fall in, each once, and never more than one block's rows."""
    drawn = []
    real = init._draw

    def counting(rule, rows, cols, seed, device):
        drawn.append((rows, cols))
        return real(rule, rows, cols, seed, device)

    monkeypatch.setattr(init, "_draw", counting)
    _part((10, 6), ((3, 7), (2, 5)))  # rows 3..6: blocks 0 and 1
    assert drawn == [(4, 6), (4, 6)]
