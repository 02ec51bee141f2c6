"""What the training loop calls to run the same code in one process or many: rank-0-only logging,
data prepared once, sharded checkpoints, and the global loss and gradient norm. Each function is
a no-op (or the one-process behaviour) when there is one process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from ultratron.parallel.data_parallel import average_over_dp, wrap_optimizer
from ultratron.parallel.dims import ParallelDims
from ultratron.parallel.grads import clip_grad_norm
from ultratron.parallel.tensor_parallel import local_value

__all__ = ["QuietLog", "QuietMetrics", "average_over_dp", "barrier", "clip_grad_norm", "local_value",
           "load_parallel", "main_first", "save_sharded", "wrap_optimizer"]

T = TypeVar("T")


class QuietLog:
    """The RunLog of a rank other than 0: messages are dropped, so the run logs once."""

    echo = False
    _writer = None

    def __call__(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass


class QuietMetrics:
    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def barrier(dims: ParallelDims) -> None:
    if dims.distributed and dist.is_initialized():
        dist.barrier()


def main_first(dims: ParallelDims, work: Callable[[], T]) -> T:
    """Rank 0 does `work` (e.g. training the tokenizer and writing shards) while the others wait;
    then the others do it too, which finds the cache rank 0 left and only reads it."""
    if dims.is_main:
        result = work()
        barrier(dims)
        return result
    barrier(dims)
    return work()


def save_sharded(trainer, state: dict) -> Path:
    from ultratron.checkpoint.distributed import save_sharded as save
    from ultratron.config import to_toml

    return save(trainer.checkpoints, trainer.step, model=trainer.model, optimizer=trainer.optimizer,
                state=state, config_toml=to_toml(trainer.cfg), tokenizer_json=trainer.tokenizer.to_json(),
                is_main=trainer.dims.is_main)


def load_parallel(trainer, ckpt: Path) -> dict | None:
    """Load weights and optimizer from a sharded checkpoint (any layout), or from a one-process
    checkpoint under a parallel layout; returns its saved state. None when the one-process loader
    should handle it."""
    from ultratron.checkpoint.distributed import is_sharded_checkpoint, load_full_into_layout, load_sharded
    from ultratron.checkpoint.manager import load_checkpoint

    if is_sharded_checkpoint(ckpt):
        return load_sharded(ckpt, trainer.model, trainer.optimizer)
    if not trainer.dims.distributed:
        return None
    parts = load_checkpoint(ckpt, map_location="cpu")
    load_full_into_layout(parts, trainer.model, trainer.optimizer)
    return parts["state"]
