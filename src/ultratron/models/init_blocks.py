"""How initialization cuts a parameter into blocks (torch-free, so the planner prices the same rule).

A parameter of shape (d0, ..., dk) is seen as a matrix of rows = d0·...·d(k-1) and cols = dk (a
vector of n elements: n rows of one column). Initialization draws it in blocks of whole rows, each
from a generator seeded by (run seed, parameter name, block index): any rank can draw exactly the
blocks its shard overlaps, and the values do not depend on how the parameter is sharded
(`models/init.py`). One block is the largest tensor initialization allocates beside the shards.
"""

from __future__ import annotations

from math import prod

INIT_BLOCK_ELEMENTS = 1 << 22  # 4 Mi elements: a 16 MiB fp32 block


def as_rows(shape) -> tuple[int, int]:
    """(rows, cols) of a parameter's shape as initialization reads it."""
    shape = tuple(shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return prod(shape[:-1]), shape[-1]


def block_rows(shape) -> int:
    """Rows in each initialization block of a parameter (the last block may hold fewer)."""
    _, cols = as_rows(shape)
    return max(1, INIT_BLOCK_ELEMENTS // max(cols, 1))


def block_elements(shape) -> int:
    """Elements in the largest initialization block of a parameter."""
    rows, cols = as_rows(shape)
    return min(rows, block_rows(shape)) * cols
