"""Bytes per GPU of a training step for a model shape and a parallel layout, as the trainer runs it.

Static terms, per parameter on the rank (Ψ after TP and PP; N = the dp·cp ranks that ZeRO shards over,
under HSDP those of a replica group, dp_shard·cp),
following what `parallel/data.py` does for the layout (`rules.data_parallel_wrapper`):
  one process, DDP, FSDP2's replicate — fp32 weights (bf16 only as autocast's copies, counted with
  the activations), fp32 gradients, Adam moments: 4 + 4 + 8 = 16 bytes; ZeRO-1 (DDP with
  ZeroRedundancyOptimizer) shards the moments 8/N. DDP's gradients are views of its all-reduce
  buckets (`gradient_as_bucket_view`, parallel/data.py), not a second copy; once, before
  the second step's forward, DDP rebuilds its buckets in the order backward made the gradients
  ready, holding old and new buckets at once (4 more, a moment with no activations alive).
  FSDP2 (zero 2, zero 3, and zero 0/1 whenever the trainer shards) — sharded fp32 weights 4/N,
  sharded fp32 gradients 4/N, moments 8/N; ZeRO-2 keeps each weight gathered in the compute
  dtype (2 in bf16, 4 in fp32; 1 under fp8: the fp8 weight copies `parallel/float8.py` all-gathers)
  from forward through backward, ZeRO-3 only the root (comm_buffers: embedding, final norm, head)
  and, during a block's backward, two blocks (the next one prefetched; where `zero3_units` is
  linear, as the trainer runs on a CPU, its largest linear layer alone), one block's (one unit's)
  gradients reduce-scattered in fp32 (in its transient; at the loss's backward and the optimizer
  step no block is gathered). With more than one micro-batch a step (or under pp) ZeRO-2 reduces
  gradients only on the last one, so FSDP2 accumulates the unsharded gradients in fp32 until then
  (grad_accum_buffer, 4; measured by `ultratron simulate`); ZeRO-3 reduce-scatters every
  micro-batch's and its sharded gradients add up (alive from the second micro-batch's backward)
  but under pp, where torch's stages reduce once after the schedule and keep ZeRO-3's parameters
  gathered as well.
  `fp32_grad_accum` prices the Megatron-LM convention instead (its README's table, "bf16 param,
  fp32 grads": 18 bytes, 6 + 12/d with the distributed optimizer): bf16 weights 2, fp32 main
  gradients 4 (the bf16 gradient is not kept), fp32 master 4 and moments 8; ZeRO-1 shards master
  and moments, ZeRO-2 also the gradients, ZeRO-3 also the weights.
TP shards the matrices (norm weights stay whole); PP keeps the rank's stages' layers, the first
stage adds the embedding, the last the final norm and output head (its own copy when tied).

Mixture of experts (`planning.experts`): the routed experts split over ep·tp (per-layer parameters
are the block's minus its routed experts, plus the rank's E/ep experts' share) and, once split (ep or
tp > 1), left out of ZeRO's and DDP's sharding and buckets as the trainer does — their parameters,
gradients and moments whole, 16 bytes, as one process holds them; the routed slots' activations in
place of the dense SwiGLU's (`planning.activations`); the all-to-all's send and receive buffers under
expert parallelism (in comm_buffers).

LoRA (`lora=(rank, targets)`, `planning.lora`): the model's own weights are frozen and hold their
parameter bytes only; the adapters of the rank's layers, split over tp as the trainer splits them
(one factor of each adapted layer's A · B, the other whole), hold every static term, sharded as above.
Activations are priced as without LoRA (the adapters' own, tokens × rank per adapted layer, are
small beside them).

Activations: `planning.activations` (what the trainer's model keeps, tensor by tensor, or the
textbook's formula). Pipeline parallel: the stages, their layers and their ranks come from
`planning.pipeline` — the same split and placement the trainer runs. A rank holds the parameters
of its stages. Its schedule keeps several micro-batches' activations alive at once: the planner
walks the order the schedule runs (`planning.pipeline.schedule_events`, checked against torch's)
and takes the moment the rank's activations peak (GPipe: all m; 1F1B: pp − rank; interleaved and
zero bubble: their warm-up depth; the V schedules about 2·pp stage-chunks). torch's stages also
keep a receive buffer per micro-batch for the activations (and for their gradients) of each stage
that has a neighbour on another rank. Every pipeline rank is estimated; the heaviest is reported
(`estimate_memory_per_rank` gives each).

Peak: the larger of two moments (`MemoryBreakdown.peak_moment`).
  Backward's (`backward_bytes`): static + communication buffers + activations + loss + the larger
  transient of the loss's backward and a block's backward (its recomputed activations, the
  gradients in flight and ZeRO-3's gathered blocks) — less the gradients not made yet (`gradients`
  stays the rank's gradient bytes; `backward_gradients` those alive then): the trainer zeroes them
  to None, FSDP2 makes its sharded gradients in the last micro-batch's reduce-scatter, so none of
  them (under pp, where the stages reduce after all micro-batches, they stay counted: they stand
  in for that moment's accumulation, gradients and reduce-scatter buffers, see `_static`); one
  process's exist once an earlier micro-batch made them (grad_accum > 1 or pp > 1); DDP's are
  views of buckets that stay, so all of them. Measured by `ultratron simulate` (Llama-3 8B, seq
  4096, mb 1, bf16, dp 8, ZeRO-3: the peak at backward's start without gradients).
  The optimizer step's (`step_bytes`): static with every gradient (but FSDP2's unsharded
  accumulation, freed by the reduce-scatter that makes them) + communication buffers +
  `step_temporaries`, no activations: torch's foreach AdamW (sharded or DTensor parameters)
  allocates an fp32 tensor per trained parameter for sqrt(v), the fused AdamW the trainer uses
  otherwise none; or DDP's bucket rebuild before the second step's forward.
Start (`MemoryBreakdown.start_*`, from `meta` to the first step): `planning/start.py`. A layout fits
when the larger of the step's peak and the start's (`fit_bytes`) does.

What torch's allocator does not count is left to the search's headroom: the CUDA context, NCCL's
own buffers (NCCL_BUFFSIZE, 4 MiB per channel and peer by default) and allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

from ultratron.errors import UserError
from ultratron.models.init_blocks import block_elements
from ultratron.planning.activations import (
    ACTIVATION_MODELS,
    RECOMPUTE,
    block_backward_bytes,
    dtypes_of,
    first_stage_items,
    last_stage_items,
    layer_activation_bytes,
    layer_matmul_params,
    loss_backward_bytes,
    per_op_layer_items,
)
from ultratron.planning.breakdown import GiB, MemoryBreakdown
from ultratron.planning.experts import all_to_all_buffer_bytes, is_moe, routed_expert_params_per_layer
from ultratron.planning.layout import Layout, check_layout
from ultratron.planning.lora import adapter_params_per_layer
from ultratron.planning.params import count_params_of
from ultratron.planning.pipeline import peak_in_flight, rank_stages, stage_ranks, stage_split
from ultratron.planning.rules import field_of, gathers_per_linear, head_dim_of, reduces_every_micro_batch
from ultratron.planning.start import (
    held_tensor_shapes,
    layer_kinds,
    layer_tensor_shapes,
    rope_table_bytes,
    stored_chunk_elements,
)

__all__ = ["ACTIVATION_MODELS", "RECOMPUTE", "GiB", "MemoryBreakdown", "estimate_memory", "estimate_memory_per_rank",
           "heaviest_rank", "layer_activation_bytes", "layer_tensor_shapes", "stored_chunk_elements"]


def _head_dim(shape) -> int:
    return head_dim_of(shape)


@dataclass(frozen=True)
class PipelineRank:
    """What one pipeline rank runs: its stages, their layers, and whether it holds the ends."""

    rank: int
    stages: list[int]
    layers: list[int]  # per stage, in the order of `stages`
    first: bool
    last: bool
    dense_layers: int = 0  # of its layers, a mixture of experts' dense first layers (DeepSeek-V3's 3)

    @property
    def name(self) -> str:
        if self.first and self.last:
            return "only" if len(self.stages) == 1 else "first+last"
        return "first" if self.first else "last" if self.last else "middle"


def pipeline_ranks(shape, layout: Layout) -> list[PipelineRank]:
    """Every pipeline rank's stages and layers, from the trainer's own split and placement."""
    dense = field_of(shape, "n_dense_layers") if is_moe(shape) else 0
    if layout.pp == 1:
        return [PipelineRank(0, [0], [shape.n_layers], True, True, dense)]
    split = stage_split(shape, layout.pp, layout.pp_schedule, layout.pp_virtual_stages, layout.pp_balance,
                        layout.seq_len, layout.pp_split)
    starts = [sum(split[:s]) for s in range(len(split))]
    ranks = stage_ranks(layout.pp_schedule, layout.pp, layout.pp_virtual_stages)
    out = []
    for rank in range(layout.pp):
        stages = rank_stages(layout.pp_schedule, layout.pp, layout.pp_virtual_stages, rank)
        held_dense = sum(max(0, min(starts[s] + split[s], dense) - starts[s]) for s in stages)
        out.append(PipelineRank(rank, stages, [split[s] for s in stages], ranks[0] == rank, ranks[-1] == rank,
                                held_dense))
    return out


def _rank_shape(shape, where: PipelineRank):
    """The model as far as a pipeline rank holds it: its layers, of which its dense ones, so that the
    average layer the terms below charge is the rank's own (a mixture of experts' dense first layers
    all sit on the first stage)."""
    if not is_moe(shape) or (sum(where.layers) == shape.n_layers and where.dense_layers == shape.n_dense_layers):
        return shape
    return replace(shape, n_layers=sum(where.layers), n_dense_layers=where.dense_layers)


def _layer_params(shape, t: int) -> float:
    """The average block's parameters on a tensor-parallel rank but its routed experts (the norm
    weights stay whole)."""
    norms = 2 * shape.dim + (2 * _head_dim(shape) if getattr(shape, "qk_norm", False) else 0)
    return (count_params_of(shape).mean_layer - routed_expert_params_per_layer(shape) - norms) / t + norms


def _largest_unit(shape, where: PipelineRank, t: int, split_experts: bool) -> float:
    """ZeRO-3 with each linear layer its own FSDP2 unit: the most parameters gathered at once on the
    rank, its largest linear layer's weight (tp shards it) or a block's rest (norms, and its routed
    experts while they are not split)."""
    largest = 0.0
    for moe in layer_kinds(shape, where):
        shapes = layer_tensor_shapes(shape, moe)
        rest = sum(prod(s) for s in shapes if len(s) == 1 or (len(s) == 3 and not split_experts))
        largest = max(largest, rest, *(prod(s) / t for s in shapes if len(s) == 2))
    return largest


def _split_expert_params(shape, layout: Layout, where: PipelineRank) -> float:
    """The rank's routed experts' parameters once split over ep·tp (which ZeRO leaves alone)."""
    split = layout.ep > 1 or layout.tp > 1
    return sum(where.layers) * routed_expert_params_per_layer(shape) / (layout.ep * layout.tp) if split else 0.0


def _rank_params(shape, layout: Layout, where: PipelineRank) -> float:
    counts = count_params_of(shape)
    t = layout.tp
    params = sum(where.layers) * (_layer_params(shape, t) + routed_expert_params_per_layer(shape) / (layout.ep * t))
    if where.first:
        params += counts.embedding / t
    if where.last:
        params += counts.final_norm
        if counts.output or layout.pp > 1:  # a tied head keeps its own copy under pipeline parallel
            params += counts.embedding / t
    return params


@dataclass(frozen=True)
class _Static:
    """Bytes of each static term per parameter on the rank, and how the optimizer runs."""

    parameters: float
    gradients: float
    grad_accum_buffer: float
    master_weights: float
    optimizer_states: float
    ddp_buckets: bool  # DDP: gradients are views of its buckets, which it rebuilds once (a second copy then)
    gathered_blocks: bool  # ZeRO-3: weights gathered a block at a time
    fused_adam: bool  # the fused AdamW (no temporaries); else torch's foreach AdamW
    backward_gradients: bool  # the gradients exist at backward's peak (see MemoryBreakdown.backward_gradients)
    accum_at_step: bool = True  # the accumulation buffer is alive at the optimizer step (not FSDP2's)
    at_rest: float = 4.0  # the parameter as stored before the first forward (no gathered copy): the start's


def _static(layout: Layout) -> _Static:
    """The static terms of the layout as the trainer runs it (see the module docstring)."""
    n = layout.shard_group
    wrapper = layout.wrapper
    earlier = layout.grad_accum > 1 or layout.pp > 1  # a micro-batch's backward ran before the peak's
    if layout.fp32_grad_accum and layout.precision == "bf16":  # the Megatron-LM convention
        by = lambda level: n if layout.zero >= level else 1
        return _Static(2 / by(3), 0.0, 4 / by(2), 4 / by(1), 8 / by(1), False, layout.zero == 3 and n > 1, True, True,
                       at_rest=2 / by(3) + 4 / by(1))
    if wrapper == "fsdp":
        # torch's pipeline stages keep FSDP from resharding after backward until the step's last
        # micro-batch, so under pp ZeRO-3's parameters stay gathered too
        held = layout.zero != 3 or layout.pp > 1
        gathered = layout.gathered_bytes if held else 0.0  # ZeRO-2: held through backward
        # gradient sync is off but on a step's last micro-batch (the data axis' no-sync, or the
        # stages'), so FSDP2 accumulates each unsharded gradient, in fp32 (its reduce dtype), until then;
        # but ZeRO-3 without pp reduce-scatters every micro-batch and adds up the sharded gradients
        every_micro = reduces_every_micro_batch(layout)
        accumulated = 4.0 if n > 1 and (layout.grad_accum > 1 or layout.pp > 1) and not every_micro else 0.0
        # the trainer zeroes gradients to None; FSDP2 makes the sharded ones in the last micro-batch's
        # reduce-scatter, after backward's peak (unsharded, its gradients are the accumulated ones).
        # Under pp torch's stages reduce once all micro-batches ran backward, a moment with the
        # accumulation, the sharded gradients and the reduce-scatter's buffers but no activations, which
        # this does not price: counting the gradients at backward's peak stands in for it (`ultratron
        # simulate`, llama3-1b dp2 tp2 pp2 cp2, first rank: measured 4.95 GiB, planned 4.70 with them,
        # 4.30 without)
        return _Static(4 / n + gathered, 4 / n, accumulated, 0.0, 8 / n, False, not held, False,
                       ((n == 1 or every_micro) and earlier) or layout.pp > 1, False, at_rest=4 / n)
    sharded = n if wrapper == "ddp" and layout.zero == 1 else 1
    fused = wrapper in ("none", "ddp") and sharded == 1 and layout.tp == 1
    # DDP's buckets stay from step to step; one process's gradients exist once an earlier micro-batch made them
    return _Static(4.0, 4.0, 0.0, 0.0, 8 / sharded, wrapper == "ddp", False, fused, wrapper == "ddp" or earlier)


def _stage_items(shape, layout: Layout, stage: int, layers: int, n_stages: int,
                 model: str) -> tuple[float, float, float]:
    """(activations, the loss's share of them, what is freed before the stage's last block runs
    backward) that one micro-batch leaves alive on a stage."""
    per_layer = layer_activation_bytes(shape, layout, model)
    alive, loss, freed = per_layer * layers, 0.0, 0.0
    if stage == 0:
        alive += sum(first_stage_items(shape, layout).values())
    if stage == n_stages - 1:
        head, loss_items = last_stage_items(shape, layout, model)
        alive += sum(head.values())
        loss = sum(loss_items.values())
        freed = sum(head.values()) + loss_items.get("log-probabilities", 0.0)
    return alive + loss, loss, freed


def _rank_memory(shape, layout: Layout, where: PipelineRank, model: str, lora: tuple | None = None) -> MemoryBreakdown:
    shape = _rank_shape(shape, where)
    params = _rank_params(shape, layout, where)
    st = _static(layout)
    # split experts (ep or tp > 1) are left out of ZeRO's sharding and DDP's buckets, as the trainer does:
    # they keep what one process keeps
    experts = _split_expert_params(shape, layout, where)
    se = _static(replace(layout, dp=1, dp_replicate=1, cp=1)) if experts else st
    sharded = params - experts
    term = lambda name: sharded * getattr(st, name) + experts * getattr(se, name)
    p = layout.compute_bytes
    tokens = layout.micro_batch_size * layout.seq_len / layout.cp
    t = layout.tp
    h = shape.dim
    kv = shape.n_kv_heads * _head_dim(shape)

    n_stages = layout.pp * layout.stages_per_rank
    per_stage, loss_share, freed = [], [], []
    for stage, layers in zip(where.stages, where.layers, strict=True):
        alive, loss, gone = _stage_items(shape, layout, stage, layers, n_stages, model)
        per_stage.append(alive)
        loss_share.append(loss)
        freed.append(gone)
    in_flight = peak_in_flight(layout.pp_schedule, layout.pp, layout.pp_virtual_stages, layout.grad_accum, where.rank,
                               per_stage)
    loss_logits = sum(k * loss for k, loss in zip(in_flight, loss_share, strict=True))
    activations = sum(k * b for k, b in zip(in_flight, per_stage, strict=True)) - loss_logits
    host = back = 0.0  # back: offload's block whose activations are back on the device for its backward
    if layout.offload_activations and layout.recompute == "none":
        # every block's saved tensors move to the host as they are saved (the host line: what moves, all
        # of it there at forward's end), and come back as backward takes them: one block's, during its
        # backward (in the transient). Under recompute they are the checkpoint's to keep (its inputs,
        # its cache), which autograd's hooks do not see: nothing moves (parallel/offload.py)
        one_block = layer_activation_bytes(shape, layout, model)
        host = sum(k * one_block * n for k, n in zip(in_flight, where.layers, strict=True))
        activations -= host
        back = one_block
    comm = block_comm = 0.0
    if st.gathered_blocks:
        # a block's sharded parameters: its routed experts too while they are not split
        layer_params = _layer_params(shape, t) + (0.0 if experts else routed_expert_params_per_layer(shape))
        # at a block's backward: it and the next (FSDP2's backward prefetch) gathered, and one block's
        # fp32 gradients reduce-scattered — where each linear layer is a unit (`zero3_units`: the
        # trainer on a CPU, parallel/data.py), one unit gathered and reduced; none at the loss's
        # backward (the last block resharded after forward) nor at the optimizer step
        gathered, reduced = 2 * layer_params, layer_params
        if layout.zero3_units == "linear":  # (a small block stays whole, without the prefetch)
            gathered = reduced = (_largest_unit(shape, where, t, split_experts=bool(experts))
                                  if gathers_per_linear(layer_params * 4) else layer_params)
        block_comm = gathered * layout.gathered_bytes + reduced * 4
        # the root (embedding, final norm, head) stays gathered through the step (parallel/data.py)
        comm += p * (sharded - sum(where.layers) * layer_params)
    # Backward's transients on top of forward's leftovers: the loss's gradients on the last stage,
    # then a block's backward with ZeRO-3's gathered blocks (the last stage has freed its head and
    # log-probabilities by then).
    transient = without_loss = max(block_backward_bytes(shape, layout, model) + block_comm + back - max(freed), 0.0)
    if where.last:
        transient = max(transient, loss_backward_bytes(shape, layout))
    if layout.pp > 1:  # torch's stages keep a receive buffer per micro-batch and neighbour on another rank
        ranks = stage_ranks(layout.pp_schedule, layout.pp, layout.pp_virtual_stages)
        remote = sum((s > 0 and ranks[s - 1] != where.rank) + (s < n_stages - 1 and ranks[s + 1] != where.rank)
                     for s in where.stages)
        comm += remote * layout.grad_accum * dtypes_of(layout).residual * tokens * h / (t if layout.sp else 1)
    if layout.cp > 1:
        comm += 2 * p * tokens * 2 * kv / t
    all_to_all = all_to_all_buffer_bytes(shape, tokens, p, layout.ep)
    comm += all_to_all
    per_op = model == "per-op"
    static = {name: term(name) for name in ("parameters", "gradients", "grad_accum_buffer", "master_weights",
                                            "optimizer_states")}
    alive = lambda s: s.gradients * s.backward_gradients
    backward_gradients = sharded * alive(st) + experts * alive(se)
    adapters = 0.0
    if lora is not None:
        # LoRA: the model's own weights are frozen — their parameters only, no gradients, no
        # optimizer state; the adapters (of this rank's layers) carry every term, sharded alike
        adapters = adapter_params_per_layer(shape, *lora, tp=t) * sum(where.layers)
        static = {name: adapters * getattr(st, name) for name in static}
        static["parameters"] += sharded * st.parameters + experts * se.parameters
        backward_gradients = adapters * alive(st)
    # the optimizer step (of what it trains), or DDP's bucket rebuild before the next forward, runs while
    # no activations are alive; MemoryBreakdown.peak_bytes takes the larger of it and backward's peak
    optimizer_temporaries = 0.0 if st.fused_adam else 4 * static["optimizer_states"] / 8
    bucket_rebuild = 4 * (adapters if lora is not None else sharded) if st.ddp_buckets else 0.0
    between_steps = max(optimizer_temporaries, bucket_rebuild)
    # the start (the module doc's "Start"): the shards at rest, the buffers, and initialization's two
    # blocks or a load's largest stored chunk, over the tensors the rank holds a part of
    held = held_tensor_shapes(shape, where)
    init_block = max(held, key=block_elements)
    stored = max(held, key=stored_chunk_elements)
    return MemoryBreakdown(
        **static,
        activations=activations,
        loss_logits=loss_logits,
        comm_buffers=comm,
        transient=max(transient, 0.0),
        backward_gradients=backward_gradients,
        step_temporaries=between_steps,
        accum_at_step=st.accum_at_step,
        host_activations=host,
        start_shards=(sharded + adapters) * st.at_rest + experts * se.at_rest,
        start_buffers=rope_table_bytes(shape, layout),
        start_init_transient=2 * 4 * block_elements(init_block),
        start_load_transient=4 * stored_chunk_elements(stored),
        stage=where.name,
        extra={"params_on_gpu": params, "pp_rank": where.rank, "stages": where.stages, "first": where.first,
               "last": where.last, "layers_on_stage": sum(where.layers), "layers_per_stage": where.layers,
               "per_layer_activation_bytes": layer_activation_bytes(shape, layout, model),
               "per_layer_activation_items": per_op_layer_items(shape, layout) if per_op else {},
               "in_flight_micro_batches": in_flight, "activation_model": model,
               "data_parallel": layout.wrapper, "matmul_params_per_layer": layer_matmul_params(shape, t),
               "expert_params_on_gpu": experts, "all_to_all_bytes": all_to_all, "lora_params_on_gpu": adapters,
               "transient_without_loss": without_loss, "start_pp_rank": where.rank,
               "largest_init_block_of": init_block, "largest_stored_tensor": stored},
    )


def estimate_memory_per_rank(shape, layout: Layout, activation_model: str = "per-op",
                             lora: tuple | None = None, fill_pipeline: bool = True) -> list[MemoryBreakdown]:
    """Bytes on each pipeline rank (one entry without pp); raises UserError for an impossible layout.
    `lora`: (rank, targets) of LoRA adapters on the frozen model (`planning/lora.py`);
    `fill_pipeline=False`: estimate a pipeline with fewer micro-batches than stages too (it runs, slowly)."""
    problems = check_layout(shape, layout, fill_pipeline=fill_pipeline)
    if activation_model not in ACTIVATION_MODELS:
        problems.append(f"activation model {activation_model!r} is not one of {', '.join(ACTIVATION_MODELS)}")
    if problems:
        raise UserError(problems)
    return [_rank_memory(shape, layout, where, activation_model, lora) for where in pipeline_ranks(shape, layout)]


def heaviest_rank(ranks: list[MemoryBreakdown]) -> MemoryBreakdown:
    """The pipeline rank with the largest step peak, its start terms those of the rank whose start is
    the largest (extra["start_pp_rank"]; the first stage's embedding or the last's head, usually):
    `fit_bytes` is then the most any rank must hold."""
    heaviest = max(ranks, key=lambda m: m.peak_bytes)
    start = max(ranks, key=lambda m: m.start_bytes)
    return replace(heaviest, start_shards=start.start_shards, start_buffers=start.start_buffers,
                   start_init_transient=start.start_init_transient, start_load_transient=start.start_load_transient,
                   extra={**heaviest.extra, **{k: start.extra[k] for k in ("start_pp_rank", "largest_init_block_of",
                                                                            "largest_stored_tensor")}})


def estimate_memory(shape, layout: Layout, activation_model: str = "per-op", lora: tuple | None = None
                    ) -> MemoryBreakdown:
    """Bytes on the heaviest GPU for one training step; raises UserError for an impossible layout."""
    ranks = estimate_memory_per_rank(shape, layout, activation_model, lora)
    heaviest = heaviest_rank(ranks)
    # offload: the host line is the most any rank puts on its host (the first pipeline stage, most in flight)
    return replace(heaviest, host_activations=max(m.host_activations for m in ranks))
