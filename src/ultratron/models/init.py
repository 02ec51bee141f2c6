"""Initialization as a function of (parameter name, position), never of the layout.

A parameter is drawn in fixed blocks of rows (`models/init_blocks.py`), each from its own generator
seeded by (run seed, parameter name, block index). A rank that holds some rows and columns of a
parameter draws only the blocks those rows fall in and keeps their columns; one process draws every
block. So a shard made on any rank, under any layout, holds bit for bit what one process puts at
those positions, and at most one block (16 MiB in fp32) is drawn beside the shards at a time.

What each parameter is drawn from is the family's `InitRule` (normal, uniform, or a constant); the
values depend on the device's generator (a CPU and a GPU draw different numbers from one seed), not
on how the parameter is cut. Nothing here knows about parallelism: the caller says which rows and
columns of the whole parameter its tensor holds (`Region`).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import torch

from ultratron.models.init_blocks import as_rows, block_rows


@dataclass(frozen=True)
class InitRule:
    """How one parameter is drawn: `normal` (mean 0, `scale` the std), `uniform` (±`scale`), or
    `constant` (every element `scale`)."""

    kind: str
    scale: float

    @staticmethod
    def normal(std: float) -> InitRule:
        return InitRule("normal", std)

    @staticmethod
    def uniform(bound: float) -> InitRule:
        return InitRule("uniform", bound)

    @staticmethod
    def constant(value: float) -> InitRule:
        return InitRule("constant", value)


# Per tensor dim, the half-open range [start, stop) of the whole parameter that a tensor holds.
Region = tuple[tuple[int, int], ...]


def whole(shape) -> Region:
    return tuple((0, size) for size in shape)


def block_seed(seed: int, name: str, block: int) -> int:
    """A generator seed for one block of one parameter (a stable hash: the same in every process)."""
    digest = hashlib.blake2b(f"{seed}\x00{name}\x00{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _draw(rule: InitRule, rows: int, cols: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    block = torch.empty(rows, cols, dtype=torch.float32, device=device)
    if rule.kind == "normal":
        return block.normal_(0.0, rule.scale, generator=generator)
    if rule.kind == "uniform":
        return block.uniform_(-rule.scale, rule.scale, generator=generator)
    raise ValueError(f"unknown init rule {rule.kind!r}")


def _row_runs(shape, region: Region):
    """The held rows as runs of consecutive rows of the (rows × cols) matrix: (first row, count,
    offset of the run among the held rows). The leading dims' ranges make one run per combination of
    all but the last leading dim (one run in all when only the first dim is cut)."""
    lead, lead_ranges = tuple(shape[:-1]), region[:-1]
    if len(shape) <= 1:  # a vector: its elements are rows of one column
        start, stop = region[0] if shape else (0, 1)
        yield start, stop - start, 0
        return
    inner = lead_ranges[-1]
    strides = [1] * len(lead)
    for d in range(len(lead) - 2, -1, -1):
        strides[d] = strides[d + 1] * lead[d + 1]
    offset = 0
    for outer in itertools.product(*(range(a, b) for a, b in lead_ranges[:-1])):
        base = sum(i * s for i, s in zip(outer, strides[:-1], strict=True))
        yield base + inner[0], inner[1] - inner[0], offset
        offset += inner[1] - inner[0]


@torch.no_grad()
def fill(tensor: torch.Tensor, rule: InitRule, name: str, shape, region: Region | None = None,
         seed: int = 0) -> None:
    """Write into `tensor` (contiguous; the part `region` of a parameter of global `shape`) the values
    that initialization puts there."""
    region = whole(shape) if region is None else region
    if rule.kind == "constant":
        tensor.fill_(rule.scale)
        return
    if tensor.numel() == 0:
        return
    _, cols = as_rows(shape)
    col_start, col_stop = region[-1] if len(shape) >= 2 else (0, 1)
    per_block = block_rows(shape)
    total_rows = as_rows(shape)[0]
    local = tensor.view(-1, col_stop - col_start)
    drawn: tuple[int, torch.Tensor] | None = None  # the last block drawn: runs often share one
    for first, count, at in _row_runs(tuple(shape), region):
        row = first
        while row < first + count:
            index = row // per_block
            start = index * per_block
            if drawn is None or drawn[0] != index:
                drawn = None  # let the previous block go before the next is drawn
                rows = min(per_block, total_rows - start)
                drawn = (index, _draw(rule, rows, cols, block_seed(seed, name, index), tensor.device))
            stop = min(first + count, start + per_block)
            dest = at + row - first
            local[dest:dest + stop - row].copy_(drawn[1][row - start:stop - start, col_start:col_stop])
            row = stop
