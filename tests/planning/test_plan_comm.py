"""The collectives a step issues (`planning.comm`) and the step time built from them
(`planning.search.estimate_step`), each term against a hand computation."""

import pytest

from ultratron.models.presets import PRESETS
from ultratron.planning.comm import COMPUTE, LAST_BACKWARD, Collective, Link, Network, step_collectives
from ultratron.planning.hardware import get_accelerator
from ultratron.planning.layout import Layout
from ultratron.planning.memory import estimate_memory
from ultratron.planning.params import count_params_of
from ultratron.planning.pipeline import stage_costs
from ultratron.planning.search import SearchSpec, estimate_step, exposure, network_of, stage_imbalance

H100 = get_accelerator("h100-sxm")
NET = Network(8, Link(450e9, 10e-6), Link(50e9, 30e-6))
SHAPE = PRESETS["llama3-8b"]  # 32 layers, dim 4096, 32 heads, 8 kv heads
GB = 1e9


def collectives(layout: Layout, shape=SHAPE, net=NET) -> list[Collective]:
    return step_collectives(shape, layout, estimate_memory(shape, layout), net)


def only(items: list[Collective], axis: str, op: str) -> Collective:
    found = [c for c in items if c.axis == axis and c.op == op]
    assert len(found) == 1, found
    return found[0]


def test_bus_factors_and_links_by_hand():
    # NCCL tests' bus bandwidth: all-reduce 2(n−1)/n, all-gather / reduce-scatter (n−1)/n, p2p 1
    assert NET.seconds("all-reduce", GB, 8, 1) == pytest.approx(GB * 2 * 7 / 8 / 450e9 + 10e-6)
    assert NET.seconds("all-gather", GB, 4, 1) == pytest.approx(GB * 3 / 4 / 450e9 + 10e-6)
    assert NET.seconds("reduce-scatter", GB, 4, 2) == pytest.approx(GB * 3 / 4 / 450e9 + 10e-6)
    assert NET.seconds("p2p", GB, 2, 8) == pytest.approx(GB / 50e9 + 30e-6)  # ranks 0 and 8: two nodes
    assert NET.seconds("all-reduce", GB, 1, 1) == 0.0
    # a group of n ranks `stride` apart covers (n−1)·stride + 1 ranks; beyond 8 it crosses nodes
    assert not NET.spans_nodes(8, 1) and NET.spans_nodes(16, 1) and NET.spans_nodes(2, 8)
    assert not NET.spans_nodes(2, 4) and NET.spans_nodes(4, 4)
    # the slowest link sets the pace: a 16-rank group runs at the network's bandwidth
    assert NET.seconds("all-gather", GB, 16, 1) == pytest.approx(GB * 15 / 16 / 50e9 + 30e-6)


def test_tensor_parallel_collectives_by_hand():
    lay = Layout(tp=8, sp=True, micro_batch_size=2, grad_accum=4, seq_len=4096)
    found = collectives(lay)
    activation = 2 * 2 * 4096 * 4096  # bf16 × mbs × seq × dim
    # per layer 2 forward + 2 backward, and 2 more gathers (backward gathers the kept shards again),
    # 32 layers, 4 micro-batches; one rank holds both ends: 1 + 2 gathers, 1 + 1 reductions
    for op, calls in (("all-gather", (6 * 32 + 3) * 4), ("reduce-scatter", (4 * 32 + 2) * 4)):
        c = only(found, "tp", op)
        assert c.nbytes == activation and c.group == 8 and not c.spans_nodes
        assert c.calls == calls
        assert c.seconds == pytest.approx(c.calls * (activation * 7 / 8 / 450e9 + 10e-6))
        assert c.hidden_by == ""  # on the critical path
    # recompute: the gathers run again in its forward instead; the first reduction too
    full = collectives(Layout(tp=8, sp=True, micro_batch_size=2, grad_accum=4, seq_len=4096, recompute="full"))
    assert only(full, "tp", "all-gather").calls == (6 * 32 + 3) * 4
    assert only(full, "tp", "reduce-scatter").calls == (5 * 32 + 2) * 4
    plain = only(collectives(Layout(tp=4, micro_batch_size=2, grad_accum=4, seq_len=4096)), "tp", "all-reduce")
    assert plain.calls == (4 * 32 + 2) * 4
    assert plain.seconds == pytest.approx(plain.calls * (activation * 2 * 3 / 4 / 450e9 + 10e-6))
    # under pp the ends are the first and last stages': a middle stage has none
    from ultratron.planning.memory import estimate_memory_per_rank

    piped = Layout(tp=8, sp=True, pp=4, micro_batch_size=2, grad_accum=4, seq_len=4096)
    stages = {m.stage: m for m in estimate_memory_per_rank(SHAPE, piped)}
    for stage, ends in (("first", 1), ("middle", 0), ("last", 2)):
        memory = stages[stage]
        gathers = only(step_collectives(SHAPE, piped, memory, NET), "tp", "all-gather")
        assert gathers.calls == (6 * memory.extra["layers_on_stage"] + ends) * 4, stage
    # tp=8 on nodes of 4 GPUs spans two nodes: the network's bandwidth and latency
    wide = only(collectives(lay, net=Network(4, NET.intra, NET.inter)), "tp", "all-gather")
    assert wide.spans_nodes and wide.seconds == pytest.approx(wide.calls * (activation * 7 / 8 / 50e9 + 30e-6))


def test_pipeline_context_and_expert_transfers_by_hand():
    lay = Layout(dp=2, tp=2, sp=True, pp=4, grad_accum=8, micro_batch_size=1, seq_len=4096)
    p2p = only(collectives(lay), "pp", "p2p")
    # the heaviest rank: a middle or end stage; one stage per rank, so 1 or 2 boundaries leave it
    memory = estimate_memory(SHAPE, lay)
    boundaries = 2 if memory.stage == "middle" else 1
    assert p2p.calls == 8 * boundaries and p2p.nbytes == 2 * 4096 * 4096 / 2  # sequence-sharded under sp
    assert p2p.stride == 4 and not p2p.spans_nodes  # stages are tp·cp·dp = 4 ranks apart: same node
    assert p2p.seconds == pytest.approx(p2p.calls * (p2p.nbytes / 450e9 + 10e-6))
    far = only(collectives(Layout(dp=8, pp=2, grad_accum=8, seq_len=4096)), "pp", "p2p")
    assert far.spans_nodes and far.stride == 8

    ring = [c for c in collectives(Layout(cp=4, grad_accum=2, seq_len=8192)) if c.axis == "cp"]
    block = 2 * 8192 / 4 * 2 * 8 * 128  # bf16 × local tokens × (K and V) × kv heads × head dim
    assert [(c.nbytes, c.calls) for c in ring] == [(block, 2 * 32 * 3), (2 * block, 2 * 32 * 3), (block, 2 * 32)]
    assert all(c.hidden_by == "attention" for c in ring)

    mixtral = PRESETS["mixtral-8x7b"]
    a2a = only(collectives(Layout(dp=8, ep=8, zero=3, grad_accum=2, seq_len=4096), shape=mixtral), "ep", "all-to-all")
    assert a2a.nbytes == 2 * 4096 * 2 * 4096 and a2a.calls == 2 * 32 * 4 and a2a.group == 8
    assert a2a.seconds == pytest.approx(a2a.calls * (a2a.nbytes * 7 / 8 / 450e9 + 10e-6))


def test_data_parallel_by_wrapper_by_hand():
    psi = count_params_of(SHAPE).total
    ddp = collectives(Layout(dp=8, grad_accum=4, seq_len=4096))
    assert [c.op for c in ddp] == ["all-reduce"]
    assert ddp[0].nbytes * ddp[0].calls == pytest.approx(4 * psi) and ddp[0].hidden_by == LAST_BACKWARD
    assert ddp[0].unhidden_s == pytest.approx(ddp[0].seconds / ddp[0].calls)  # the last bucket
    zero3 = collectives(Layout(dp=16, zero=3, grad_accum=4, seq_len=4096))  # 16 ranks: two nodes
    gather, scatter = only(zero3, "dp", "all-gather"), only(zero3, "dp", "reduce-scatter")
    assert gather.calls == 4 * 32 * 2 and gather.hidden_by == COMPUTE and gather.spans_nodes
    assert gather.nbytes == pytest.approx(2 * psi / 32)  # bf16 parameters, a block's share
    assert gather.unhidden_s == pytest.approx(4 * gather.seconds / gather.calls)  # first block of each micro-batch
    # ZeRO-3 reduce-scatters every micro-batch's gradients, each behind its own backward but its last block's
    assert scatter.calls == 4 * 32 and scatter.nbytes == pytest.approx(4 * psi / 32) and scatter.hidden_by == COMPUTE
    assert scatter.seconds == pytest.approx(4 * 32 * (4 * psi / 32 * 15 / 16 / 50e9 + 30e-6))
    assert scatter.unhidden_s == pytest.approx(4 * scatter.seconds / scatter.calls)
    zero2 = only(collectives(Layout(dp=16, zero=2, grad_accum=4, seq_len=4096)), "dp", "reduce-scatter")
    assert zero2.calls == 32 and zero2.hidden_by == LAST_BACKWARD  # ZeRO-2: the last micro-batch's only
    hsdp = collectives(Layout(dp=16, dp_replicate=2, zero=3, grad_accum=4, seq_len=4096))
    across = only(hsdp, "dp", "all-reduce")
    assert across.group == 2 and across.nbytes == pytest.approx(4 * psi / 8) and across.spans_nodes
    assert across.calls == 4
    piped = collectives(Layout(dp=2, pp=2, grad_accum=4, seq_len=4096))  # zero 0 under pp: FSDP2's replicate
    assert only(piped, "dp", "all-reduce").hidden_by == ""  # reduced after the schedule


def test_exposure_shares_a_budget_and_keeps_the_unhidden_part():
    a = Collective("dp", "all-gather", "", 1, 1, 2, 1, False, 3.0, COMPUTE, 0.5)
    b = Collective("dp", "all-gather", "", 1, 1, 2, 1, False, 1.0, COMPUTE, 0.0)
    c = Collective("tp", "all-gather", "", 1, 1, 2, 1, False, 2.0)
    # 4 s to hide behind 3 s of compute: 1 s shows; at least a's 0.5 s; the rest split by what each could hide
    assert exposure([a, b, c], {COMPUTE: 3.0}) == pytest.approx([0.5 + 0.5 * 2.5 / 3.5, 0.5 * 1 / 3.5, 2.0])
    assert exposure([a, b, c], {COMPUTE: 10.0}) == pytest.approx([0.5, 0.0, 2.0])


def test_stage_imbalance_and_the_step_by_hand():
    lay = Layout(dp=2, pp=4, grad_accum=16, seq_len=4096)
    embedding, layer, head = stage_costs(SHAPE, "flops", 4096)
    split = estimate_memory(SHAPE, lay).extra["layers_per_stage"]  # (the heaviest rank's own stages)
    assert split and embedding == 0
    # llama3-8b: 32 layers on 4 stages, the head (6·v·h) on the last: the split is 9,8,8,7 or like it;
    # the imbalance is the slowest stage's cost over the mean
    from ultratron.planning.pipeline import stage_split

    costs = [n * layer for n in stage_split(SHAPE, 4, seq=4096)]
    costs[-1] += head
    assert stage_imbalance(SHAPE, lay) == pytest.approx(max(costs) / (sum(costs) / 4))
    assert stage_imbalance(SHAPE, Layout(dp=8, seq_len=4096)) == 1.0

    spec = SearchSpec(SHAPE, H100, 8, 8, 2 * 16 * 4096, 4096)
    est = estimate_step(spec, lay)
    exposed = dict.fromkeys(("tp", "cp", "ep", "pp", "inside", "after"), 0.0)
    for c, e in zip(est.collectives, est.exposed, strict=True):
        exposed["inside" if c.hidden_by == COMPUTE else "after" if c.axis == "dp" else c.axis] += e
    pipelined = (est.compute_s + est.elementwise_s + exposed["tp"] + exposed["cp"] + exposed["ep"] + exposed["pp"]
                 + exposed["inside"])
    assert est.bubble_s == pytest.approx(pipelined * 3 / 16)  # 1F1B: (p−1)/m
    assert est.step_s == pytest.approx(pipelined + est.bubble_s + exposed["after"] + est.optimizer_s)
    assert est.pp_comm_s == pytest.approx(exposed["pp"]) and exposed["pp"] > 0
    # no profile: the GPU's table figures, NVLink at the 360 GB/s NCCL reaches (0.8 of the datasheet's 450)
    assert network_of(spec) == Network(8, Link(360e9, 10e-6), Link(50e9, 30e-6))


def test_interleaving_sends_at_every_stage_boundary_of_the_rank():
    lay = Layout(dp=2, pp=4, pp_schedule="interleaved-1f1b", pp_virtual_stages=2, grad_accum=8, seq_len=4096)
    stages = estimate_memory(SHAPE, lay).extra["stages"]  # rank r runs stages r and r + 4 of 0..7
    rank = stages[0]
    assert stages == [rank, rank + 4]
    # a boundary to a neighbouring stage on another rank: stage s talks to s − 1 and s + 1 when they exist
    by_hand = sum((s > 0) + (s < 7) for s in stages)
    assert only(collectives(lay), "pp", "p2p").calls == 8 * by_hand
    assert by_hand >= 3  # against 1 or 2 for one stage per rank: interleaving's extra transfers
