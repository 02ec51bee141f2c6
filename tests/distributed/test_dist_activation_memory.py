"""Activations under tensor and data parallelism, measured on 2 and 4 CPU processes and compared
with `plan memory` (`estimate_memory`): the bytes the trainer's second micro-batch leaves alive
after forward (`parallel.memory.LiveTensors`), on each rank, for the whole step and for one block.
Tensor parallel with and without sequence parallel, fp32 and bf16, selective recompute; FSDP2 (bf16
weights gathered, a bf16 residual stream) and DDP (autocast over fp32 weights). With sequence
parallel every tensor a block keeps is a sequence shard (the column-parallel matmuls' gathered
input too: `parallel.tensor.KeepSequenceShard`); without it the norms and the matmul inputs stay
whole, as docs/parallel.md lists."""

from __future__ import annotations

import json

import pytest
from dist_common import dist_base_fixture  # noqa: F401 (fixture)

from ultratron.config import load_config
from ultratron.planning.activations import per_op_layer_items
from ultratron.planning.memory import estimate_memory
from ultratron.simulate.run import planned_layout

SHAPE = ["--model.n_heads", "8", "--model.n_kv_heads", "4"]  # kv heads that 4 ranks can split
TP2, SP, BF16 = ["--parallel.tp", "2"], ["--parallel.sp", "true"], ["--training.precision", "bf16"]
MOE = ["--model.n_experts", "4", "--model.n_active_experts", "2", "--model.expert_ffn_dim", "64"]
LAYOUTS = {
    "dp2": ["--parallel.dp", "2"],  # one process's activations per rank
    "tp2": TP2,
    "tp2-sp": TP2 + SP,
    "tp2-sp-bf16": TP2 + SP + BF16,
    "tp2-sp-bf16-selective": TP2 + SP + BF16 + ["--training.recompute", "selective"],
    "dp2-zero2-bf16": ["--parallel.dp", "2", "--parallel.zero", "2"] + BF16,
    "dp2-bf16": ["--parallel.dp", "2"] + BF16,
    "tp2-sp-moe": TP2 + SP + MOE,
}
LAYOUTS_4 = {"tp4": ["--parallel.tp", "4"], "tp4-sp": ["--parallel.tp", "4"] + SP}


def _measure(world: int, layouts: dict, dist_base, out) -> list[dict]:
    from dist_jobs import measure_step_memory

    from ultratron.launch.local import run_local

    run_local(world, measure_step_memory, dist_base + SHAPE, list(layouts.values()), str(out))
    return [dict(zip(layouts, json.loads((out / f"rank{r}.json").read_text()), strict=True)) for r in range(world)]


@pytest.fixture(scope="module")
def measured(dist_base, tmp_path_factory):
    two = _measure(2, LAYOUTS, dist_base, tmp_path_factory.mktemp("step-memory"))
    four = _measure(4, LAYOUTS_4, dist_base, tmp_path_factory.mktemp("step-memory-4"))
    return [two[r] | four[r] for r in range(2)] + four[2:]


def _layout(dist_base, flags) -> tuple:
    cfg = load_config(None, dist_base + SHAPE + flags)
    return cfg.model, planned_layout(cfg)  # as a CPU runs it: bf16 attention in fp32


@pytest.mark.parametrize("name", LAYOUTS | LAYOUTS_4)
def test_activations_after_forward_match_the_plan(measured, dist_base, name):
    shape, layout = _layout(dist_base, (LAYOUTS | LAYOUTS_4)[name])
    planned = estimate_memory(shape, layout)
    # measured here: within 2.1% (tp4-sp is 2.0% above the plan: 18 KB outside the blocks that
    # the planner does not place); 3% for that margin
    for rank in range(layout.tp * layout.dp):
        assert measured[rank][name]["step"] == pytest.approx(planned.activations + planned.loss_logits,
                                                             rel=0.03), rank


@pytest.mark.parametrize("tp", [2, 4])
def test_with_sequence_parallel_a_layer_keeps_one_tpth_of_one_process(measured, tp):
    # Every tensor a block keeps is split over the tp ranks except RoPE's two rotation tables
    # (2·4·seq·head_dim bytes: 1.5% of a block at tp4 here); 3% leaves room for that and no more.
    # Without KeepSequenceShard the gathered matmul inputs alone add 1/tp − 1/tp² of the block's
    # share of them (12% at tp2 here).
    one_process = measured[0]["dp2"]["layer"]
    for rank in range(tp):
        assert measured[rank][f"tp{tp}-sp"]["layer"] == pytest.approx(one_process / tp, rel=0.03), rank


@pytest.mark.parametrize("tp", [2, 4])
def test_without_sequence_parallel_the_norms_and_matmul_inputs_stay_whole(measured, dist_base, tp):
    """What docs/parallel.md lists as kept whole without sequence parallel (the two norms, the
    column-parallel matmuls' input, RoPE's tables) is what a layer keeps beyond one process's / tp."""
    shape, layout = _layout(dist_base, LAYOUTS["dp2"])
    items = per_op_layer_items(shape, layout)
    whole = items["norms"] + items["matmul inputs"] + items["rope tables"]
    one_process = measured[0]["dp2"]["layer"]
    assert one_process == sum(items.values())  # fp32: every byte is counted (measured exactly here)
    for rank in range(tp):
        beyond = measured[rank][f"tp{tp}"]["layer"] - one_process / tp
        # exact here; 1% for a summation of another torch version's temporaries
        assert beyond == pytest.approx(whole * (1 - 1 / tp), rel=0.01), rank


def test_a_mixture_of_experts_layer_keeps_its_gathered_input_as_a_shard(measured, dist_base):
    """Under sequence parallel a MoE layer's input is all-gathered (its router and experts see every
    token); the router's matmul keeps it as the rank's shard (`KeepSequenceShard`), as the planner
    counts. The rest of what docs/parallel.md lists as whole (the routed slots, the router's state)
    the planner counts whole."""
    shape, layout = _layout(dist_base, LAYOUTS["tp2-sp-moe"])
    planned = sum(per_op_layer_items(shape, layout).values())
    # measured here: equal to the plan to the byte; keeping the whole gathered input (torch's
    # PrepareModuleInputOutput alone) measured 96 KiB (3.6%) above it; 1% catches that
    for rank in range(2):
        assert measured[rank]["tp2-sp-moe"]["layer"] == pytest.approx(planned, rel=0.01), rank
