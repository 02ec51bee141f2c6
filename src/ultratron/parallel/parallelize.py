"""Apply parallelism to a plain model from outside, in one fixed order:
PP → TP/SP → EP → CP → activation recomputation → compile → FSDP/DDP. Each axis lives in its own
module and cuts the model where its family's plan (`models/*/parallel_plan.py`) says; this file
only orders them and gives a training step the few hooks it needs per micro-batch and per step.
Before TP, on a CPU, the fp32 linear layers take oneDNN's matmul (`parallel/cpu_linear.py`).

Under pipeline parallelism the pipeline cut comes first: this rank keeps its stages' part of the
model, the other axes apply to that part, and FSDP takes each stage as a root. Expert parallelism
splits the routed experts (over ep and tp), which data parallelism then leaves alone."""

from __future__ import annotations

import contextlib

from torch import nn

from ultratron.kernels.cpu_linear import apply_cpu_linear
from ultratron.models.registry import plan_of
from ultratron.parallel.compile import apply_compile
from ultratron.parallel.context_parallel import apply_context_parallel, sharded
from ultratron.parallel.data_parallel import apply_data_parallel, gradient_sync
from ultratron.parallel.dims import ParallelDims
from ultratron.parallel.expert_parallel import apply_expert_parallel, expert_params, reduce_expert_grads
from ultratron.parallel.pipeline import build_stages, split_model
from ultratron.parallel.recompute import apply_recompute
from ultratron.parallel.tensor_parallel import apply_tensor_parallel, loss_context


def parallelize(model: nn.Module, dims: ParallelDims, cfg) -> nn.Module:
    plan = plan_of(model)
    if dims.pp > 1:
        model = split_model(model, dims, cfg, plan)
    model = apply_cpu_linear(model, cfg.training.cpu_linear, dims.tp)
    model = apply_tensor_parallel(model, dims, plan)
    model = apply_expert_parallel(model, dims, plan)
    model = apply_context_parallel(model, dims, plan, cfg.parallel.cp_attention)
    model = apply_recompute(model, cfg.training.recompute, plan)
    model = apply_compile(model, cfg.training.compile, plan)
    roots = build_stages(model, dims, plan) if dims.pp > 1 else None
    return apply_data_parallel(model, dims, cfg.training.precision, plan, roots, ignored=set(expert_params(model)))


@contextlib.contextmanager
def micro_batch(model: nn.Module, dims: ParallelDims, last: bool):
    """Around one micro-batch's forward, loss and backward: reduce gradients only on the last
    micro-batch of the step, compute the loss on vocab-sharded logits under tensor parallel, and
    run attention across the context-parallel ranks (the micro-batch is this rank's shard)."""
    with gradient_sync(model, last), loss_context(dims), sharded(model):
        yield


def after_backward(model: nn.Module, dims: ParallelDims) -> None:
    """Once per step, after the last micro-batch's backward: the gradients data parallelism does not
    reduce itself (the split experts')."""
    reduce_expert_grads(model, dims)
