"""Search for the fastest parallel layout that fits: enumerate, check memory, estimate step time, rank.

Cost model (per optimizer step on the heaviest rank, every GPU busy in lock-step):
  compute   global tokens × training FLOPs/token (flops.py) × recompute (full +1/3, selective 2 %) ×
            the slowest pipeline rank's share ÷ (GPUs × dense peak × the efficiency of the layout's
            own per-rank matmul and attention shapes: planning.compute).
  comm      every collective the rank issues, by the trainer's rules, each with its bytes, group,
            link (NVLink in a node, the network when the group spans nodes) and NCCL bus factor
            (planning.comm.step_collectives); those an overlap can hide share a budget of the compute
            that hides them (`exposure`: FSDP gathers behind each micro-batch, gradient reductions
            behind the last backward, ring hops behind attention; × `overlap`); tp+sp, all-to-all
            and pipeline sends are on the critical path.
  elementwise  norms, residual adds, rotary, SwiGLU and the loss over the vocabulary, as bytes per
            token; the optimizer step as its model-state bytes; each kind at the rate and per-call
            latency `bench comm` measured on the model's own shapes, else at the memory bandwidth
            (planning.compute).
  shared cores  on a CPU profile, ranks per node × threads ÷ cores (at least 1) slows compute and
            elementwise work alike, and collectives hide behind nothing (gloo runs on the same cores).
  pipeline  the schedule's bubble fraction (planning.pipeline.bubble_fraction, the real micro-batch
            count) of the pipelined time, which includes each micro-batch's exposed transfers.
  step      (compute + elementwise + exposed tp, cp, ep, pp and FSDP gathers) × (1 + bubble) + exposed
            reductions + the optimizer step.
A layout fits when the larger of its step's peak and its start's (planning.memory: from `meta` to the
first step, fresh or from a checkpoint) fits in memory × (1 − headroom).
Rank by tokens/s per GPU (the same order as MFU); ties go to the layout with less memory.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from ultratron.errors import UserError
from ultratron.models.specs import spec_of
from ultratron.planning.comm import ATTENTION, COMPUTE, LAST_BACKWARD, Collective, Link, Network, step_collectives
from ultratron.planning.compute import (
    MATMUL_EFFICIENCY,
    compute_efficiency,
    elementwise_parts,
    kernel_seconds,
    loss_recompute_flops,
    offload_seconds,
)
from ultratron.planning.experts import is_moe
from ultratron.planning.flops import flops_per_token_of
from ultratron.planning.hardware import Accelerator
from ultratron.planning.layout import Layout, check_layout
from ultratron.planning.memory import GiB, MemoryBreakdown, estimate_memory
from ultratron.planning.params import count_params_of
from ultratron.planning.pipeline import LOOPED, SCHEDULES, SINGLE, stage_costs, stage_ranks, stage_split
from ultratron.planning.pipeline import bubble_fraction as bubble_fraction_of
from ultratron.planning.reasons import OPTIONS, options_summary, reasons_for, why_first
from ultratron.planning.rules import layout_problems, pipeline_problems, trainer_limits

SELECTIVE_RECOMPUTE_OVERHEAD = 0.02


@dataclass(frozen=True)
class SearchSpec:
    shape: object  # a ModelShape or anything with its fields
    accelerator: Accelerator
    n_gpus: int
    gpus_per_node: int
    global_batch_tokens: int
    seq_len: int
    precision: str = "bf16"
    headroom: float = 0.10  # fraction of GPU memory left free (allocator fragmentation, CUDA context)
    efficiency: float = MATMUL_EFFICIENCY  # fraction of the dense peak large matmuls reach (planning.compute)
    overlap: float = 0.8  # fraction of overlappable communication the compute hides
    activation_model: str = "per-op"
    max_mbs: int = 16
    max_cp: int = 8
    max_tp: int = 0  # largest tensor-parallel degree tried (0: the node's GPUs; search widens it when it must)
    network: Network | None = None  # measured links (`bench comm`'s profile); None: the GPU's table figures
    # Layout fields the user fixed (`plan search --tp 8`): the search keeps the layouts it would
    # choose that have these values, and sets those it never varies (pp_split, dp_replicate, ...).
    fixed: dict = field(default_factory=dict)

    @property
    def usable_bytes(self) -> float:
        return self.accelerator.memory_bytes * (1 - self.headroom)


@dataclass
class Estimate:
    layout: Layout
    memory: MemoryBreakdown
    compute_s: float = 0.0
    tp_comm_s: float = 0.0
    cp_exposed_s: float = 0.0
    pp_comm_s: float = 0.0
    bubble_s: float = 0.0
    dp_comm_s: float = 0.0
    dp_exposed_s: float = 0.0
    step_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    reasons: list[str] = field(default_factory=list)
    ep_comm_s: float = 0.0
    efficiency: float = 0.0  # the matmul efficiency the compute term assumed for this layout's shapes
    stage_imbalance: float = 1.0  # slowest pipeline rank's FLOPs over the mean rank's
    collectives: list[Collective] = field(default_factory=list)  # planning.comm.step_collectives
    exposed: list[float] = field(default_factory=list)  # each collective's seconds on the critical path
    elementwise_s: float = 0.0  # norms, residuals, rotary, SwiGLU, the loss (planning.compute.kernel_seconds)
    optimizer_s: float = 0.0  # the optimizer step's reads and writes of the model states
    offload_s: float = 0.0  # offloaded activations' copies over the host link (out in forward, back in backward)
    offload_exposed_s: float = 0.0  # of them, what forward's and backward's compute does not hide
    core_share: float = 1.0  # ranks per node × threads ÷ cores, at least 1 (a CPU's shared cores)
    measured_kernels: bool = False  # elementwise work and the optimizer at a profile's measured rates

    TIME_TERMS = ("compute_s", "elementwise_s", "tp_comm_s", "cp_exposed_s", "ep_comm_s", "pp_comm_s", "bubble_s",
                  "dp_comm_s", "dp_exposed_s", "optimizer_s", "offload_s", "offload_exposed_s")

    def as_dict(self) -> dict:
        """What `plan estimate --json` prints for a layout (and `plan search --json` for each it ranks):
        the peak, the step time, tokens/s/GPU and MFU, and the terms behind them."""
        return {
            "layout": dict(self.layout.__dict__), "describe": self.layout.describe(),
            "peak_bytes": self.memory.peak_bytes, "step_seconds": self.step_s,
            "tokens_per_sec_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
            "memory": self.memory.as_dict(),
            # step_seconds = compute + elementwise + TP + CP exposed + EP all-to-all + PP p2p + bubble
            # + DP exposed + optimizer (dp_comm_s: before overlap)
            "time": {term: getattr(self, term) for term in self.TIME_TERMS},
            "reasons": self.reasons, "compute_efficiency": self.efficiency, "stage_imbalance": self.stage_imbalance,
            "core_share": self.core_share,
            "collectives": [c.as_dict() | {"exposed_s": e} for c, e in zip(self.collectives, self.exposed,
                                                                            strict=True)],
        }


@dataclass
class SearchResult:
    spec: SearchSpec
    ranked: list[Estimate]
    considered: int
    too_big: int
    closest: Estimate | None  # the smallest peak among layouts that do not fit
    summary: list[str]

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(0, int(math.log2(max(limit, 1))) + 1)]


def enumerate_layouts(spec: SearchSpec):
    """Every layout the search considers (valid shapes; memory not yet checked)."""
    shape = spec.shape
    n, node = spec.n_gpus, spec.gpus_per_node
    sequences = spec.global_batch_tokens // spec.seq_len
    for tp in _powers_of_two(spec.max_tp or node):
        if n % tp or layout_problems(shape, tp=tp):
            continue
        for cp in _powers_of_two(spec.max_cp):
            if (n // tp) % cp or spec.seq_len % cp:
                continue
            for pp in _divisors(n // (tp * cp)):
                if pp > shape.n_layers:
                    continue
                dp = n // (tp * cp * pp)
                if sequences % dp or layout_problems(shape, tp=tp, pp=pp, cp=cp, seq=spec.seq_len, dp=dp):
                    continue
                # expert parallel for a mixture of experts: ep of the dp ranks, dividing the experts
                eps = ([ep for ep in _powers_of_two(dp) if not layout_problems(shape, ep=ep, dp=dp)]
                       if is_moe(shape) else [1])
                per_rank = sequences // dp
                # every schedule the trainer runs; the looped ones with 2 or 4 stages per rank
                schedules = [("1f1b", 0)] if pp == 1 else [(s, v) for s in SCHEDULES for v in (
                    (0,) if s in SINGLE else (2, 4) if s in LOOPED else (2,))]
                for mbs in _powers_of_two(min(per_rank, spec.max_mbs)):
                    if per_rank % mbs:
                        continue
                    grad_acc = per_rank // mbs
                    for zero, (recompute, offload), (schedule, v), ep, chunk in itertools.product(
                            (0, 1, 2, 3) if dp * cp > 1 else (0,), RECOMPUTE_OFFLOAD, schedules, eps, (0, LOSS_CHUNK)):
                        # the trainer's own rules: stages per rank, micro-batches, zero 3, recompute
                        if pipeline_problems(shape, pp=pp, schedule=schedule, virtual_stages=v,
                                             micro_batches=grad_acc, dp=dp * cp, zero=zero, recompute=recompute):
                            continue
                        yield Layout(dp=dp, zero=zero, tp=tp, sp=tp > 1, pp=pp, pp_schedule=schedule,
                                     pp_virtual_stages=v, cp=cp, ep=ep, micro_batch_size=mbs, grad_accum=grad_acc,
                                     seq_len=spec.seq_len, recompute=recompute, precision=spec.precision,
                                     loss_chunk=chunk, offload_activations=offload)


# The fields `enumerate_layouts` chooses; a fixed value of another is set on every layout it yields.
SEARCHED = ("dp", "zero", "tp", "pp", "pp_schedule", "pp_virtual_stages", "cp", "ep", "micro_batch_size", "grad_accum",
            "seq_len", "recompute", "precision", "loss_chunk", "offload_activations")
# recompute, or offload (which moves nothing under recompute: planning.memory), or neither; the loss's chunk
RECOMPUTE_OFFLOAD = (("none", False), ("none", True), ("selective", False), ("full", False))
LOSS_CHUNK = 1024


def constrained_layouts(spec: SearchSpec):
    """The layouts the search considers under `spec.fixed`: those it chooses with the fixed values,
    and the fixed values of the fields it never varies set (then checked by the trainer's rules again,
    and its limits: `rules.trainer_limits`)."""
    chosen = {k: v for k, v in spec.fixed.items() if k in SEARCHED}
    given = {k: v for k, v in spec.fixed.items() if k not in SEARCHED}
    for layout in enumerate_layouts(spec):
        if all(getattr(layout, k) == v for k, v in chosen.items()):
            layout = replace(layout, **given)
            if (not given or not check_layout(spec.shape, layout)) and not trainer_limits(layout):
                yield layout


def network_of(spec: SearchSpec) -> Network:
    """The links the spec's cluster has: a measured profile (`spec.network`) or the GPU's table figures."""
    if spec.network is not None:
        return spec.network
    acc = spec.accelerator
    return Network(spec.gpus_per_node, Link(acc.intra_node_busbw, acc.intra_node_latency),
                   Link(acc.inter_node_bw, acc.inter_node_latency))


def stage_imbalance(shape, layout: Layout) -> float:
    """The slowest pipeline rank's training FLOPs over the mean rank's (1 without pp): the pipeline
    runs at the slowest rank's pace, and the embedding / head stages are not the average ones."""
    if layout.pp == 1:
        return 1.0
    embedding, layer, head = stage_costs(shape, "flops", layout.seq_len)
    split = stage_split(shape, layout.pp, layout.pp_schedule, layout.pp_virtual_stages, layout.pp_balance,
                        layout.seq_len, layout.pp_split)
    costs = [n * layer for n in split]
    costs[0] += embedding
    costs[-1] += head
    per_rank = [0.0] * layout.pp
    for stage, rank in enumerate(stage_ranks(layout.pp_schedule, layout.pp, layout.pp_virtual_stages)):
        per_rank[rank] += costs[stage]
    return max(per_rank) / (sum(per_rank) / layout.pp)


def exposure(collectives: list[Collective], budgets: dict[str, float]) -> list[float]:
    """Seconds of each collective left on the critical path: those hidden by the same compute share
    its budget (`budgets[hidden_by]`, seconds); what exceeds it, and each one's unhidden part, shows."""
    exposed = [c.seconds for c in collectives]
    for kind, budget in budgets.items():
        group = [i for i, c in enumerate(collectives) if c.hidden_by == kind]
        total = sum(collectives[i].seconds for i in group)
        floor = sum(collectives[i].unhidden_s for i in group)
        left = max(floor, total - budget)
        for i in group:
            c = collectives[i]
            hideable = c.seconds - c.unhidden_s
            exposed[i] = c.unhidden_s + ((left - floor) * hideable / (total - floor) if total > floor else 0.0)
    return exposed


def estimate_step(spec: SearchSpec, layout: Layout, memory: MemoryBreakdown | None = None) -> Estimate:
    """Peak memory, step time, tokens/s/GPU and MFU of one layout under the cost model in the module
    docstring: the one function `plan estimate` prints and `plan search` ranks by."""
    shape, acc = spec.shape, spec.accelerator
    memory = memory or estimate_memory(shape, layout, spec.activation_model)
    peak = acc.flops[spec.precision]
    model_flops_per_token = flops_per_token_of(shape, layout.seq_len)
    hardware_factor = {"none": 1.0, "selective": 1.0 + SELECTIVE_RECOMPUTE_OVERHEAD, "full": 4 / 3}[
        layout.recompute]
    tokens = spec.global_batch_tokens
    efficiency = compute_efficiency(shape, layout, peak, acc.hbm_bw, spec.efficiency, acc.attention_table,
                                    bf16_peak=acc.flops.get("bf16"), attention_flops=acc.attention_flops)
    imbalance = stage_imbalance(shape, layout)
    # ranks sharing a CPU's cores each run at their share of them (1 on a GPU)
    share = acc.core_share(min(spec.n_gpus, spec.gpus_per_node))
    compute = share * tokens * model_flops_per_token * hardware_factor * imbalance / (spec.n_gpus * peak * efficiency)
    compute += share * tokens * loss_recompute_flops(shape, layout) / (spec.n_gpus * peak * efficiency)
    m = layout.grad_accum
    parts = elementwise_parts(shape, layout, memory)
    elementwise = share * m * kernel_seconds(parts, ("layer", "loss"), acc.hbm_bw, acc.kernels)
    optimizer = share * kernel_seconds(parts, ("optimizer",), acc.hbm_bw, acc.kernels)
    per_micro = compute / m

    collectives = step_collectives(shape, layout, memory, network_of(spec))
    attention_share = spec_of(shape).attention_flops_per_token(shape, layout.seq_len) / model_flops_per_token
    overlap = 0.0 if acc.comm_uses_cores else spec.overlap  # gloo's threads need the cores compute runs on
    budgets = {LAST_BACKWARD: overlap * per_micro * 2 / 3, COMPUTE: overlap * compute,
               ATTENTION: overlap * compute * attention_share}
    exposed = exposure(collectives, budgets)
    by_axis = {axis: sum(e for c, e in zip(collectives, exposed, strict=True) if c.axis == axis)
               for axis in ("tp", "cp", "ep", "pp")}
    # gathers that run inside each micro-batch stretch the pipelined part; the reductions come after it
    dp_inside = sum(e for c, e in zip(collectives, exposed, strict=True) if c.axis == "dp" and c.hidden_by == COMPUTE)
    dp_after = sum(e for c, e in zip(collectives, exposed, strict=True) if c.axis == "dp" and c.hidden_by != COMPUTE)
    dp_comm = sum(c.seconds for c in collectives if c.axis == "dp")
    # the schedule's published bubble (planning.pipeline.bubble_fraction; measured: docs/parallel.md)
    bubble_fraction = bubble_fraction_of(layout.pp_schedule, layout.pp, layout.pp_virtual_stages, m)
    offload, offload_exposed = offload_seconds(memory.host_activations, acc.host_bw, per_micro, m)
    pipelined = compute + elementwise + sum(by_axis.values()) + dp_inside + offload_exposed
    bubble = pipelined * bubble_fraction
    step = pipelined + bubble + dp_after + optimizer
    tokens_per_s_per_gpu = tokens / step / spec.n_gpus
    est = Estimate(layout, memory, compute, by_axis["tp"], by_axis["cp"], by_axis["pp"], bubble, dp_comm,
                   dp_inside + dp_after, step, tokens_per_s_per_gpu,
                   tokens_per_s_per_gpu * model_flops_per_token / peak,
                   ep_comm_s=by_axis["ep"], efficiency=efficiency, stage_imbalance=imbalance,
                   collectives=collectives, exposed=exposed, elementwise_s=elementwise, optimizer_s=optimizer,
                   core_share=share, measured_kernels=bool(acc.kernels), offload_s=offload,
                   offload_exposed_s=offload_exposed)
    est.reasons = reasons_for(spec, est, bubble_fraction)
    return est


def _complexity(layout: Layout) -> tuple:
    axes = (layout.tp > 1) + (layout.pp > 1) + (layout.cp > 1) + (layout.ep > 1)
    schedule = SCHEDULES.index(layout.pp_schedule) if layout.pp > 1 else 0
    return axes, layout.zero, ("none", "selective", "full").index(layout.recompute), layout.stages_per_rank, schedule


def search(spec: SearchSpec, top: int = 5) -> SearchResult:
    """All fitting layouts, fastest first, with a summary of what was considered and why."""
    problems = []
    seq = spec.seq_len
    if spec.global_batch_tokens % seq:
        problems.append(f"global batch of {spec.global_batch_tokens} tokens is not a multiple of the sequence "
                        f"length {seq}; try {spec.global_batch_tokens // seq * seq or seq}")
    if spec.n_gpus % spec.gpus_per_node and spec.n_gpus > spec.gpus_per_node:
        problems.append(f"{spec.n_gpus} GPUs is not a whole number of {spec.gpus_per_node}-GPU nodes")
    if spec.precision not in spec.accelerator.flops:
        problems.append(f"no {spec.precision} peak for {spec.accelerator.name}")
    if problems:
        raise UserError(problems)
    fitting, considered, too_big, closest, closest_with = _evaluate(spec)
    inside = considered  # layouts with every tensor-parallel group inside a node
    across = False
    if not fitting and spec.n_gpus > spec.gpus_per_node and "tp" not in spec.fixed:
        # nothing fits with tensor parallelism inside a node: try groups that span nodes (slow: the network)
        wide = replace(spec, max_tp=spec.n_gpus)
        fitting, more, more_big, wide_closest, wide_with = _evaluate(wide, lambda lay: lay.tp > spec.gpus_per_node)
        closest_with = {**wide_with, **{k: v for k, v in closest_with.items() if k not in wide_with
                                        or v[0] < wide_with[k][0]}}
        considered, too_big, across = considered + more, too_big + more_big, bool(fitting)
        if wide_closest and (closest is None or wide_closest[0] < closest[0]):
            closest = wide_closest
    fastest = max((e.tokens_per_s_per_gpu for e in fitting), default=1.0)
    # Within 0.5 % of each other the model cannot tell layouts apart: prefer fewer moving parts.
    fitting.sort(key=lambda e: (-math.floor(e.tokens_per_s_per_gpu / fastest * 200), _complexity(e.layout),
                                e.memory.peak_bytes))
    closest_est = estimate_step(spec, closest[1], closest[2]) if closest else None
    summary = _summary(spec, fitting, considered, too_big, closest_est)
    if across:
        cause = "memory forces" if inside else "the fixed fields force"
        summary.append(f"{cause} tensor parallelism across nodes: no layout with tp ≤ {spec.gpus_per_node} (one node) "
                       + (f"fits ({inside} tried)" if inside else "is left") + f", so tp={fitting[0].layout.tp} runs "
                       "its per-layer collectives over the network")
    else:
        # against the fastest layout that splits the work otherwise (not only another ZeRO stage)
        degrees = lambda lay: (lay.tp, lay.pp, lay.cp, lay.ep, lay.micro_batch_size, lay.recompute,  # noqa: E731
                               lay.pp_schedule, lay.stages_per_rank)
        other = next((e for e in fitting[1:] if degrees(e.layout) != degrees(fitting[0].layout)), None)
        if other is not None:
            summary.append(why_first(fitting[0], other))
    if fitting:
        summary += options_summary(spec, fitting, closest_with)
    return SearchResult(spec, fitting[:top] if top else fitting, considered, too_big, closest_est, summary)


def _evaluate(spec: SearchSpec, keep=None):
    """(fitting estimates, layouts considered, too big, the smallest peak among those too big, and among
    those too big that use each of `OPTIONS`)."""
    fitting: list[Estimate] = []
    considered = too_big = 0
    closest: tuple[float, Layout, MemoryBreakdown] | None = None
    closest_with: dict[str, tuple[float, Layout, MemoryBreakdown]] = {}
    for layout in constrained_layouts(spec):
        if keep is not None and not keep(layout):
            continue
        considered += 1
        memory = estimate_memory(spec.shape, layout, spec.activation_model)
        # the step's peak and the start's (from meta to the first step, fresh or from a checkpoint)
        if memory.fit_bytes > spec.usable_bytes or memory.host_activations > spec.accelerator.host_memory_bytes:
            too_big += 1
            if closest is None or memory.fit_bytes < closest[0]:
                closest = (memory.fit_bytes, layout, memory)
            # the nearest to fitting among those using each option: the least over the device's and the
            # host's limits, in bytes
            over = max(memory.fit_bytes - spec.usable_bytes, 0.0) + \
                max(memory.host_activations - spec.accelerator.host_memory_bytes, 0.0)
            for option in OPTIONS:
                if getattr(layout, option) and (option not in closest_with or over < closest_with[option][0]):
                    closest_with[option] = (over, layout, memory)
            continue
        fitting.append(estimate_step(spec, layout, memory))
    return fitting, considered, too_big, closest, closest_with


def _summary(spec: SearchSpec, fitting: list[Estimate], considered: int, too_big: int,
             closest: Estimate | None) -> list[str]:
    psi = count_params_of(spec.shape).total
    states = 16 * psi  # bf16 weights and grads, fp32 master and Adam moments
    lines = [f"{considered} layouts considered for {spec.n_gpus} × {spec.accelerator.name} "
             f"({spec.gpus_per_node} per node), {spec.global_batch_tokens:,} tokens per step at seq {spec.seq_len}"
             + "".join(f", {k}={v}" for k, v in spec.fixed.items()) + "; "
             f"{too_big} do not fit in {spec.usable_bytes / GiB:.1f} GiB usable, {len(fitting)} fit"]
    if fitting:
        best = fitting[0]
        lines.append(f"best: {best.layout.describe()} — {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                     f"MFU {best.mfu:.1%} (at an assumed matmul efficiency of {spec.efficiency:.0%})")
        return lines
    if not considered and spec.fixed:
        lines.append("nothing fits: no layout for these GPUs and this batch has " + ", ".join(
            f"{k}={v}" for k, v in spec.fixed.items()) + " under the trainer's rules")
        return lines
    if closest is not None and closest.memory.fit_moment != "step":
        # the closest layout needs more at its start than at its step (the module doc of planning.memory)
        mem = closest.memory
        lines.append(f"nothing fits: the closest, {closest.layout.describe()}, needs {mem.fit_description()}")
        if mem.fit_moment == "load":
            lines.append(f"a load reads each stored chunk its shard overlaps whole: a rank holding part of the "
                         f"{'×'.join(map(str, mem.extra['largest_stored_tensor']))} tensor reads "
                         f"{mem.start_load_transient / GiB:.1f} GiB however many GPUs share it; more GPUs do not "
                         "help, a checkpoint stored in smaller chunks (saved sharded) does")
        return lines
    min_gpus = math.ceil(states / spec.usable_bytes)
    lines.append(f"nothing fits: the model states alone are 16 bytes × {psi / 1e9:.1f}B params = "
                 f"{states / 1e9:,.0f} GB, {states / spec.n_gpus / GiB:.1f} GiB per GPU even fully sharded "
                 f"(ZeRO-3, TP or PP) over {spec.n_gpus} GPUs, before any activation")
    if closest is not None:
        lines.append(f"closest: {closest.layout.describe()} needs {closest.memory.fit_description()} "
                     f"(model states {closest.memory.static_bytes / GiB:.1f} GiB)")
    lines.append(f"the model states alone need at least {min_gpus} GPUs of this kind; with activations, "
                 f"buffers and {spec.headroom:.0%} headroom, {spec.n_gpus} are not enough — add nodes")
    return lines
