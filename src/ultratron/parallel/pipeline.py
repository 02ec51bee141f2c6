"""Pipeline parallelism on PyTorch's own stages and schedules (`torch.distributed.pipelining`).

The model is cut by layers into stages (`planning.pipeline.stage_split`: balanced by FLOPs or
parameters, or `parallel.pp_split`), placed on the ranks of the `pp` mesh dimension as the
schedule wants (looped or in a V, `planning.pipeline.stage_ranks`). Each rank keeps only its own
stages, as one module under the full model's names (its "part", what the optimizer, the gradient
norm and the checkpoint see); each stage is a view of that part that the schedule runs. The rest of
the parallel order applies to the part and its stages: TP/SP, recompute, then FSDP with each stage
as a root (torch's stages drive FSDP's gradient reduction themselves, once per step).

What PyTorch lacks and this file adds:
  * the tied embedding across the first and last stage: each keeps a copy, their gradients are
    summed after backward over the pair of ranks holding them (Megatron-LM's embedding group), so
    the copies stay equal, and the gradient norm counts the table once;
  * a forward-only pass that runs any placement with any sequence length (validation and the
    end-of-run sample), since torch's schedules fix the activation shapes when they start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ultratron.models.plan import ParallelPlan
from ultratron.parallel.dims import ParallelDims
from ultratron.planning.pipeline import SINGLE, rank_stages, stage_layers, stage_ranks, stage_split

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Pipeline:
    """Where every stage runs, and the stages this rank runs."""

    schedule: str
    split: list[int]  # layers per stage
    ranks: list[int]  # the pipeline rank of each stage
    mine: list[int]  # this rank's stages, in stage order
    modules: list[nn.Module] = field(default_factory=list)  # their modules, in the same order

    @property
    def n_stages(self) -> int:
        return len(self.split)

    @property
    def holds_first(self) -> bool:
        return 0 in self.mine

    @property
    def holds_last(self) -> bool:
        return self.n_stages - 1 in self.mine

    def describe(self) -> str:
        cuts = [f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in stage_layers(self.split)]
        return (f"pipeline: {self.schedule}, {self.n_stages} stages of layers {' | '.join(cuts)} on pipeline "
                f"ranks {' '.join(map(str, self.ranks))}")


def split_model(model: nn.Module, dims: ParallelDims, cfg, plan: ParallelPlan) -> nn.Module:
    """This rank's part of the model: the blocks of its stages (embedding and head where they belong)
    under the full model's names, with a `pipeline` attribute saying where everything runs."""
    par = cfg.parallel
    split = stage_split(cfg.model, dims.pp, par.pp_schedule, par.pp_virtual_stages, par.pp_balance,
                        cfg.training.seq_len, par.pp_split)
    pipeline = Pipeline(par.pp_schedule, split, stage_ranks(par.pp_schedule, dims.pp, par.pp_virtual_stages),
                        rank_stages(par.pp_schedule, dims.pp, par.pp_virtual_stages, dims.pp_rank))
    layers = stage_layers(split)
    names = [str(i) for stage in pipeline.mine for i in layers[stage]]
    part = plan.pipeline_stage(model, names, pipeline.holds_first, pipeline.holds_last)
    part.pipeline = pipeline
    return part


def build_stages(part: nn.Module, dims: ParallelDims, plan: ParallelPlan) -> list[nn.Module]:
    """The module of each of this rank's stages: views of the part (after TP and recompute wrapped
    its blocks), which the schedule runs and FSDP takes as roots."""
    pipeline: Pipeline = part.pipeline
    layers = stage_layers(pipeline.split)
    pipeline.modules = []
    for stage in pipeline.mine:
        module = plan.pipeline_stage(part, [str(i) for i in layers[stage]], stage == 0,
                                     stage == pipeline.n_stages - 1)
        module.sequence_shards = dims.tp if dims.sp else 1
        pipeline.modules.append(module)
    return pipeline.modules


# ---- the schedule --------------------------------------------------------------------------

def build_schedule(part: nn.Module, dims: ParallelDims, device: torch.device, n_micro_batches: int, loss_fn):
    """torch's schedule for `parallel.pp_schedule` over this rank's stages. Gradients are divided by
    the micro-batch count after the last backward (`scale_grads`), as gradient accumulation does."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
               "zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
    pipeline: Pipeline = part.pipeline
    stages = [PipelineStage(module, index, pipeline.n_stages, device, group=dims.pp_group)
              for index, module in zip(pipeline.mine, pipeline.modules, strict=True)]
    cls = classes[pipeline.schedule]
    return cls(stages[0] if pipeline.schedule in SINGLE else stages, n_microbatches=n_micro_batches,
               loss_fn=loss_fn, scale_grads=True)


def _tied_pair_group(dims: ParallelDims, pipeline: Pipeline):
    """The process group of the two ranks (same dp and tp coordinates) that hold the first and the
    last stage, when those differ; every rank creates every pair's group, as new_group requires."""
    first, last = pipeline.ranks[0], pipeline.ranks[-1]
    if first == last:
        return None
    per_stage = dims.world_size // dims.pp
    mine = None
    for offset in range(per_stage):
        group = dist.new_group([first * per_stage + offset, last * per_stage + offset])
        if dims.rank % per_stage == offset:
            mine = group
    return mine


class TiedGradients:
    """After backward, add the gradients of a tied table's two copies (first stage's embedding, last
    stage's head) so that both take the same optimizer step, as the one shared table would."""

    def __init__(self, part: nn.Module, dims: ParallelDims):
        copies = getattr(part, "tied_copies", {})  # copy → original (the model family's plan names them)
        pipeline: Pipeline = part.pipeline
        self.enabled = bool(copies)
        self.group = _tied_pair_group(dims, pipeline) if self.enabled else None
        params = dict(part.named_parameters())  # the original and/or the copy, as this rank holds them
        self.mine = [params[name] for name in (*copies.values(), *copies) if name in params]

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.enabled or not self.mine:
            return
        grads = []
        for param in self.mine:
            grad = param.grad
            if isinstance(grad, DTensor):
                # DTensor's embedding backward leaves a replicated gradient for a vocab-sharded table
                if grad.placements != param.placements:
                    param.grad = grad = grad.redistribute(placements=param.placements)
                grad = grad.to_local()
            grads.append(grad)
        if len(grads) == 2:  # both copies on this rank (a V schedule)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        else:
            dist.all_reduce(grads[0], group=self.group)


# ---- forward only: validation and sampling ---------------------------------------------------

def _send(tensor: torch.Tensor, dst: int, group) -> None:
    """The shape and dtype first (validation and sampling change the sequence length), then the data;
    both on the tensor's device, as nccl wants."""
    header = torch.tensor([tensor.dim(), *tensor.shape, _DTYPES.index(tensor.dtype)] + [0] * (6 - tensor.dim()),
                          device=tensor.device)
    dist.send(header, dst=dst, group=group)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def _recv(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.long, device=device)
    dist.recv(header, src=src, group=group)
    ndim = int(header[0])
    shape, dtype = [int(d) for d in header[1:1 + ndim]], _DTYPES[int(header[1 + ndim])]
    tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(tensor, src=src, group=group)
    return tensor


@torch.no_grad()
def forward_only(part: nn.Module, dims: ParallelDims, tokens: torch.Tensor) -> torch.Tensor | None:
    """The last stage's output (full logits, also under tensor parallel) on the rank that holds it,
    None on the others: each stage runs where it lives and hands its activations to the next."""
    pipeline: Pipeline = part.pipeline
    group, me = dims.pp_group, dims.pp_rank
    modules = dict(zip(pipeline.mine, pipeline.modules, strict=True))
    x = tokens
    for stage, rank in enumerate(pipeline.ranks):
        if rank != me:
            continue
        if stage > 0 and pipeline.ranks[stage - 1] != me:
            x = _recv(dist.get_global_rank(group, pipeline.ranks[stage - 1]), group, tokens.device)
        x = modules[stage](x)
        if stage < pipeline.n_stages - 1 and pipeline.ranks[stage + 1] != me:
            _send(x, dist.get_global_rank(group, pipeline.ranks[stage + 1]), group)
    if not pipeline.holds_last:
        return None
    return x.full_tensor() if isinstance(x, DTensor) else x


def broadcast_from_last(value: torch.Tensor | None, part: nn.Module, dims: ParallelDims, shape, dtype,
                        device: torch.device) -> torch.Tensor:
    """`value` from the rank holding the last stage, on every rank of the pipeline."""
    pipeline: Pipeline = part.pipeline
    out = value.to(dtype).contiguous() if pipeline.holds_last else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(out, src=dist.get_global_rank(dims.pp_group, pipeline.ranks[-1]), group=dims.pp_group)
    return out
