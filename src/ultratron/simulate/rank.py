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
  * DDP's C++ reducer keeps the (meta) parameters it was built with and reads its buckets' data:
    a Python stand-in that buckets, averages and all-reduces as it does takes its place
    (`simulate/ddp.py`). ZeroRedundancyOptimizer runs as it is.
  * a value read on the host (`.item()`, `float(loss)`) has no value: the simulation does not
    read the loss or the gradient norm.
  * a mixture of experts' routing is data: how many token slots each expert gets sets the shapes of
    its matmuls and of expert parallelism's all-to-all. The one place they reach the host,
    `models.moe.counts_on_host`, answers balanced routing instead (`_balanced_routing`): each
    expert receives an even share of the T·k slots a rank routes, split evenly over the ep ranks,
    so every rank's step has the memory and collectives of a balanced step.

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

from ultratron.config import load_config
from ultratron.simulate.measure import (
    CollectiveRecorder,
    LocalFlops,
    memory_split,
    memory_tracker,
    optimizer_step_bytes,
    total,
)


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


def _stand_in_for_ddp() -> None:
    """DDP's C++ reducer cannot run on fake tensors: `parallel/data.py` builds the stand-in
    (`simulate/ddp.py`) in its place."""
    from ultratron.parallel import data
    from ultratron.simulate.ddp import StandInDDP

    data.DistributedDataParallel = StandInDDP


def _balanced_routing() -> None:
    """Every expert gets routed // E of a rank's routed slots (the first routed % E one more), and
    so does every counts vector the ep ranks exchange: each rank routes, sends and receives as many."""
    from ultratron.models import moe

    def balanced(counts: torch.Tensor, routed: int) -> list[int]:
        experts = counts.shape[0]
        return [routed // experts + (e < routed % experts) for e in range(experts)]

    moe.counts_on_host = balanced


def simulate_rank(overrides: list[str], config: str | None, rank: int, meta_dir: str, plant: dict | None = None,
                  steps: int = 2) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ultratron.models.registry import build_model
    from ultratron.parallel.axis import MicroBatch
    from ultratron.parallel.materialize import initialize, materialize
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
    _balanced_routing()
    dims = topology(layout, cfg.parallel.collective_timeout)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Set timeout is now only supported")
        dims.build_mesh("cpu")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    _stand_in_for_ddp()
    start_tracker = memory_tracker()

    def start_under_fake(model, stages) -> None:
        """The trainer's start (materialize the rank's shards, initialize them) on fake tensors, measured."""
        with fake, start_tracker:
            materialize(model, "cpu", also=stages)
            initialize(model, cfg.training.seed)

    parallel = parallelize(build_model(cfg.model, "meta"), dims, cfg, "cpu", starter=start_under_fake)
    start_peak = total(start_tracker.get_tracker_snapshot("peak"))
    host = parallel.host  # activation offload: its host copies on "meta", outside the device's bytes
    if host is not None:
        host.host_device = "meta"
    built = time.perf_counter()
    recorder = CollectiveRecorder()
    _plant(plant, lambda: recorder.recording)
    flops = LocalFlops()
    device = torch.device("cpu")
    n_micro = cfg.grad_accum_steps

    def next_batch():
        x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len))
        return x, x

    with fake:
        optimizer = parallel.axes.wrap_optimizer(build_optimizer(parallel.model, cfg.optim))
        step = TrainStep(parallel, device, t.precision, t.z_loss, compile_loss=False, loss_chunk=t.loss_chunk)
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")

        def one_step(tracker=None) -> tuple[dict, int, int]:
            measured = tracker is not None
            recorder.recording = measured
            with flops if measured else _Null(), recorder:
                step.runner.train(True)
                with tracker if measured else _Null():
                    batches = [parallel.axes.shard(MicroBatch(*next_batch()).to(device)) for _ in range(n_micro)]
                    with parallel.axes.step_context(training=True):
                        local = step.runner.forward_backward(batches)
                    parallel.axes.after_backward()
                    parallel.axes.average_loss(local, training=True)
                    parallel.axes.clip_grad_norm(max_norm)
                static = measured_bytes(parallel.model, optimizer)  # with the gradients, before zero_grad
                alive = total(tracker.get_tracker_snapshot("current")) if measured else 0
                extra = optimizer_step_bytes(optimizer) if measured else 0
                optimizer.step()
                parallel.axes.zero_grad(optimizer)
            return static, alive, extra

        for _ in range(steps - 1):
            one_step()  # creates the optimizer state
        tracker = memory_tracker()
        # ZeroRedundancyOptimizer keeps its share's state in its inner optimizer, not in its own `state`
        inner = [optimizer.optim] if hasattr(optimizer, "optim") else []
        tracker.track_external(parallel.model, optimizer, *inner)
        if host is not None:
            host.reset()
        static, alive_at_update, update_extra = one_step(tracker)
    memory = memory_split(tracker)
    dist.destroy_process_group()
    from ultratron.simulate.collectives import bytes_by_op

    forward_backward = memory.get("total", 0)
    update = alive_at_update + update_extra
    peak = max(forward_backward, update)
    split = {**static, "activations_and_temporaries": peak - sum(static.values())}
    return {"rank": rank, "peak_bytes": peak, "start_peak_bytes": start_peak, "memory": split, "tracker": memory,
            "forward_backward_peak_bytes": forward_backward, "update_peak_bytes": update,
            "flops": flops.total, "collectives": recorder.calls,
            "bytes_by_op": bytes_by_op(recorder.calls), "build_s": built - started,
            "wall_s": time.perf_counter() - started,
            "host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            # offload: the most on the host at once in the measured step, and the bytes it moved there
            "offloaded_bytes": host.peak_on_host if host else 0, "moved_bytes": host.moved if host else 0}


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
