"""Apply parallelism to a plain model from outside, in one fixed order:
TP/SP → CP → activation recomputation → compile → FSDP/DDP. One process applies only the
recomputation for now; each parallel axis plugs in here from its own module."""

from __future__ import annotations

from torch import nn

from ultratron.parallel.dims import ParallelDims
from ultratron.parallel.recompute import apply_recompute


def parallelize(model: nn.Module, dims: ParallelDims, cfg) -> nn.Module:
    return apply_recompute(model, cfg.training.recompute)
