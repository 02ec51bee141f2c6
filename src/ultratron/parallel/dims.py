"""The whole parallel topology in one object, and the one DeviceMesh built from it.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp (torchtitan's order: the
axes that talk the most, tp, sit innermost, i.e. on neighbouring ranks / the same node).
`dp` is the total data-parallel degree; with HSDP it splits into `dp_replicate` groups that each
shard over `dp_shard = dp / dp_replicate` ranks. Context parallel ranks hold different tokens of
the same sequences, so gradients are averaged over dp × cp: data parallelism runs on the flattened
`dp_shard_cp` mesh. Expert parallelism borrows data-parallel ranks (the world stays dp·tp·pp·cp):
dp_shard is cut into `edp` × `ep` (ep innermost), the experts are split over `ep`, and their
gradients averaged over the ranks that hold the same experts (`edp`, `cp`). Flattened meshes are
kept here (`self.flat`), as PyTorch asks, rather than sliced from the root again. The layout's
rules are checked with the config (`config.training.validate`, `planning.rules`) before any
process group exists; here only the launch itself is checked: the number of processes must equal
the layout's product.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from ultratron.errors import ConfigError, UserError
from ultratron.parallel import faults
from ultratron.planning.rules import data_parallel_wrapper

T = TypeVar("T")


@dataclass
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    zero: int = 0
    sp: bool = False
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    restart_count: int = 0  # torchrun's restarts of the whole group so far (TORCHELASTIC_RESTART_COUNT)
    agent_store: tuple[str, int] | None = None  # torchrun's own TCPStore (MASTER_ADDR, MASTER_PORT), if used
    timeout: float = 300.0  # seconds a collective waits (parallel.collective_timeout)
    replica_group: int = 0  # this process's replica group, under `launch --replicas` (parallel/replicas.py)
    replica_groups: int = 1  # how many replica groups the job has (1: no fault-tolerant replicas)
    store_host: str | None = None  # MASTER_ADDR: where this group's rank 0 is reached
    started: float = 0.0  # when this process joined the group (time.time())
    mesh: object = field(default=None, repr=False, compare=False)  # a DeviceMesh once built
    flat: dict = field(default_factory=dict, repr=False, compare=False)  # flattened meshes by name
    owns_process_group: bool = field(default=False, repr=False, compare=False)  # init_distributed created it
    signals: faults.SignalWatch | None = field(default=None, repr=False, compare=False)  # dumps on SIGTERM

    @classmethod
    def from_config(cls, layout, timeout: float = 300.0) -> ParallelDims:
        """The degrees of a `planning.layout.Layout` (the run's: `Config.layout`; its config section
        `cfg.parallel` has the same fields), and the launch environment (torchrun's RANK /
        WORLD_SIZE / LOCAL_RANK, its restart count and store), checked. The one place the launch
        environment is read. `timeout`: seconds a collective waits (`parallel.collective_timeout`)."""
        env = os.environ
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in env
        dims = cls(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                   dp_replicate=layout.dp_replicate, zero=layout.zero, sp=layout.sp, timeout=timeout,
                   world_size=int(env.get("WORLD_SIZE", "1")),
                   rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   replica_group=int(env.get("ULTRATRON_REPLICA_GROUP", "0")),
                   replica_groups=int(env.get("ULTRATRON_REPLICA_GROUPS", "1")), store_host=env.get("MASTER_ADDR"),
                   agent_store=(env["MASTER_ADDR"], int(env.get("MASTER_PORT", "29500"))) if agent else None)
        if dims.product != dims.world_size:
            raise ConfigError(
                f"parallel layout dp×tp×pp×cp = {dims.dp}×{dims.tp}×{dims.pp}×{dims.cp} = {dims.product} "
                f"does not equal the number of processes ({dims.world_size}); launch with "
                f"torchrun --nproc-per-node {dims.product} or change the layout")
        return dims

    # ---- derived sizes ------------------------------------------------------------------------
    @property
    def product(self) -> int:
        # Expert parallelism reuses data-parallel ranks, so it does not multiply the world size.
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def data_parallel(self) -> int:
        """The ranks a gradient is averaged over: dp × cp (cp ranks see other tokens of the sequences)."""
        return self.dp * self.cp

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 for ZeRO 2/3 and HSDP; also when dp meets tp, since DDP takes no DTensor parameters,
        and for ZeRO-1 under pp or ep (see parallel/data.py; zero 0 under pp is FSDP2's
        replicate; ZeroRedundancyOptimizer would broadcast each rank's own experts to the others).
        Over dp × cp ranks (`data_parallel`)."""
        return data_parallel_wrapper(self.data_parallel, self.zero, self.tp, self.pp, self.dp_replicate,
                                     self.ep) == "fsdp"

    # ---- ranks ----------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (tp is innermost, so rank // tp; pp is
        outermost, so the same dp rank recurs in every pipeline stage)."""
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def cp_rank(self) -> int:
        """This rank's index among the context-parallel ranks (between dp and tp in the mesh)."""
        return (self.rank // self.tp) % self.cp

    @property
    def ep_rank(self) -> int:
        """Which share of the experts this rank holds (ep is the innermost part of dp)."""
        return self.dp_rank % self.ep

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline rank (the outermost mesh dimension)."""
        return self.rank // (self.dp * self.cp * self.tp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            if dist.is_initialized():
                dist.barrier()

    def main_first(self, work: Callable[[], T]) -> T:
        """Rank 0 does `work` (e.g. training the tokenizer and writing shards) while the others wait;
        then the others do it too, which finds what rank 0 left and only reads it."""
        if self.is_main:
            result = work()
            self.barrier()
            return result
        self.barrier()
        return work()

    # ---- process group and mesh -----------------------------------------------------------------
    def init_distributed(self, device: torch.device, run_dir=None) -> torch.device:
        """Join the process group (gloo on CPU, nccl with one GPU per local rank) and build the mesh.
        Returns the device this rank computes on. A no-op in one process. `run_dir`: where the NCCL
        watchdog dumps the flight record on a timeout (RUN_DIR/flight, `faults.process_group_env`)."""
        if not self.distributed:
            return device
        if device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        self.started = time.time()  # failure reports older than this are an earlier attempt's
        if not dist.is_initialized():
            faults.enable_flight_recorder(device.type, run_dir)
            dist.init_process_group(**process_group_args(device), store=self._store(), rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=self.timeout))
            self.owns_process_group = True
        self.build_mesh(device.type)
        return device

    def watch(self, run_dir) -> None:
        """From now on SIGTERM writes this rank's flight record to RUN_DIR/flight (parallel/faults.py)."""
        if self.distributed and self.signals is None:
            self.signals = faults.SignalWatch(run_dir, self.rank, self.world_size).start()

    def leave(self) -> None:
        """After a run that succeeded on every rank: leave the process group if this object created
        it (a group the caller made, e.g. `launch.local`'s, stays). See `leave_process_group`."""
        self._unwatch()
        if self.owns_process_group and dist.is_initialized():
            leave_process_group()
            self.owns_process_group = False

    def fail(self, err: BaseException, run_dir) -> None:
        """After training failed on this rank: its own error is reported to the other ranks, its flight
        record written, its process groups aborted (if it made them). A collective that broke
        because of another rank becomes one error line naming that rank (raised from here)."""
        if not (self.distributed and dist.is_initialized()):
            return
        broken = faults.is_collective_error(err)
        if not broken:
            faults.report_failure(self.rank, err)  # first: the others look for it as soon as theirs break
        if broken or not isinstance(err, UserError):  # a user error every rank decided alike is no hang
            faults.dump(run_dir, self.rank, self.world_size, reason=f"{type(err).__name__}: {err}"[:500],
                        own_error=not broken)
        error = faults.failure_error(err, self.rank, self.world_size, self.timeout, run_dir,
                                     since=self.started) if broken else None
        self._unwatch()
        if self.owns_process_group:
            faults.leave_after_failure()
            self.owns_process_group = False
        if error is not None:
            raise error from None

    def _unwatch(self) -> None:
        if self.signals is not None:
            self.signals.close()
            self.signals = None

    def _store(self):
        """Under torchrun, a client of the agent's store with keys of this attempt only. torchrun
        keeps one store across `--max-restarts` restarts, so without the prefix a restarted group
        reads the addresses the dead group published and fails to connect (gloo 'connectFullMesh
        failed ... Connection refused'). None: the default env:// rendezvous."""
        if self.agent_store is None:
            return None
        host, port = self.agent_store
        store = dist.TCPStore(host, port, world_size=self.world_size, is_master=False, timeout=timedelta(minutes=10))
        return dist.PrefixStore(f"ultratron/attempt-{self.restart_count}", store)

    def build_mesh(self, device_type: str = "cpu"):
        from torch.distributed.device_mesh import init_device_mesh

        shard = (("edp", self.dp_shard // self.ep), ("ep", self.ep)) if self.ep > 1 else (("dp_shard", self.dp_shard),)
        dims = (("pp", self.pp), ("dp_replicate", self.dp_replicate), *shard, ("cp", self.cp), ("tp", self.tp))
        kept = [(n, s) for n, s in dims if s > 1] or [("dp_shard", 1)]
        self.mesh = init_device_mesh(device_type, tuple(s for _, s in kept), mesh_dim_names=tuple(n for n, _ in kept))
        self._set_timeouts()
        self.flat = {}
        present = lambda *names: tuple(n for n in names if n in self.mesh.mesh_dim_names)  # noqa: E731
        if self.ep > 1 and present("edp", "ep"):
            self.flat["dp_shard"] = self.mesh[present("edp", "ep")]._flatten("dp_shard")
        if self.cp > 1:
            self.flat["dp_shard_cp"] = self.mesh[present("edp", "ep", "dp_shard", "cp")]._flatten("dp_shard_cp")
            self._set_timeouts()
        return self.mesh

    def _set_timeouts(self) -> None:
        """The mesh's groups take torch's default timeout (30 min), not the world's: set ours on each."""
        from torch.distributed.distributed_c10d import _set_pg_timeout, _world

        for group in list(_world.pg_map):
            try:
                _set_pg_timeout(timedelta(seconds=self.timeout), group)
            except (ValueError, RuntimeError):  # a group this rank is not in
                pass

    def submesh(self, *names: str):
        """The mesh over the named dimensions that exist (size > 1), or None if none does. A single
        name may be a flattened mesh's (`dp_shard` under ep, `dp_shard_cp`)."""
        if len(names) == 1 and names[0] in self.flat:
            return self.flat[names[0]]
        present = [n for n in names if self.mesh is not None and n in (self.mesh.mesh_dim_names or ())]
        if not present:
            return None
        return self.mesh[tuple(present)] if len(present) > 1 else self.mesh[present[0]]

    @property
    def dp_mesh(self):
        """The mesh data parallelism reduces gradients over: the replicate dimension (HSDP) outer, then
        the ranks that shard — the data-parallel ones, flattened with the context-parallel ones under
        cp (they see other tokens of the same sequences), or the edp × ep ones under ep."""
        shard = "dp_shard_cp" if self.cp > 1 else ("dp_shard" if self.ep > 1 else None)
        if shard is None:
            return self.submesh("dp_replicate", "dp_shard")
        if self.dp_replicate == 1:
            return self.flat[shard]
        return self.mesh["dp_replicate", shard]

    @property
    def dp_dims(self) -> list[str]:
        """The mesh dimensions of the data-parallel ranks alone (not cp's), each summed over in turn."""
        return [n for n in ("dp_replicate", "dp_shard", "edp", "ep") if n in (self.mesh.mesh_dim_names or ())]

    @property
    def cp_mesh(self):
        return self.submesh("cp")

    @property
    def ep_mesh(self):
        return self.submesh("ep")

    @property
    def expert_replica_dims(self) -> list[str]:
        """The mesh dimensions over which ranks hold the same experts (their gradients are summed)."""
        return [n for n in ("dp_replicate", "edp", "dp_shard", "cp") if n in (self.mesh.mesh_dim_names or ())]

    @property
    def tp_mesh(self):
        return self.submesh("tp")

    @property
    def pp_mesh(self):
        return self.submesh("pp")

    @property
    def pp_group(self):
        """The process group of this rank's pipeline (one rank per stage), or None without pp."""
        return self.pp_mesh.get_group() if self.pp > 1 else None


def process_group_args(device: torch.device) -> dict:
    """`init_process_group`'s backend for the rank's device, and under NCCL the device itself
    (`device_id`): the group binds its communicator to that GPU at once, instead of guessing it from
    the rank at the first collective (and warning that it may hang if the guess is wrong)."""
    if device.type == "cuda":
        return {"backend": "nccl", "device_id": device}
    return {"backend": "gloo"}


def leave_process_group() -> None:
    """Wait for every rank, then destroy all process groups, while Python is still alive.

    A process that exits with its gloo groups alive can abort during interpreter shutdown (SIGABRT,
    "terminate called without an active exception"): a gloo worker thread freeing a finished
    collective's tensor needs the GIL, which the exiting interpreter no longer hands out, and the
    thread's forced unwind ends in std::terminate (seen in a core dump: ~AsyncAllgatherWork →
    decref_pyobject → take_gil → pthread_exit); 3 aborts in 80 two-rank torchrun runs, three at a
    time on 2 cores, before this was called. destroy_process_group waits for pending work and stops
    those threads. Call it only after success: after a failure another rank may never arrive."""
    dist.barrier()  # no rank leaves while another still talks to it (a last save's commit)
    dist.destroy_process_group()
