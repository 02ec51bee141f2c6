"""Fault-tolerant data parallelism across replica groups, on torchft: when a group dies the others go
on at the next step, and the group that restarts heals from a live peer and rejoins.

`ultratron launch --replicas R` (launch/replicas.py) starts torchft's lighthouse, which keeps the
quorum, and R replica groups, each its own torchrun over the inner layout (DDP, FSDP, tp, pp inside
a group). Every rank of a group runs a torchft `Manager`; ranks with the same place in their group
form a reconfigurable process group across the groups of the current quorum. In a step:

  begin_step     the quorum: which groups take part; a group behind (restarted) first loads the
                 model, optimizer and run state of a live peer (torchft's healing). The loader then
                 reads this rank's block of the global order among the participants' ranks
                 (`loader.view`), so a smaller quorum reads a smaller global batch from the same
                 position: the position advances only by what the participants consume.
  after_backward the gradients (already averaged inside the group) averaged over the participating
                 groups, torchft's fault-tolerant all-reduce: a peer that dies mid-step makes it fail
                 without raising.
  average_loss   the loss averaged over the participating groups, likewise.
  optimizer      steps only when torchft's `should_commit` says every rank of the group got through;
                 else nothing changes, the loader goes back to where the step began, and the trainer
                 runs the step again (`committed`), so no sequence is lost or read twice and the
                 optimizer steps (and the learning-rate schedule, which counts them) are the
                 configured ones.

The global batch shrinks while a group is missing (logged, and `replicas` in the metrics); the
global batch of a full quorum is R × training.batch_tokens.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ultratron.parallel.axis import Axis
from ultratron.parallel.dims import ParallelDims


def _group_store(dims: ParallelDims) -> tuple[str, int, object]:
    """A fresh TCPStore for this attempt of the group, hosted by its rank 0: torchrun's own store
    outlives a restart, and a Manager reading the dead attempt's keys would dial a dead server."""
    host = dims.store_host or socket.gethostname()
    server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if dims.rank == 0 else None
    box = [server.port if server is not None else None]
    if dims.distributed:
        dist.broadcast_object_list(box, src=0)
    return host, int(box[0]), server


def apply_replicas(dims: ParallelDims) -> ReplicaAxis | None:
    """The replica axis when this process was started as part of a replica group (else None)."""
    if dims.replica_groups <= 1:
        return None
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(seconds=dims.timeout)
    pg = ProcessGroupNCCL(timeout=timeout) if torch.cuda.is_available() else ProcessGroupGloo(timeout=timeout)
    host, port, server = _group_store(dims)
    manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1, use_async_quorum=False,
                      timeout=timeout, quorum_timeout=timeout, rank=dims.rank, world_size=dims.world_size,
                      store_addr=host, store_port=port, replica_id=f"replica_{dims.replica_group}", init_sync=False)
    return ReplicaAxis(manager, dims, server)


class ReplicaAxis(Axis):
    name = "replicas"

    def __init__(self, manager, dims: ParallelDims, store_server=None):
        self.manager, self.dims, self._store_server = manager, dims, store_server
        self.loader = self.before = None
        self.participants, self.index = dims.replica_groups, dims.replica_group
        self._committed, self._states, self._armed, self._first = True, {}, False, True
        self._healed: tuple[int, int] | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    def track_state(self, states: dict) -> None:
        """What a rejoining group receives from a live peer: the model and optimizer, the run state
        (step, tokens, the data position, the RNGs)."""
        self._states = states
        self.manager.register_state_dict_fn(
            "ultratron", lambda state: [self._states[k].load_state_dict(v) for k, v in state.items()],
            lambda: {k: s.state_dict() for k, s in self._states.items()})

    def begin_step(self, loader) -> None:
        train = self._states.get("train")
        was = train.step if train is not None else None
        self.manager.start_quorum()  # synchronous: a group behind has healed when this returns
        self._healed = (was, train.step) if train is not None and train.step != was else None
        if self._first and self.dims.restart_count == 0:
            self._wait_for_everyone()
        self._first = False
        self.loader, self.before, self._committed = loader, loader.state_dict(), True
        self.participants = max(1, self.manager.num_participants())
        self.index = self.manager.participating_rank() or 0
        loader.view(self.index * self.dims.dp + self.dims.dp_rank, self.participants * self.dims.dp)

    def _wait_for_everyone(self) -> None:
        """A job's first step waits (up to the collective timeout) for every group to start: a group
        that starts later would otherwise train its first steps alone and then heal, wasting them."""
        deadline = time.monotonic() + self.dims.timeout
        while self.manager.num_participants() < self.dims.replica_groups and time.monotonic() < deadline:
            time.sleep(0.5)
            self.manager.start_quorum()

    def after_backward(self) -> None:
        self._armed = True
        grads = [_local(p.grad) for p in self._parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        self.manager.allreduce(flat).wait()  # the mean over the participating groups
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(synced)

    def average_loss(self, value: torch.Tensor, training: bool) -> torch.Tensor:
        if not training:
            return value  # validation: every group scores the same batches
        self.manager.allreduce(value).wait()
        return value

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The same optimizer (checkpoints and the LR schedule see it unchanged), whose step happens
        only when torchft commits the step on every rank of this group."""
        step = optimizer.step

        def step_if_committed(*args, **kwargs):
            # only the trainer's step after this step's backward asks torchft; torch's own calls in
            # between (get_state_dict's zero step at lr 0 creating a fresh state) just step
            if not self._armed:
                return step(*args, **kwargs)
            self._armed = False
            if self.manager.should_commit():
                return step(*args, **kwargs)
            self._committed = False
            self.loader.load_state_dict(self.before)  # the step's data is read again when it runs again
            return None

        optimizer.step = step_if_committed
        self._optimizer = optimizer
        return optimizer

    def _parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: the parameters whose gradients the groups must agree on."""
        groups = self._optimizer.param_groups if self._optimizer is not None else []
        return [p for group in groups for p in group["params"]]

    def committed(self) -> bool:
        return self._committed

    def step_metrics(self) -> dict:
        full = self.participants == self.dims.replica_groups
        notes = [f"replicas: {self.participants} of {self.dims.replica_groups} replica groups in this step; its "
                 f"global batch is {self.participants}/{self.dims.replica_groups} of the full one"] if not full else []
        if self._healed is not None:
            notes.insert(0, f"replicas: healed from a live replica group: step {self._healed[0]} → "
                            f"{self._healed[1]} (model, optimizer, data position)")
        note = {"log": "\n".join(notes)} if notes else {}
        return {"replicas": self.participants, "sequences": self.loader.consumed if self.loader else 0,
                "time": time.time()} | note

    def close(self) -> None:
        """torchft's threads (quorum, heartbeats, the checkpoint server) must stop before exit: a
        pending quorum would otherwise hold the interpreter's shutdown for its whole timeout."""
        self.manager.shutdown(wait=False)

    def describe(self) -> list[str]:
        return [f"replicas: replica group {self.dims.replica_group} of {self.dims.replica_groups} (torchft): "
                "a failed group is left out of the quorum and heals from a peer when it rejoins"]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (FSDP2's gradients are DTensors; every group holds the same shards)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad
