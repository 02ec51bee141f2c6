"""Communication of one training step, collective by collective, by the rules the trainer follows.

`step_collectives` lists what one rank (the heaviest pipeline rank, the one `plan memory` prices)
issues per optimizer step: which axis, which operation, the bytes of one call, how many calls,
the group's size, whether the group spans nodes, its time, and what compute can hide it. The
rules are those of `parallel/` (each module's docstring says them):

  tp   DTensor tensor parallelism; with sequence parallelism 2 all-gathers and 2 reduce-scatters of
       the (p·T·h) activations per layer forward, the same backward (the gradient of an all-gather is
       a reduce-scatter and back); without it 2 all-reduces forward and 2 backward; full recompute
       runs the forward's again. On the critical path (no async TP in the trainer).
  cp   ring attention (`parallel/context.py`): forward passes the K/V block (p·T·2·kv/t) round the
       ring in cp−1 hops; backward passes the blocks again with their gradient accumulators (twice
       the bytes) and a last hop of the gradients home. Each hop overlaps the attention on the block
       already held.
  ep   a mixture of experts' all-to-all: dispatch and combine of the rank's k·T slots (p·h each) per
       MoE layer, forward and backward (and forward again under full recompute). On the critical path.
  pp   torch's pipeline stages send a micro-batch's activations (p·T·h, /t under sp) to the next
       stage and its gradients back, once per stage boundary that leaves the rank. On the critical
       path; each transfer also lengthens the fill and drain (the bubble).
  dp   by the wrapper the trainer picks (`rules.data_parallel_wrapper`), gradients reduced in fp32
       (DDP's fp32 weights; FSDP2's `MixedPrecisionPolicy(reduce_dtype=float32)`) on the last
       micro-batch only (`no_sync` / `set_requires_gradient_sync`):
       ddp        all-reduce in 25 MB buckets during the last backward: all but the last bucket hide
                  behind it; ZeRO-1 then broadcasts each rank's updated fp32 share (exposed)
       replicate  (zero 0 under pp) one all-reduce after the schedule: exposed
       fsdp       parameters all-gathered (in the compute dtype) per block and micro-batch, for
                  forward, and again for backward under ZeRO-3, prefetched one block ahead (the first
                  block's gather is exposed); gradients reduce-scattered on the last micro-batch,
                  hidden behind its backward except the last block's (under pp: after the schedule,
                  exposed), and under ZeRO-3 on every micro-batch, each behind its own backward but
                  its last block's; HSDP then all-reduces the shard across the replicas.

Time of one call, `bytes × factor / bandwidth + latency`, with NCCL's bus-bandwidth factors (NCCL
tests' PERFORMANCE.md): all-reduce 2(n−1)/n, all-gather, reduce-scatter and all-to-all (n−1)/n,
broadcast and point-to-point 1. `bytes` is the whole tensor (the gathered output, the scattered
input), as NCCL tests count it. A group whose ranks lie on more than one node runs at the
network's pace (its slowest link); within a node at NVLink's. Ranks are numbered tp fastest, then
cp, dp, pp (`parallel/dims.py`), so a group of n ranks spaced `stride` apart spans
(n−1)·stride + 1 consecutive ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ultratron.planning.experts import is_moe, moe_layer_share
from ultratron.planning.rules import field_of, reduces_every_micro_batch

BUCKET_BYTES = 25e6  # DDP's default bucket_cap_mb (torch.nn.parallel.DistributedDataParallel)

BUS_FACTORS = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}
OPS = tuple(BUS_FACTORS)

# What compute a collective can hide behind (`exposure` in planning/search.py prices each):
EXPOSED = ""  # nothing: on the critical path
LAST_BACKWARD = "last backward"  # the last micro-batch's backward (gradient reduction)
COMPUTE = "compute"  # every micro-batch's forward and backward (FSDP's prefetched gathers)
ATTENTION = "attention"  # the attention of the block already held (ring attention)


@dataclass(frozen=True)
class Link:
    """One kind of link: bus bandwidth per GPU (bytes/s) and the latency of one collective (s)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Network:
    """The links a step runs on: inside a node (NVLink) and between nodes (the network), optionally
    per operation (what `ultratron bench comm` measured; else the link's figure for every operation)."""

    gpus_per_node: int
    intra: Link
    inter: Link
    intra_ops: dict = field(default_factory=dict)  # op → Link, measured
    inter_ops: dict = field(default_factory=dict)

    def spans_nodes(self, group: int, stride: int) -> bool:
        return group > 1 and (group - 1) * stride + 1 > self.gpus_per_node

    def link(self, op: str, group: int, stride: int) -> Link:
        if self.spans_nodes(group, stride):
            return self.inter_ops.get(op, self.inter)
        return self.intra_ops.get(op, self.intra)

    def seconds(self, op: str, nbytes: float, group: int, stride: int) -> float:
        """One call of `op` on `nbytes` over a group of `group` ranks `stride` apart."""
        if group <= 1:
            return 0.0
        link = self.link(op, group, stride)
        return nbytes * BUS_FACTORS[op](group) / link.bandwidth + link.latency


@dataclass(frozen=True)
class Collective:
    axis: str  # tp, cp, ep, pp, dp
    op: str  # one of OPS
    what: str  # in words: "activations all-gathered per layer, forward and backward"
    nbytes: float  # one call
    calls: float  # per optimizer step on this rank
    group: int
    stride: int
    spans_nodes: bool
    seconds: float  # all calls together
    hidden_by: str = EXPOSED
    unhidden_s: float = 0.0  # the part no overlap can hide (FSDP's first gather, DDP's last bucket)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _collective(net: Network, axis: str, op: str, what: str, nbytes: float, calls: float, group: int, stride: int,
                hidden_by: str = EXPOSED, unhidden_calls: float = 0.0) -> Collective:
    one = net.seconds(op, nbytes, group, stride)
    return Collective(axis, op, what, nbytes, calls, group, stride, net.spans_nodes(group, stride), calls * one,
                      hidden_by, unhidden_calls * one)


def _head_dim(shape) -> int:
    return field_of(shape, "head_dim") or shape.dim // shape.n_heads


def step_collectives(shape, layout, memory, net: Network) -> list[Collective]:
    """Every collective one rank issues per optimizer step (module docstring); `memory` is the
    rank's `MemoryBreakdown` (its layers and parameters)."""
    out: list[Collective] = []
    m = layout.grad_accum
    t, cp, dp = layout.tp, layout.cp, layout.dp
    p = layout.compute_bytes
    h = shape.dim
    tokens = layout.micro_batch_size * layout.seq_len / cp  # a micro-batch's tokens on this rank
    layers = memory.extra["layers_on_stage"]
    forwards = 2 if layout.recompute == "full" else 1  # full recompute runs each forward twice
    activation = p * tokens * h
    if t > 1:
        # per layer (counted against `ultratron simulate`'s record): the forward's 2 gathers or
        # reductions and their gradients' 2 in backward; under sp backward gathers the two kept shards
        # again (`parallel.tensor.KeepSequenceShard`) or recompute runs those gathers again, and
        # recompute reruns the first of the block's two reductions (the second's output is not needed:
        # the recomputation stops before it), except a reduce-scatter under selective recompute, which
        # keeps its output. The ends: the embedding's output reduced (sp: scattered,
        # and its gradient gathered) on the first stage; the head's input gathered, its gradient
        # reduced and under sp gathered again in backward on the last.
        again = layout.recompute != "none"
        first, last = memory.extra["first"], memory.extra["last"]
        if layout.sp:
            out.append(_collective(net, "tp", "all-gather", "activations per layer (2 forward, 2 backward, 2 again: "
                                   + ("recomputed" if again else "the kept shards") + ") and at the ends",
                                   activation, m * (layers * 6 + first + 2 * last), t, 1))
            # selective recompute keeps the reduce-scatters' outputs (parallel/recompute.py): only full reruns one
            rerun = layout.recompute == "full"
            out.append(_collective(net, "tp", "reduce-scatter", "activations per layer (2 forward, 2 backward"
                                   + (", 1 recomputed" if rerun else "") + ") and at the ends", activation,
                                   m * (layers * (4 + rerun) + first + last), t, 1))
        else:
            out.append(_collective(net, "tp", "all-reduce", "activations per layer (2 forward, 2 backward"
                                   + (", 1 recomputed" if again else "") + ") and at the ends", activation,
                                   m * (layers * (4 + again) + first + last), t, 1))
    if cp > 1:
        block = p * tokens * 2 * shape.n_kv_heads * _head_dim(shape) / t
        hops = layers * (cp - 1)
        out.append(_collective(net, "cp", "p2p", "K/V blocks round the ring, forward", block, m * hops * forwards,
                               2, t, ATTENTION))
        out.append(_collective(net, "cp", "p2p", "K/V blocks with their gradients, backward", 2 * block, m * hops,
                               2, t, ATTENTION))
        out.append(_collective(net, "cp", "p2p", "K/V gradients home, backward", block, m * layers, 2, t,
                               ATTENTION))
    if is_moe(shape) and layout.ep > 1:
        slots = tokens * field_of(shape, "n_active_experts")
        calls = m * layers * moe_layer_share(shape) * 2 * (forwards + 1)
        out.append(_collective(net, "ep", "all-to-all", "routed tokens, dispatch and combine, forward and backward",
                               p * slots * h, calls, layout.ep, t * cp))
    if layout.pp > 1:
        from ultratron.planning.pipeline import stage_ranks

        ranks = stage_ranks(layout.pp_schedule, layout.pp, layout.pp_virtual_stages)
        rank, stages = memory.extra["pp_rank"], memory.extra["stages"]
        sends = sum((s + 1 < len(ranks) and ranks[s + 1] != rank) + (s > 0 and ranks[s - 1] != rank) for s in stages)
        out.append(_collective(net, "pp", "p2p", "activations to the next stage, gradients to the previous",
                               activation / (t if layout.sp else 1), m * sends, 2, t * cp * dp))
    out += _data_parallel(shape, layout, memory, net)
    return out


def _data_parallel(shape, layout, memory, net: Network) -> list[Collective]:
    group = layout.data_parallel
    if group <= 1:
        return []
    wrapper = layout.wrapper
    t, m = layout.tp, layout.grad_accum
    experts = memory.extra.get("expert_params_on_gpu", 0.0)
    params = memory.extra["params_on_gpu"] - experts
    layers = max(memory.extra["layers_on_stage"], 1)
    grads = 4 * params  # reduced in fp32 (module docstring)
    out: list[Collective] = []
    if wrapper == "ddp":
        buckets = max(1, math.ceil(grads / BUCKET_BYTES))
        out.append(_collective(net, "dp", "all-reduce", f"fp32 gradients in {buckets} buckets of 25 MB, last backward",
                               grads / buckets, buckets, group, t, LAST_BACKWARD, 1))
        if layout.zero == 1:
            out.append(_collective(net, "dp", "broadcast", "ZeRO-1: each rank's updated fp32 share after the step",
                                   4 * params / group, group, group, t))
    elif wrapper == "replicate":
        out.append(_collective(net, "dp", "all-reduce", "fp32 gradients after the pipeline schedule", grads, 1,
                               group, t))
    else:  # fsdp
        shard = layout.shard_group
        replicas = group // shard
        gathers = 2 if layout.zero == 3 else 1
        block = layout.gathered_bytes * params / layers
        out.append(_collective(net, "dp", "all-gather", "parameters per block, forward" +
                               (" and backward (ZeRO-3)" if gathers == 2 else ""), block,
                               m * layers * gathers, shard, t, COMPUTE, m))
        reductions = m if reduces_every_micro_batch(layout) else 1  # (each behind its micro-batch's backward)
        when, hidden_by, unhidden = ("every backward (ZeRO-3)", COMPUTE, m) if reductions > 1 else \
            ("after the pipeline schedule", EXPOSED, 0) if layout.pp > 1 else ("last backward", LAST_BACKWARD, 1)
        out.append(_collective(net, "dp", "reduce-scatter", f"fp32 gradients per block, {when}", grads / layers,
                               reductions * layers, shard, t, hidden_by, unhidden))
        if replicas > 1:
            out.append(_collective(net, "dp", "all-reduce", "HSDP: the gradient shard across replicas", grads / shard,
                                   reductions, replicas, t * shard))
    if experts:  # split experts stay on their ranks: their gradients are all-reduced over the others holding them
        holders = max(group // layout.ep, 1)
        out.append(_collective(net, "dp", "all-reduce", "expert gradients over the ranks holding the same experts",
                               4 * experts, 1, holders, t * layout.cp * layout.ep, LAST_BACKWARD))
    return out
