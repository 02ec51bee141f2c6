"""The whole parallel topology in one object. The distributed work builds its DeviceMesh here."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ultratron.config import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    world_size: int = 1
    rank: int = 0

    @classmethod
    def from_config(cls, parallel_cfg) -> ParallelDims:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        dims = cls(dp=parallel_cfg.dp, tp=parallel_cfg.tp, pp=parallel_cfg.pp, cp=parallel_cfg.cp,
                   ep=parallel_cfg.ep, world_size=world, rank=rank)
        dims.validate()
        return dims

    @property
    def product(self) -> int:
        # Expert parallelism reuses data-parallel ranks, so it does not multiply the world size.
        return self.dp * self.tp * self.pp * self.cp

    def validate(self) -> None:
        if self.product != self.world_size:
            raise ConfigError([
                f"parallel layout dp×tp×pp×cp = {self.dp}×{self.tp}×{self.pp}×{self.cp} = {self.product} "
                f"does not equal the number of processes ({self.world_size}); launch with "
                f"torchrun --nproc-per-node {self.product} or change the layout"
            ])
        if self.world_size > 1:
            raise ConfigError([
                f"this build of ultratron trains in one process; a layout of {self.world_size} processes "
                "needs the distributed training core (not built yet)"
            ])

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp if self.dp > 1 else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0
