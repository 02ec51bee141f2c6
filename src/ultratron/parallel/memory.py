"""Measured bytes this rank holds for parameters, gradients and optimizer state (local shards
only), and the peak of the activations autograd keeps for backward, to compare with `ultratron
plan memory` (`ultratron.planning.memory.estimate_memory`). On CPU there are no allocator
statistics; what the saved-tensor hooks see is what the planner counts as activations."""

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


class _Saved:
    """A tensor autograd saved; its storage stops counting when the last of these for it is dropped."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: SavedActivations, key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class SavedActivations:
    """Within `with meter:`, the bytes of the tensors autograd keeps for backward that are alive at
    once (`live`) and their largest sum (`peak`), each storage counted once however many ops save
    it; the model's parameters and buffers (saved by the matmuls) are not activations."""

    def __init__(self, model: nn.Module):
        self.constant = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.counts: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0
        self._hooks = None

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.constant or storage.nbytes() == 0:
            return tensor
        if self.counts.get(key, 0) == 0:
            self.sizes[key] = storage.nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.counts[key] = self.counts.get(key, 0) + 1
        # detached: a saved output holding its own grad_fn would make a cycle autograd never frees
        return _Saved(tensor.detach(), self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        self.counts[key] -= 1
        if self.counts[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.counts[key]

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
