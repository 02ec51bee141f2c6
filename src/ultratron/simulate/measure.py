"""What `simulate/rank.py` measures while a rank's step runs: its collectives in order
(`CollectiveRecorder`), its FLOPs (`LocalFlops`), its memory (torch's `MemTracker`, without module
hooks: `tracker`), and the optimizer step's temporaries (`optimizer_step_bytes`)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_OPS = {  # dispatcher op name → the collective's name in records
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all", "send": "send", "recv_": "recv", "barrier": "barrier",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
}
# c10d ops whose output tensors come first: the record takes their inputs (what this rank sends)
_OUTPUT_FIRST = {"_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_", "allgather_coalesced_",
                 "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_",
                 "alltoall_base_", "gather_", "scatter_"}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group(arg):
    """The process group a c10d op was given (boxed as a ScriptObject at the dispatcher), else None."""
    if isinstance(arg, dist.ProcessGroup):
        return arg
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg)
        except (RuntimeError, TypeError):
            return None
    return None


class CollectiveRecorder(TorchDispatchMode):
    """Every collective this rank issues, in order, as the dicts `simulate.collectives` checks."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recording and func.namespace in ("c10d", "_c10d_functional") and func._opname in _OPS:
            self._record(func._opname, args)
        return func(*args, **kwargs)

    def _record(self, name: str, args) -> None:
        group = peer = None
        arg_tensors = [_tensors(a) for a in args]
        groups = [g for g in (_group(a) for a in args) if g is not None]
        if groups:
            group = groups[0]
        else:  # functional collectives name their group
            names = [a for a in args if isinstance(a, str)]
            group = dist.distributed_c10d._resolve_process_group(names[-1]) if names else None
        sent = [ts for ts in arg_tensors if ts]
        tensors = sent[1] if name in _OUTPUT_FIRST and len(sent) > 1 else (sent[0] if sent else [])
        op = _OPS[name]
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if op in ("send", "recv"):
            local = next(a for a in args[2:] if isinstance(a, int))
            peer = ranks[local]
        first = tensors[0] if tensors else None
        self.calls.append({"op": op, "group": ranks, "peer": peer,
                           "shape": list(first.shape) if first is not None else [],
                           "dtype": str(first.dtype).removeprefix("torch.") if first is not None else "none",
                           "bytes": sum(t.numel() * t.element_size() for t in tensors)})


def _attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs of CPU flash attention (torch's counter has no formula for the CPU kernel):
    two matmuls, q·kᵀ and p·v, over every query and key (as the planner counts: causal masking
    is not subtracted)."""
    b, h, sq, d = query
    return 4 * b * h * sq * key[-2] * d


def _attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return 2 * _attention_flops(query, key, value)


def _grouped_mm_flops(mat_a, mat_b, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of a grouped matmul (a mixture of experts' experts, `models/moe.py`; torch's counter has
    no formula for it): every row of its groups times its group's matrix. (M, K) × (G, K, N) and the
    batched (G, M, K) × (G, K, N): 2·K per output element; backward's weight gradient (K, M) × (M, N)
    → (G, K, N), the groups cutting M: 2·K·M·N in all. Rows past the last group (dropped slots) count
    too, as the planner counts a step without drops."""
    if len(mat_a) == 2 and len(mat_b) == 2:
        return 2 * mat_a[0] * mat_a[1] * mat_b[1]
    return 2 * math.prod(out_shape) * mat_a[-1]


class LocalFlops(TorchDispatchMode):
    """FLOPs of what this rank computes, by torch's own formulas (`torch.utils.flop_counter`).
    Unlike `FlopCounterMode`, which counts a DTensor op at its global shape, DTensor ops are let
    through to their local ops (as MemTracker does), so a tensor-parallel matmul counts its shard;
    and CPU flash attention, for which torch has no formula, counts as the planner counts it."""

    def __init__(self):
        super().__init__()
        from torch.utils.flop_counter import flop_registry, shape_wrapper

        aten = torch.ops.aten
        self.registry = {**flop_registry,
                         aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_attention_flops),
                         aten._scaled_dot_product_flash_attention_for_cpu_backward:
                             shape_wrapper(_attention_backward_flops),
                         aten._grouped_mm: shape_wrapper(_grouped_mm_flops)}
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


class _Backward:
    """What MemTracker asks of its module tracker, without module hooks: MemTracker's per-module
    hooks refuse a module that runs twice in a step (every micro-batch, every pipeline stage) and
    break the pipeline's `autograd.grad`. Without them it tells activations (made in forward) from
    temporaries (made in backward) by whether the autograd engine is running."""

    parents: set = set()

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_PROPAGATING = [0]  # > 0 while DTensor works out an op's output shape (`_untracked_propagation`)


def _untracked_propagation() -> None:
    """DTensor works out an op's output shape (its sharding propagation's slow path) by running the op
    on fake tensors of the global shape, under the active fake mode. In a real run that is a fake mode
    of its own, whose ops MemTracker skips; under the simulation's fake mode MemTracker would count
    them as this rank's allocations: a transient of the whole tensor, tp × the rank's share, for every
    such op (e.g. loss-parallel's in-place backward over the (tokens × vocab) logits). Those ops are
    not tracked."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached
    if getattr(original, "untracked", False):
        return

    def propagate(self, op_schema):
        _PROPAGATING[0] += 1
        try:
            return original(self, op_schema)
        finally:
            _PROPAGATING[0] -= 1

    propagate.untracked = True
    ShardingPropagator._propagate_tensor_meta_non_cached = propagate


def memory_tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _track(self, reftype, t):
            if not _PROPAGATING[0]:
                super()._track(reftype, t)

    _untracked_propagation()
    tracker = Tracker()
    tracker._mod_tracker = _Backward()
    return tracker


def _device_only(snapshot: dict) -> dict:
    """The snapshot's devices but "meta", where offloaded activations' stand-in host copies live."""
    return {dev: v for dev, v in (snapshot or {}).items() if getattr(dev, "type", str(dev)) != "meta"}


def total(snapshot: dict) -> int:
    return int(sum(dev.get("Total", 0) for dev in _device_only(snapshot).values()))


def optimizer_step_bytes(optimizer) -> int:
    """The bytes the optimizer step allocates on top of what is alive, measured by replaying it —
    the same optimizer class and settings — on this rank's local shards.

    Why a replay: under fake tensors, in-place ops on DTensors look to MemTracker like new
    allocations that stay alive (measured: AdamW over DTensor parameters counts 7× their bytes of
    temporaries under fake tensors, 1× with real tensors, as the planner says), and AdamW is
    element-wise, so its local shards allocate what the DTensors' would. The real step still runs
    (its collectives, e.g. ZeRO-1's broadcasts, are recorded). A non-fused AdamW replays as torch's
    multi-tensor (foreach) path, torch's default on a GPU (on a CPU it defaults to a loop)."""
    from torch.distributed.tensor import DTensor

    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own shard
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    groups, states, tensors = [], {}, []
    for group in inner.param_groups:
        params = []
        for p in group["params"]:
            if p.grad is None:
                continue
            q = local(p).detach().requires_grad_(True)
            grad = local(p.grad).detach()
            # (under fake tensors an untied head's gradient can come out of loss parallel with another
            # placement than its parameter's — in a real run it is Shard(0) as the parameter — and the
            # replay needs only its shape)
            q.grad = grad if grad.shape == q.shape else torch.empty_like(q)
            states[q] = {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in inner.state.get(p, {}).items()}
            tensors += [q, q.grad, *(v for v in states[q].values() if isinstance(v, torch.Tensor))]
            params.append(q)
        if params:
            settings = {k: v for k, v in group.items() if k != "params"}
            if not settings.get("fused"):
                settings["foreach"] = True
            groups.append({**settings, "params": params})
    if not groups:
        return 0
    replay = type(inner)(groups)
    for q, state in states.items():
        replay.state[q] = state
    tracker = memory_tracker()
    tracker.track_external(*tensors)
    with tracker:
        before = total(tracker.get_tracker_snapshot("current"))
        replay.step()
    return max(total(tracker.get_tracker_snapshot("peak")) - before, 0)


def memory_split(tracker) -> dict:
    snapshot = _device_only(tracker.get_tracker_snapshot("peak"))
    per_device = next(iter(snapshot.values()), {})
    names = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Activation": "activations",
             "Temp": "temporaries", "Optstate": "optimizer_states", "Other": "other", "Total": "total"}
    return {names.get(str(k).split(".")[-1], str(k)): int(v) for k, v in
            ((getattr(k, "value", k), v) for k, v in per_device.items())}
