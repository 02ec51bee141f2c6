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
recompute compose (the same training), each keeping what the other leaves. On CUDA a storage that
several saved tensors view is copied back for each (a cache of the device copy is left to do).

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

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from ultratron.models.plan import ParallelPlan


class HostActivations:
    """The hooks and their accounting: `moved` bytes copied to the host since the last `reset`,
    `on_host` bytes there now (the most at once: `peak_on_host`), `returned` bytes copied back."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.stream = None
        self.reset()

    def reset(self) -> None:
        self.moved = self.returned = self.on_host = self.peak_on_host = 0

    # where the host copies go: None, the real host (pinned on CUDA; on a CPU a clone in the same
    # memory); "meta" for `ultratron simulate`, whose fake device then frees what moved and allocates
    # it again when backward takes it back, as a GPU's memory would
    host_device: str | None = None

    def _copy_to_host(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        if self.host_device is not None:
            return torch.empty(storage.nbytes(), dtype=torch.uint8, device=self.host_device).untyped_storage()
        if storage.device.type != "cuda":
            return storage.clone()
        if self.stream is None:
            self.stream = torch.cuda.Stream(storage.device)
        self.stream.wait_stream(torch.cuda.current_stream(storage.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
            host.copy_(storage, non_blocking=True)
        # the device memory is not reused before the copy is done
        torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).record_stream(self.stream)
        return host

    def _count_returned(self, record: list, host: torch.UntypedStorage) -> None:
        if not record[1]:  # (a storage several saved tensors view comes back for each; counted once)
            record[1] = True
            self.returned += host.nbytes()
            self.on_host -= host.nbytes()

    def hooks(self, block: nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
        """For one forward of `block`, entered as it starts. Whole storages move, once per block forward
        however many saved tensors view them; a saved tensor comes back as the same view (offset, shape,
        strides) of its storage's copy, so backward runs the same kernels on the same layouts."""
        # the weights as the block runs with them: under FSDP2 the gathered ones its pre-forward hook
        # (which runs before this one) has just swapped in, new storages at every gather
        constant = {_key(_local(t).untyped_storage()) for t in [*block.parameters(), *self.model.buffers()]}
        # storage → [host copy, returned, a weak reference to the storage]: an address freed (its tensor
        # moved) and reused within the block is a new storage, which the weak reference tells apart
        moved: dict[int, list] = {}

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
            if key not in moved or moved[key][2].expired():
                moved[key] = [self._copy_to_host(storage), False, StorageWeakRef(storage)]
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
            host = record[0]
            if self.host_device is not None:  # (simulate: values are not computed)
                self._count_returned(record, host)
                # (a fake storage made whole and viewed with set_ outlives its tensor: as_strided does not)
                whole = torch.empty(host.nbytes() // dtype.itemsize, dtype=dtype, device=device)
                return whole.as_strided(shape, stride, offset)
            if device.type == "cuda":
                if self.stream is not None:
                    torch.cuda.current_stream(device).wait_stream(self.stream)
                storage = torch.UntypedStorage(host.nbytes(), device=device)
                storage.copy_(host, non_blocking=True)
            else:
                storage = host
            self._count_returned(record, host)
            return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)

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
