"""Measured bytes this rank holds for parameters, gradients and optimizer state (local shards
only), the peak of the activations autograd keeps for backward, and every byte the CPU allocator
hands out in a stretch of a step — to compare with `ultratron plan memory`
(`ultratron.planning.memory.estimate_memory`). On CPU there are no allocator statistics:
`AllocatedBytes` reads torch.profiler's memory events instead, which also see what saved-tensor
hooks cannot (what a selective checkpoint caches, autocast's copies, the logits a step holds)."""

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


class AllocatedBytes:
    """Within `with meter:`, the CPU allocator's allocations and frees in time order (torch.profiler,
    `profile_memory=True`): `at(name)` — the bytes allocated since the start and still alive at
    `meter.mark(name)`; `peak` — the most alive at any moment; `end` — alive at the end. Frees of
    tensors allocated before the start are not seen, so measure a stretch that frees only what it
    allocated (a micro-batch's forward and backward, with the gradients already allocated).

    Kernel scratch is kept apart: bytes an operator's kernel allocates itself (not through another
    operator) and frees before that operator returns — oneDNN's scratchpad and weight packing
    (bf16 matmuls on CPUs with AVX-512 or AMX), a BLAS's workspace. It depends on which CPU and
    which kernel runs, not on the tensors a step creates, so `peak` and `at` leave it out;
    `scratch_peak` is the most of it alive at once, `raw_peak` the peak with it."""

    def __init__(self):
        self._profile = None
        self.marks: dict[str, int] = {}
        self.peak = self.end = self.raw_peak = self.scratch_peak = 0

    def __enter__(self) -> AllocatedBytes:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    @staticmethod
    def mark(name: str) -> None:
        with torch.profiler.record_function(f"ultratron.mark/{name}"):
            pass

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        allocations, marks = _allocation_events(self._profile.profiler.kineto_results.experimental_event_tree())
        scratch = _kernel_scratch(allocations)
        alive = raw = in_scratch = 0
        for index, (when, _, nbytes, _) in enumerate(allocations):
            while marks and marks[0][0] < when:
                self.marks[marks.pop(0)[1]] = alive
            raw += nbytes
            if index in scratch:
                in_scratch += nbytes
            else:
                alive += nbytes
            self.peak, self.raw_peak = max(self.peak, alive), max(self.raw_peak, raw)
            self.scratch_peak = max(self.scratch_peak, in_scratch)
        for _, name in marks:
            self.marks[name] = alive
        self.end = alive

    def at(self, name: str) -> int:
        return self.marks[name]


def _allocation_events(roots) -> tuple[list[tuple], list[tuple[int, str]]]:
    """[(time, address, bytes (< 0: a free), the operator event that did it)] in time order, and the
    marks [(time, name)], from the profiler's event tree."""
    from torch._C._profiler import _EventType

    allocations, marks, stack = [], [], [(root, None) for root in roots]
    while stack:
        event, parent = stack.pop()
        if event.typed[0] == _EventType.Allocation:
            fields = event.extra_fields
            allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size, parent))
        elif event.name.startswith("ultratron.mark/"):
            marks.append((event.start_time_ns, event.name.split("/", 1)[1]))
        stack.extend((child, event) for child in event.children)
    allocations.sort(key=lambda a: a[0])
    return allocations, sorted(marks)


def _kernel_scratch(allocations: list[tuple]) -> set[int]:
    """Indices of the allocations and frees of kernel scratch: allocated and freed directly by the
    same operator call (a tensor an operator returns is freed later, elsewhere)."""
    opened: dict[int, tuple[int, object]] = {}
    scratch: set[int] = set()
    for index, (_, address, nbytes, parent) in enumerate(allocations):
        if nbytes > 0:
            opened[address] = (index, parent)
        elif address in opened:
            start, owner = opened.pop(address)
            if owner is not None and owner is parent and not owner.name.startswith("ultratron.mark/"):
                scratch.update((start, index))
    return scratch


class LiveTensors:
    """Within `with meter:`, every tensor an op creates (a TorchDispatchMode, below DTensor: the local
    shards); `alive()` — the bytes of those whose storage is still alive, each storage once,
    leaving out the model's parameters, buffers and gradients. Unlike `AllocatedBytes` it also sees
    what a collective's own thread allocates (gloo's outputs), but not an op's internal scratch."""

    def __init__(self, model: nn.Module):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        self.model, self._weak = model, StorageWeakRef
        created: dict[int, tuple] = {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for tensor in tree_flatten(out)[0]:
                    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                    if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes():
                        ref = StorageWeakRef(tensor.untyped_storage())
                        created.setdefault(ref.cdata, (ref, tensor.untyped_storage().nbytes()))
                return out

        self._created, self._mode = created, _Mode()
        self._ignored: set[int] = set()

    def _model_storages(self) -> set[int]:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        return {self._weak((t.to_local() if isinstance(t, DTensor) else t).untyped_storage()).cdata for t in tensors}

    def during(self, module: nn.Module) -> list:
        """Record only while `module` runs (enter and exit with its forward), leaving out its inputs'
        storages, which an op inside may view (a DTensor made of one) though the module did not
        create them. Returns the hooks' handles, to remove."""

        def enter(module, args):
            for tensor in args:
                if isinstance(tensor, torch.Tensor):
                    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                    self._ignored.add(self._weak(tensor.untyped_storage()).cdata)
            self.__enter__()

        return [module.register_forward_pre_hook(enter),
                module.register_forward_hook(lambda *_: self.__exit__(None, None, None), always_call=True)]

    def alive(self) -> int:
        left_out = self._model_storages() | self._ignored
        return sum(nbytes for key, (ref, nbytes) in self._created.items() if not ref.expired() and key not in left_out)

    def __enter__(self) -> LiveTensors:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


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
