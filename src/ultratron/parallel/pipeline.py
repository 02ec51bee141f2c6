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
  * a forward-only pass that runs any placement with any sequence length (validation, whose last
    stage computes the step's loss on what the stage hands it, and the end-of-run sample), since
    torch's schedules fix the activation shapes when they start.

In a step (`PipelineAxis`): the micro-batches run through the schedule (`PipelineRunner`), which
divides the gradients by their count after the last backward; the loss, known on the last stage,
reaches every rank of the pipeline; the gradient norm and per-layer metrics add the stages' ranks.
A micro-batch's token positions (a context-parallel shard's) and its packed documents (under
document masking) are handed to every stage module.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ultratron.models.plan import ParallelPlan
from ultratron.models.registry import model_args
from ultratron.parallel.axis import AroundForward, Axis, Loss, MicroBatch, plain
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


def split_model(model: nn.Module, dims: ParallelDims, cfg, plan: ParallelPlan) -> tuple[nn.Module, PipelineAxis]:
    """This rank's part of the model: the blocks of its stages (embedding and head where they belong)
    under the full model's names; and the axis, which says where everything runs."""
    par = cfg.parallel
    split = stage_split(cfg.model, dims.pp, par.pp_schedule, par.pp_virtual_stages, par.pp_balance,
                        cfg.training.seq_len, par.pp_split)
    pipeline = Pipeline(par.pp_schedule, split, stage_ranks(par.pp_schedule, dims.pp, par.pp_virtual_stages),
                        rank_stages(par.pp_schedule, dims.pp, par.pp_virtual_stages, dims.pp_rank))
    layers = stage_layers(split)
    names = [str(i) for stage in pipeline.mine for i in layers[stage]]
    part = plan.pipeline_stage(model, names, pipeline.holds_first, pipeline.holds_last)
    return part, PipelineAxis(pipeline, dims)


def build_stages(part: nn.Module, pipeline: Pipeline, dims: ParallelDims, plan: ParallelPlan) -> list[nn.Module]:
    """The module of each of this rank's stages: views of the part (after TP and recompute wrapped
    its blocks), which the schedule runs and FSDP takes as roots."""
    layers = stage_layers(pipeline.split)
    pipeline.modules = []
    for stage in pipeline.mine:
        module = plan.pipeline_stage(part, [str(i) for i in layers[stage]], stage == 0,
                                     stage == pipeline.n_stages - 1)
        module.sequence_shards = dims.tp if dims.sp else 1
        pipeline.modules.append(module)
    return pipeline.modules


# ---- the schedule --------------------------------------------------------------------------

def build_schedule(pipeline: Pipeline, dims: ParallelDims, device: torch.device, n_micro_batches: int, loss_fn):
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

    def __init__(self, part: nn.Module, pipeline: Pipeline, dims: ParallelDims):
        copies = part.tied_copies  # copy → original (the model family's plan names them)
        self.enabled = bool(copies)
        self.group = _tied_pair_group(dims, pipeline) if self.enabled else None
        params = dict(part.named_parameters())  # the original and/or the copy, as this rank holds them
        # a frozen table (LoRA's) has no gradients, and its copies stay equal
        self.mine = [params[name] for name in (*copies.values(), *copies)
                     if name in params and params[name].requires_grad]

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
def forward_only(pipeline: Pipeline, dims: ParallelDims, tokens: torch.Tensor,
                 documents: torch.Tensor | None = None, whole: bool = True) -> torch.Tensor | None:
    """The last stage's output on the rank that holds it, None on the others: each stage runs where it
    lives and hands its activations to the next (the packed `documents`, which every rank was given,
    go to every stage). `whole`: gathered from the tp ranks (full logits, for sampling); else as the
    stage made it (vocabulary-sharded logits, or the hidden states, for a loss)."""
    group, me = dims.pp_group, dims.pp_rank
    modules = dict(zip(pipeline.mine, pipeline.modules, strict=True))
    x = tokens
    for stage, rank in enumerate(pipeline.ranks):
        if rank != me:
            continue
        if stage > 0 and pipeline.ranks[stage - 1] != me:
            x = _recv(dist.get_global_rank(group, pipeline.ranks[stage - 1]), group, tokens.device)
        x = modules[stage](x, documents=documents)
        if stage < pipeline.n_stages - 1 and pipeline.ranks[stage + 1] != me:
            _send(x, dist.get_global_rank(group, pipeline.ranks[stage + 1]), group)
    if not pipeline.holds_last:
        return None
    return x.full_tensor() if whole and isinstance(x, DTensor) else x


def broadcast_from_last(value: torch.Tensor | None, pipeline: Pipeline, dims: ParallelDims, shape, dtype,
                        device: torch.device) -> torch.Tensor:
    """`value` from the rank holding the last stage, on every rank of the pipeline."""
    out = value.to(dtype).contiguous() if pipeline.holds_last else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(out, src=dist.get_global_rank(dims.pp_group, pipeline.ranks[-1]), group=dims.pp_group)
    return out


# ---- the axis and its runner ------------------------------------------------------------------

class PipelineAxis(Axis):
    name = "pipeline"
    splits_layers = True

    def __init__(self, pipeline: Pipeline, dims: ParallelDims):
        self.pipeline, self.dims = pipeline, dims
        self.part: nn.Module | None = None
        self.tied: TiedGradients | None = None

    def build_stages(self, part: nn.Module, plan: ParallelPlan) -> list[nn.Module]:
        """The stage modules of the part as wrapped so far (the roots data parallelism shards)."""
        return build_stages(part, self.pipeline, self.dims, plan)

    def finish(self, part: nn.Module) -> None:
        """The part as the optimizer sees it (data parallelism has wrapped it): the tied copies' pair."""
        self.part = part
        self.tied = TiedGradients(part, self.pipeline, self.dims)

    def runner(self, model: nn.Module, loss: Loss, around_forward: AroundForward) -> PipelineRunner:
        return PipelineRunner(self, loss, around_forward)

    def after_backward(self) -> None:
        self.tied()

    def average_loss(self, value: torch.Tensor, training: bool) -> torch.Tensor:
        """The loss is known on the last stage's rank (the others hold zero)."""
        dist.all_reduce(value, group=self.dims.pp_group)
        return value

    def reduce_over_stages(self, value: torch.Tensor, op) -> torch.Tensor:
        dist.all_reduce(value, op=op, group=self.dims.pp_group)
        return value

    def norm_groups(self) -> list:
        return [self.dims.pp_group]

    def uncounted(self) -> list[torch.Tensor]:
        """The copy this rank holds of a table the first stage counts (the head's, tied)."""
        copies = set(self.part.tied_copies)
        return [p for name, p in self.part.named_parameters() if name in copies]

    def describe(self) -> list[str]:
        return [self.pipeline.describe()]


class PipelineRunner:
    """The step's micro-batches through torch's schedule: the first stage reads the inputs, the last
    computes the loss, the schedule runs forward and backward and divides the gradients by the
    micro-batch count. Forward runs under `around_forward` (autocast), backward outside it."""

    def __init__(self, axis: PipelineAxis, loss: Loss, around_forward):
        self.axis, self.pipeline, self.dims, self.loss = axis, axis.pipeline, axis.dims, loss
        self.device = next(axis.part.parameters()).device
        self.schedule, self.n_micro_batches = None, 0
        self._losses: list[torch.Tensor] = []
        for module in self.pipeline.modules:
            _forward_under(module, around_forward)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss, ce = self.loss(logits, targets)
        self._losses.append(plain(ce.detach()))
        return loss

    def forward_backward(self, batches: list[MicroBatch]) -> torch.Tensor:
        n = len(batches)
        if self.schedule is None or n != self.n_micro_batches:
            self.schedule = build_schedule(self.pipeline, self.dims, self.device, n, self._loss)
            self.n_micro_batches = n
        inputs = torch.cat([b.inputs for b in batches])
        targets = torch.cat([b.targets for b in batches])
        # every stage's module takes its micro-batch's documents (the schedule cuts them as the inputs)
        documents = {} if batches[0].documents is None else {"documents": torch.cat([b.documents for b in batches])}
        self._losses.clear()
        with self._positions(batches[0].positions):
            self.schedule.step(*([inputs] if self.pipeline.holds_first else []), return_outputs=False,
                               target=targets if self.pipeline.holds_last else None, **documents)
        if not self.pipeline.holds_last:
            return torch.zeros((), device=self.device)
        # (the first step's shape inference computes one loss more)
        return torch.stack(self._losses[-n:]).mean().float()

    def loss_weight(self, n_micro_batches: int) -> float:
        return 1.0  # torch's schedule divides the gradients by the micro-batch count after backward

    @torch.no_grad()
    def eval_loss(self, batch: MicroBatch, loss: Loss) -> torch.Tensor | None:
        with self._positions(batch.positions):
            out = forward_only(self.pipeline, self.dims, batch.inputs, batch.documents, whole=False)
        return None if out is None else plain(loss(out, batch.targets)[1])

    def train(self, mode: bool) -> None:
        self.axis.part.train(mode)
        for module in self.pipeline.modules:  # (views of the part, not its children)
            module.train(mode)

    def sampling_model(self) -> PipelineLogits:
        return PipelineLogits(self)

    @contextlib.contextmanager
    def _positions(self, positions: torch.Tensor | None):
        """Every stage module rotates by these positions (a context-parallel shard's) within."""
        for module in self.pipeline.modules:
            module.positions = positions
        try:
            yield
        finally:
            for module in self.pipeline.modules:
                module.positions = None


class PipelineLogits:
    """The pipeline as a callable model for sampling: full logits on every rank."""

    def __init__(self, runner: PipelineRunner):
        self.runner, self.args = runner, model_args(runner.axis.part)

    def parameters(self):
        return self.runner.axis.part.parameters()

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        runner.train(False)
        logits = forward_only(runner.pipeline, runner.dims, tokens)  # (the stages run under autocast already)
        shape = (*tokens.shape, self.args.vocab_size)
        return broadcast_from_last(logits, runner.pipeline, runner.dims, shape, torch.float32, runner.device)


def _forward_under(module: nn.Module, context) -> None:
    """Run `module`'s forward inside `context()` (forward hooks: torch's schedule calls the module)."""
    active: list = []

    def enter(*_):
        active.append(context())
        active[-1].__enter__()

    def leave(*_):
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
