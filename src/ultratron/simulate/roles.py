"""Which ranks a simulation runs. Torch-free.

Within a pipeline stage every rank does the same work on other data or another shard (the dp, cp,
tp and ep coordinates are symmetric: same shapes, same collectives in their own groups), so one rank
per distinct pipeline rank stands for all; pipeline ranks differ by the stages they hold (first,
middle, last) and by how many layers those have, and middle ranks with the same layers are one role.
"""

from __future__ import annotations

from dataclasses import dataclass

from ultratron.errors import UserError
from ultratron.planning.layout import Layout


@dataclass(frozen=True)
class Coordinates:
    rank: int
    pp: int
    dp: int
    cp: int
    tp: int
    ep: int

    def describe(self) -> str:
        return f"pp{self.pp} dp{self.dp} cp{self.cp} tp{self.tp}" + (f" ep{self.ep}" if self.ep else "")


def coordinates(layout: Layout, rank: int) -> Coordinates:
    """A rank's place in the mesh (pp outermost, then dp, cp, tp; ep the innermost part of dp), as
    `parallel.dims.ParallelDims` lays it out."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    dp_rank = (rank // (tp * cp)) % dp
    return Coordinates(rank, rank // (dp * cp * tp), dp_rank, (rank // tp) % cp, rank % tp,
                       dp_rank % layout.ep if layout.ep > 1 else 0)


def role_ranks(layout: Layout, pipeline_roles: list[tuple[str, tuple[int, ...]]]) -> dict[int, str]:
    """rank → role for the default selection: for each distinct pipeline role (its name and the
    layers of its stages; `pipeline_roles` gives them per pipeline rank) the rank at dp = cp = tp = 0
    of its first pipeline rank. With ep the expert holders are every rank (each holds E/ep experts),
    so the same ranks stand for them."""
    per_stage = layout.dp * layout.cp * layout.tp
    chosen: dict[int, str] = {}
    seen: set = set()
    for pp_rank, (name, layers) in enumerate(pipeline_roles):
        if (name, layers) in seen:
            continue
        seen.add((name, layers))
        label = name if layout.pp > 1 else "every rank"
        if layout.ep > 1:
            label += " (expert holder)"
        chosen[pp_rank * per_stage] = label
    return chosen


def parse_ranks(text: str, world: int) -> list[int] | None:
    """--ranks: 'roles' → None (the default selection), 'all', or a comma list of ranks and ranges
    (0,3,8-11)."""
    text = text.strip()
    if text == "roles":
        return None
    if text == "all":
        return list(range(world))
    ranks: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        try:
            low, _, high = item.partition("-")
            lo, hi = int(low), int(high or low)
        except ValueError:
            raise UserError(f"--ranks takes all, roles or a comma list of ranks and ranges (0,3,8-11), got "
                            f"{item!r}") from None
        if not 0 <= lo <= hi < world:
            raise UserError(f"--ranks {item}: ranks run from 0 to {world - 1} in this layout")
        ranks.update(range(lo, hi + 1))
    return sorted(ranks)
