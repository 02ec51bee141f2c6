"""Apply parallelism to a plain model from outside, in one fixed order: (LoRA's adapters,
`models/lora.py`) → PP → (fp8's linear layers, `float8.py`) → TP/SP → EP → CP → activation
recomputation → compile → FSDP/DDP. Each axis lives in its own module (`data`, `tensor`, `pipeline`,
`context`, `expert`), cuts the model where its family's plan (`models/*/parallel_plan.py`) says and
returns its part of the step as an `Axis` (`parallel/axis.py`); this file only orders them and
passes between them what one needs of another (the pipeline's stage modules and the split experts,
which data parallelism treats apart), so that no axis imports another. Before TP, on a CPU, the fp32
linear layers may take oneDNN's matmul (`training.cpu_linear onednn`, `kernels/cpu_linear.py`).

Under pipeline parallelism the pipeline cut comes first: this rank keeps its stages' part of the
model, the other axes apply to that part, and FSDP takes each stage as a root. Expert parallelism
splits the routed experts (over ep and tp), which data parallelism then leaves alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ultratron.kernels.cpu_linear import apply_cpu_linear
from ultratron.models.lora import apply_lora
from ultratron.models.registry import plan_of
from ultratron.parallel.axis import Axes
from ultratron.parallel.compile import apply_compile, compiled_loss
from ultratron.parallel.context import apply_context_parallel
from ultratron.parallel.data import apply_data_parallel
from ultratron.parallel.dims import ParallelDims
from ultratron.parallel.expert import apply_expert_parallel
from ultratron.parallel.float8 import apply_float8
from ultratron.parallel.materialize import initialize, is_meta, materialize
from ultratron.parallel.offload import HostActivations, apply_offload
from ultratron.parallel.pipeline import split_model
from ultratron.parallel.recompute import apply_recompute
from ultratron.parallel.replicas import apply_replicas
from ultratron.parallel.tensor import apply_tensor_parallel


def topology(layout, collective_timeout: float = 300.0) -> ParallelDims:
    """The launch (torchrun's environment) checked against the layout; `init_distributed` then joins
    the process group and builds the mesh, whose collectives wait `collective_timeout` seconds."""
    return ParallelDims.from_config(layout, collective_timeout)


@dataclass
class Parallel:
    """A model spread over the ranks: what the optimizer, the checkpoint and the norm see (`model`),
    and each active axis' part of the step (`axes`)."""

    model: nn.Module
    axes: Axes
    dims: ParallelDims
    host: HostActivations | None = None  # the offloaded activations' hooks and accounting, when on

    def compiled_loss(self, loss_fn, enabled: bool):
        """The training loss, compiled when `enabled` and the logits are whole (not under tp)."""
        return compiled_loss(loss_fn, enabled, sharded_logits=self.dims.tp > 1)


def parallelize(model: nn.Module, dims: ParallelDims, cfg, device: torch.device | str | None = None,
                starter=None) -> Parallel:
    """Every axis applied to `model`. A model built on the meta device (`build_model(..., "meta")`)
    comes back materialized on `device`, each rank holding only its shards, and initialized as one
    process would be (`start`, or `starter(model, stages)` in its place: `ultratron simulate` starts
    under fake tensors and measures it): FSDP2 shards the meta model before anything is allocated;
    DDP, which copies rank 0's weights at construction, wraps the materialized one."""
    plan = plan_of(model)
    meta = is_meta(model)
    device = torch.device(device) if device is not None else (torch.device("cpu") if meta else device_of(model))
    if cfg.lora.rank > 0:  # before any axis: the adapters are the model's parameters from here on
        apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, plan.lora_targets)
    pipeline = None
    if dims.pp > 1:
        model, pipeline = split_model(model, dims, cfg, plan)
    model = apply_cpu_linear(model, cfg.training.cpu_linear, dims.tp, device)
    model = apply_float8(model, dims, plan, cfg.training.precision, cfg.training.fp8_scaling, device)
    model, tensor = apply_tensor_parallel(model, dims, plan)
    model, expert = apply_expert_parallel(model, dims, plan)
    model, context = apply_context_parallel(model, dims, plan, cfg.parallel.cp_attention)
    model = apply_recompute(model, cfg.training.recompute, plan)
    model, host = apply_offload(model, cfg.training.offload_activations, plan)
    model = apply_compile(model, cfg.training.compile, plan)
    roots = pipeline.build_stages(model, plan) if pipeline is not None else None
    starter = starter or (lambda part, stages: start(part, device, cfg.training.seed, stages))
    sharded = dims.data_parallel > 1 and dims.uses_fsdp
    if meta and not sharded:
        starter(model, roots or [])  # DDP and replicate wrap real weights
    ignored = set(expert.params) if expert is not None else None
    model, data = apply_data_parallel(model, dims, cfg.training.precision, plan, roots, ignored=ignored)
    if meta and sharded:
        starter(model, roots or [])
    if pipeline is not None:
        pipeline.finish(model)
    replicas = apply_replicas(dims)  # across replica groups, outside everything a group does inside
    axes = [axis for axis in (data, tensor, pipeline, context, expert, replicas) if axis is not None]
    return Parallel(model, Axes(axes, model), dims, host)


def start(model: nn.Module, device: torch.device, seed: int, stages: list[nn.Module]) -> None:
    """The meta model's shards given storage on `device` and initialized (`parallel/materialize.py`)."""
    materialize(model, device, also=stages)
    initialize(model, seed)


def device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
