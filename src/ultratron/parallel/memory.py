"""Measured bytes this rank holds for parameters, gradients and optimizer state (local shards
only), to compare with `ultratron plan memory` (`ultratron.planning.memory.estimate_memory`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def measured_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    local_optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own shard
    optimizer_bytes = sum(_local_bytes(v) for state in local_optimizer.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer_states": optimizer_bytes}
