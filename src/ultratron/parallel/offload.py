"""Activation offload to host memory, applied from outside the model to each transformer block.

While a block runs forward, every tensor autograd saves for its backward (but the block's weights and
the model's buffers) is copied to host memory and the device copy let go; backward copies it back
when it unpacks it (torch's `saved_tensors_hooks`). On CUDA the host copy is pinned and made on a side
stream, overlapped with the next ops' compute (the tensor's memory is kept from reuse until the copy
is done, `record_stream`); on a CPU host and device are one memory, so the mechanism is checked for
correctness and for its accounting (`HostActivations.moved`), not for memory saved.

A storage saved twice within a block (one input of two ops, or views of one tensor) moves once.
Under selective recompute the outputs the checkpoint keeps are held by the checkpoint's own cache,
not by autograd, and stay put; under full recompute only each block's input is saved: offload and
recompute compose (the same training), each keeping what the other leaves. A storage several saved
tensors view comes back once.

The host buffers come from a pool (`PinnedPool`) that hands the same buffers out again at every
micro-batch, pinned once, not allocated per tensor. Backward takes a block's storages back together
when it first unpacks one of them, and at the same time starts the copy back of the block before it
(whose backward runs next) on the side stream: one block ahead, so the copy overlaps the running
block's backward instead of stalling it. On a CPU the same code runs without streams: the order of
the fetches (`HostActivations.fetches`) and the pool's reuse are what tests/test_offload.py checks.

The weights are the block's parameters as its forward sees them, taken as it starts (`hooks`), not
when offload is applied: FSDP2 (ZeRO-2/3, applied after offload) swaps in gathered weights (bf16
under its mixed precision; memory allocated at each gather) in its pre-forward hook, and keeps them
for backward (ZeRO-2) or gathers them again (ZeRO-3). Copying them would free nothing on the device
and add the block's weights to each micro-batch's host traffic; so in fp32 under ZeRO-2/3 the bytes
moved are one process's for the same micro-batch (tests/distributed/test_dist_offload.py). (The
model's storages when offload was applied are freed by then, and activations' may take their keys.)
Autocast's bf16 copies of fp32 weights (one process, DDP, ZeRO-1), which the matmuls save, do move.
Autocast's cache holds them only until the micro-batch's forward leaves autocast; from then on the
saved tensor is their only owner, so kept they would stay through backward beside the loss's
gradients and the returned activations, while moved only the running block's come back. That costs
2 bytes per weight each way per micro-batch, and is what the planner counts on the host
(`planning/activations.py`, "bf16 weight copies"). Moved or kept, backward gets the same bits.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from ultratron.models.plan import ParallelPlan


class PinnedPool:
    """Host buffers for the moved storages, kept and handed out again by size: a block saves storages
    of the same sizes at every micro-batch, so after the first step offload allocates nothing. Pinned
    (page-locked) on CUDA, which is what makes the copies asynchronous DMAs; pinning is slow (a system
    call per buffer), so it is done once per buffer, not once per tensor per step. On CUDA every copy
    into or out of a buffer runs on the one side stream, so a buffer given back after its copy to the
    device was issued is reused only after that copy, in stream order. `allocated`: buffers made."""

    def __init__(self, pinned: bool):
        self.pinned, self.free, self.allocated = pinned, {}, 0

    def take(self, nbytes: int) -> torch.UntypedStorage:
        kept = self.free.get(nbytes)
        if kept:
            return kept.pop()
        self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned).untyped_storage()

    def give(self, buffer: torch.UntypedStorage) -> None:
        self.free.setdefault(buffer.nbytes(), []).append(buffer)


class Moved:
    """One storage moved to the host: its buffer until it is fetched back, then its device copy."""

    __slots__ = ("host", "device", "nbytes", "returned", "storage")

    def __init__(self, host, nbytes: int, storage: StorageWeakRef):
        self.host, self.device, self.nbytes, self.returned, self.storage = host, None, nbytes, False, storage


class Group:
    """The storages one block's forward moved, fetched back together when its backward starts. It lives
    as long as autograd keeps the block's saved tensors (their unpack hook holds it)."""

    def __init__(self, index: int):
        self.index, self.moved, self.fetched, self.ready = index, [], False, None


class HostActivations:
    """The hooks and their accounting: `moved` bytes copied to the host since the last `reset`,
    `on_host` bytes there now (the most at once: `peak_on_host`), `returned` bytes copied back;
    `fetches` the (group, ahead) of each block's copy back, in order: ahead when it was prefetched
    while the block after it ran backward."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.stream = self.pool = None
        self.groups = 0  # block forwards so far; the one before group i is group i - 1, while it lives
        self.alive: weakref.WeakValueDictionary[int, Group] = weakref.WeakValueDictionary()
        self.reset()

    def reset(self) -> None:
        self.moved = self.returned = self.on_host = self.peak_on_host = 0
        self.fetches: list[tuple[int, bool]] = []

    # where the host copies go: None, the real host (pinned on CUDA; on a CPU a copy in the same
    # memory); "meta" for `ultratron simulate`, whose fake device then frees what moved and allocates
    # it again when backward takes it back, as a GPU's memory would
    host_device: str | None = None

    def _side(self, device: torch.device):
        """The side stream the copies run on (CUDA), or None."""
        if device.type != "cuda":
            return None
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def _copy_to_host(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        if self.host_device is not None:
            return torch.empty(storage.nbytes(), dtype=torch.uint8, device=self.host_device).untyped_storage()
        if self.pool is None:
            self.pool = PinnedPool(pinned=storage.device.type == "cuda")
        side = self._side(storage.device)
        if side is None:
            host = self.pool.take(storage.nbytes())
            host.copy_(storage)
            return host
        side.wait_stream(torch.cuda.current_stream(storage.device))
        with torch.cuda.stream(side):
            host = self.pool.take(storage.nbytes())
            host.copy_(storage, non_blocking=True)
        # the device memory is not reused before the copy is done
        torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).record_stream(side)
        return host

    def _fetch(self, group: Group, device: torch.device, ahead: bool) -> None:
        """Copy a block's storages back to the device (on the side stream, on CUDA) and give their
        buffers back to the pool."""
        group.fetched = True
        self.fetches.append((group.index, ahead))
        side = self._side(device)
        records = [r for r in group.moved if r.host is not None]
        for record in records:  # allocated on the compute stream, which uses them
            record.device = torch.UntypedStorage(record.nbytes, device=device)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))  # (the memory may have been freed just now)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for record in records:
                record.device.copy_(record.host, non_blocking=side is not None)
                if side is not None:  # (written on the side stream: not reused before the copy is done)
                    torch.empty(0, dtype=torch.uint8, device=device).set_(record.device).record_stream(side)
                self.pool.give(record.host)
                record.host = None
            if side is not None:
                group.ready = torch.cuda.Event()
                group.ready.record(side)

    def _count_returned(self, record: Moved) -> None:
        if not record.returned:  # (a storage several saved tensors view comes back for each; counted once)
            record.returned = True
            self.returned += record.nbytes
            self.on_host -= record.nbytes

    def hooks(self, block: nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
        """For one forward of `block`, entered as it starts. Whole storages move, once per block forward
        however many saved tensors view them; a saved tensor comes back as the same view (offset, shape,
        strides) of its storage's copy, so backward runs the same kernels on the same layouts. The
        first tensor backward takes back fetches the block's storages, and the previous block's ahead."""
        # the weights as the block runs with them: under FSDP2 the gathered ones its pre-forward hook
        # (which runs before this one) has just swapped in, new storages at every gather
        constant = {_key(_local(t).untyped_storage()) for t in [*block.parameters(), *self.model.buffers()]}
        # storage → its record: an address freed (its tensor moved) and reused within the block is a
        # new storage, which the weak reference tells apart
        moved: dict[int, Moved] = {}
        group = self.alive[self.groups] = Group(self.groups)
        self.groups += 1

        def pack(tensor: torch.Tensor):
            if isinstance(tensor, DTensor):  # (tensor parallel: its local shard moves, and comes back wrapped)
                return "dtensor", pack(tensor._local_tensor), tensor.device_mesh, tensor.placements, \
                    tensor.shape, tensor.stride()
            if isinstance(tensor, AsyncCollectiveTensor):  # a collective's pending result (tp): stays
                return tensor
            storage = tensor.untyped_storage()
            if _key(storage) in constant or storage.nbytes() == 0:
                return tensor
            key = _key(storage)
            if key not in moved or moved[key].storage.expired():
                moved[key] = Moved(self._copy_to_host(storage), storage.nbytes(), StorageWeakRef(storage))
                group.moved.append(moved[key])
                self.moved += storage.nbytes()
                self.on_host += storage.nbytes()
                self.peak_on_host = max(self.peak_on_host, self.on_host)
            view = (tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
            return tensor.device, moved[key], view

        def unpack(saved):
            if isinstance(saved, torch.Tensor):
                return saved
            if saved[0] == "dtensor":
                _, local, mesh, placements, shape, stride = saved
                return DTensor.from_local(unpack(local), mesh, placements, run_check=False, shape=shape, stride=stride)
            device, record, (dtype, offset, shape, stride) = saved
            if self.host_device is not None:  # (simulate: values are not computed)
                self._count_returned(record)
                # (a fake storage made whole and viewed with set_ outlives its tensor: as_strided does not)
                whole = torch.empty(record.nbytes // dtype.itemsize, dtype=dtype, device=device)
                return whole.as_strided(shape, stride, offset)
            if not group.fetched:
                self._fetch(group, device, ahead=False)
            before = self.alive.get(group.index - 1)  # the block whose backward runs next: fetched now
            if before is not None and not before.fetched:
                self._fetch(before, device, ahead=True)
            if group.ready is not None:
                torch.cuda.current_stream(device).wait_event(group.ready)
            self._count_returned(record)
            return torch.empty(0, dtype=dtype, device=device).set_(record.device, offset, shape, stride)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (whose storage is real), or the tensor."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _key(storage: torch.UntypedStorage) -> int:
    """A storage's identity, shared by every tensor viewing it: its implementation's address (a
    fake tensor's storage, in `ultratron simulate`, has no data address to tell it apart)."""
    return storage._cdata


def apply_offload(model: nn.Module, enabled: bool, plan: ParallelPlan) -> tuple[nn.Module, HostActivations | None]:
    """Each block's forward inside the hooks, entered and left by the block's forward hooks (the
    model's modules and names stay as they are)."""
    if not enabled:
        return model, None
    host = HostActivations(model)
    entered: list = []

    def enter(module, args):
        entered.append(host.hooks(module))
        entered[-1].__enter__()

    def leave(module, args, output):
        entered.pop().__exit__(None, None, None)

    for block in plan.blocks(model).children():
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave, always_call=True)
    return model, host
