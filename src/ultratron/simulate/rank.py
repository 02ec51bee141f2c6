"""One rank of an N-rank layout, simulated in this process: the real model build, `parallelize`
and training step on a fake process group (torch's "fake" backend: every collective returns at
once) and fake tensors (shapes and dtypes, no storage), measured while it runs.

The order that works (docs/simulate.md): the model is built on the meta device and parallelized
outside fake mode (the device mesh, `fully_shard` and `parallelize_module` need real process
groups, which the fake backend gives); inside `FakeTensorMode` the parameters and buffers become
CPU fakes (`to_empty`; fake "cuda" tensors abort in backward on a CPU build) and the steps run.
Two steps run: the first creates the optimizer state, the second is the one measured (the
steady state the planner prices: parameters, gradients and optimizer state all alive). Each step is
the trainer's: `TrainStep.forward_backward` (every micro-batch, through the pipeline schedule if
any), the axes' gradient clipping, the optimizer step, the axes' zero_grad.

Measured in the second step: the peak bytes by torch's `MemTracker` (parameters, buffers,
gradients, activations, temporaries, optimizer state), FLOPs by `FlopCounterMode`, and every
collective this rank issues (op, group, shape, dtype; peer for point to point), seen at the
dispatcher (`c10d` and functional collectives), so FSDP's, DTensor's, DDP's and the pipeline's
all count.

What the fake backend cannot do, and what stands in for it:
  * the pipeline schedule's first exchange (a vote by send/receive of a number, then the shapes
    of each stage's inputs and their gradients as pickled objects) needs values from another
    process. The vote is skipped (every stage takes torch's "dynamic" mode, which is what the vote
    decides for our stages, which declare no shapes). A stage's forward metadata is written to
    `meta_dir` by the rank that sends it and read by the rank that receives it (the parent runs
    ranks in pipeline order, so the sender runs first; every stage boundary carries the residual
    stream, so a stage whose own sender was not simulated takes another boundary's); the gradient
    metadata a stage receives is derived from its own outputs (their gradients have their shapes).
  * a value read on the host (`.item()`, `float(loss)`) has no value: the simulation does not
    read the loss or the gradient norm.

Run as `python -m ultratron.simulate.rank REQUEST.json RESULT.json` by `simulate/run.py`.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ultratron.config import load_config

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


def _plant(plant: dict | None, measured) -> None:
    """For the check's own tests: make this rank issue a wrong collective, as a bug would —
    `{"function": "all_reduce", "call": 1, "action": "skip" | "shape"}` skips the n-th call of
    `torch.distributed.FUNCTION` in the measured step on this rank, or sends one element fewer
    (`measured()`: whether the measured step runs)."""
    if not plant:
        return
    original = getattr(dist, plant["function"])
    count = {"n": 0}

    def planted(*args, **kwargs):
        count["n"] += measured()
        if measured() and count["n"] == plant["call"]:
            if plant["action"] == "skip":
                return _Done() if kwargs.get("async_op") else None
            args = (args[0].reshape(-1)[:-1], *args[1:])
        return original(*args, **kwargs)

    setattr(dist, plant["function"], planted)


def _pipeline_metadata(meta_dir: Path) -> None:
    """Stand-ins for the exchanges the fake backend cannot carry (see the module doc)."""
    from torch.distributed.pipelining import schedules, stage
    from torch.distributed.pipelining._utils import _derive_grad_metas, _StageBackwardMeta, _StageForwardMeta

    def warmup(self, stages, has_backward, p2p_done):
        for s in stages:
            s._inference_mode = stage.InferenceMode.DYNAMIC

    def send_meta(self, meta, dst_stage):
        if isinstance(meta, _StageForwardMeta):
            data = pickle.dumps(meta)
            for name in (f"forward-{self.stage_index}-{dst_stage}", "forward-any"):
                tmp = meta_dir / f".{name}.{os.getpid()}"
                tmp.write_bytes(data)
                os.replace(tmp, meta_dir / name)

    def recv_meta(self, src_stage):
        if src_stage > self.stage_index:  # gradients of this stage's outputs: their shapes
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))
        for name in (f"forward-{src_stage}-{self.stage_index}", "forward-any"):
            if (meta_dir / name).exists():
                return pickle.loads((meta_dir / name).read_bytes())
        raise RuntimeError(f"stage {self.stage_index} needs the activation shapes of stage {src_stage}: "
                           "simulate a rank of the first pipeline stage first")

    schedules._PipelineSchedule._warmup_p2p = warmup
    stage.PipelineStage._send_meta = send_meta
    stage.PipelineStage._recv_meta = recv_meta


def _attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs of CPU flash attention (torch's counter has no formula for the CPU kernel):
    two matmuls, q·kᵀ and p·v, over every query and key (as the planner counts: causal masking
    is not subtracted)."""
    b, h, sq, d = query
    return 4 * b * h * sq * key[-2] * d


def _attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return 2 * _attention_flops(query, key, value)


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
                             shape_wrapper(_attention_backward_flops)}
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


def _materialize(parallel) -> None:
    """Parameters and buffers → CPU fakes; the pipeline's stage modules hold buffers of their own."""
    shared: dict[int, list] = {}  # a tied parameter (one object under two names) stays one: to_empty
    for module in parallel.model.modules():  # from meta makes a new tensor per name
        for name, param in module._parameters.items():
            if param is not None:
                shared.setdefault(id(param), []).append((module, name))
    parallel.model.to_empty(device="cpu")
    for refs in shared.values():
        for module, name in refs[1:]:
            module._parameters[name] = refs[0][0]._parameters[refs[0][1]]
    modules = [module for axis in parallel.axes for module in getattr(getattr(axis, "pipeline", None), "modules", [])]
    for module in modules:
        for sub in module.modules():
            for name, buf in list(sub._buffers.items()):
                if buf is not None and buf.is_meta:
                    sub._buffers[name] = torch.empty_like(buf, device="cpu")


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


def _tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker._mod_tracker = _Backward()
    return tracker


def _memory(tracker) -> dict:
    snapshot = tracker.get_tracker_snapshot("peak")
    per_device = next(iter(snapshot.values())) if snapshot else {}
    names = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Activation": "activations",
             "Temp": "temporaries", "Optstate": "optimizer_states", "Other": "other", "Total": "total"}
    return {names.get(str(k).split(".")[-1], str(k)): int(v) for k, v in
            ((getattr(k, "value", k), v) for k, v in per_device.items())}


def simulate_rank(overrides: list[str], config: str | None, rank: int, meta_dir: str, plant: dict | None = None,
                  steps: int = 2) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ultratron.models.registry import build_model
    from ultratron.parallel.axis import MicroBatch
    from ultratron.parallel.memory import measured_bytes
    from ultratron.parallel.parallelize import parallelize, topology
    from ultratron.training.optim import build_optimizer
    from ultratron.training.step import TrainStep

    started = time.perf_counter()
    cfg = load_config(config, overrides)
    layout, t = cfg.layout, cfg.training
    world = layout.n_gpus
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK="0")
    for name in ("MASTER_ADDR", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(name, None)
    _pipeline_metadata(Path(meta_dir))
    dims = topology(layout, cfg.parallel.collective_timeout)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Set timeout is now only supported")
        dims.build_mesh("cpu")
    parallel = parallelize(build_model(cfg.model, "meta"), dims, cfg)
    built = time.perf_counter()
    recorder = CollectiveRecorder()
    _plant(plant, lambda: recorder.recording)
    flops = LocalFlops()
    device = torch.device("cpu")
    n_micro = cfg.grad_accum_steps

    def next_batch():
        x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len))
        return x, x

    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = _tracker()
        with tracker:
            _materialize(parallel)
            tracker.track_external(parallel.model)
            optimizer = parallel.axes.wrap_optimizer(build_optimizer(parallel.model, cfg.optim))
            tracker.track_external(optimizer)
            step = TrainStep(parallel, device, t.precision, t.z_loss, compile_loss=False)
            max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
            for index in range(steps):
                measured = index == steps - 1
                recorder.recording = measured
                with flops if measured else _Null(), recorder:
                    step.runner.train(True)
                    batches = [parallel.axes.shard(MicroBatch(*next_batch()).to(device)) for _ in range(n_micro)]
                    with parallel.axes.step_context(training=True):
                        local = step.runner.forward_backward(batches)
                    parallel.axes.after_backward()
                    parallel.axes.average_loss(local, training=True)
                    parallel.axes.clip_grad_norm(max_norm)
                    optimizer.step()
                    static = measured_bytes(parallel.model, optimizer)  # with the gradients, before zero_grad
                    parallel.axes.zero_grad(optimizer)
    memory = _memory(tracker)
    dist.destroy_process_group()
    from ultratron.simulate.collectives import bytes_by_op

    peak = memory.get("total", 0)
    split = {**static, "activations_and_temporaries": peak - sum(static.values())}
    return {"rank": rank, "peak_bytes": peak, "memory": split, "tracker": memory,
            "flops": flops.total, "collectives": recorder.calls,
            "bytes_by_op": bytes_by_op(recorder.calls), "build_s": built - started,
            "wall_s": time.perf_counter() - started,
            "host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class _Done:
    """The work handle of a collective a planted bug skipped."""

    def wait(self, *args, **kwargs) -> bool:
        return True


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text())
    result = simulate_rank(request["overrides"], request.get("config"), request["rank"], request["meta_dir"],
                           request.get("plant"), request.get("steps", 2))
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
