"""The planner for a mixture of experts and for context parallelism: expert parameters split over
ep (left out of ZeRO, as the trainer does), the all-to-all in memory and step time, FLOPs and MFU on
active parameters, ep and cp in `plan search`. (Activations measured on the real model:
test_plan_measured.py.)"""

import dataclasses

import pytest

from ultratron.errors import UserError
from ultratron.models.presets import PRESETS
from ultratron.planning.flops import flops_per_token_of
from ultratron.planning.hardware import get_accelerator
from ultratron.planning.layout import Layout
from ultratron.planning.memory import GiB, estimate_memory, estimate_memory_per_rank, pipeline_ranks
from ultratron.planning.params import count_params_of
from ultratron.planning.search import SearchSpec, enumerate_layouts, estimate_step

MIXTRAL = PRESETS["mixtral-8x7b"]


def test_experts_split_over_ep_and_the_rest_over_zero():
    counts = count_params_of(MIXTRAL)
    experts = counts.routed_experts * counts.n_moe_layers
    for ep in (2, 8):
        mem = estimate_memory(MIXTRAL, Layout(dp=16, ep=ep, zero=3, seq_len=4096))
        assert mem.extra["expert_params_on_gpu"] == pytest.approx(experts / ep)
        # FSDP2 keeps sharded fp32 weights (4 bytes / 16 ranks); the split experts their own fp32 weights whole
        assert mem.parameters == pytest.approx(4 * (experts / ep + (counts.total - experts) / 16))
        assert mem.optimizer_states == pytest.approx(8 * (experts / ep + (counts.total - experts) / 16))
    dense_path = estimate_memory(MIXTRAL, Layout(dp=16, zero=3, seq_len=4096))  # ep 1: FSDP shards the experts too
    assert dense_path.extra["expert_params_on_gpu"] == 0
    assert dense_path.parameters == pytest.approx(4 * counts.total / 16)


def test_each_pipeline_rank_is_priced_with_its_own_moe_layers():
    """DeepSeek-V3's 3 dense first layers all sit on the first stage, so it holds fewer MoE layers than a
    middle stage of as many layers: its split experts are its own MoE layers' (found by ultratron simulate,
    docs/simulate.md, where the model's average layer overpriced the first stage by 30%)."""
    shape = PRESETS["deepseek-v3-like"]
    layout = Layout(dp=8, pp=8, ep=8, zero=1, seq_len=4096, micro_batch_size=1, grad_accum=16, precision="bf16")
    ranks, mems = pipeline_ranks(shape, layout), estimate_memory_per_rank(shape, layout)
    per_layer = count_params_of(shape).routed_experts / layout.ep
    assert ranks[0].dense_layers == 3 and all(r.dense_layers == 0 for r in ranks[1:])
    for where, mem in zip(ranks, mems, strict=True):
        assert mem.extra["expert_params_on_gpu"] == pytest.approx((sum(where.layers) - where.dense_layers) * per_layer)
    assert ranks[0].layers == ranks[1].layers and mems[0].activations < mems[1].activations


def test_all_to_all_buffers_appear_with_ep_only():
    base = Layout(dp=8, zero=2, seq_len=4096, micro_batch_size=1)  # FSDP2 either way (zero 1 under ep is FSDP too)
    assert estimate_memory(MIXTRAL, base).extra["all_to_all_bytes"] == 0
    ep = estimate_memory(MIXTRAL, dataclasses.replace(base, ep=8))
    assert ep.extra["all_to_all_bytes"] == 2 * 2 * 4096 * 2 * 4096  # send + receive of k·T slots, bf16
    assert ep.comm_buffers == estimate_memory(MIXTRAL, base).comm_buffers + ep.extra["all_to_all_bytes"]


def test_moe_activations_exceed_a_dense_layer_of_the_expert_width_by_the_routed_slots():
    dense = dataclasses.replace(MIXTRAL, n_experts=0, n_active_experts=0)
    # bf16 as FSDP2 runs it: no autocast copies per matmul
    layout = Layout(dp=2, zero=3, seq_len=4096, micro_batch_size=1)
    extra = estimate_memory(MIXTRAL, layout).activations - estimate_memory(dense, layout).activations
    # two slots per token: the SwiGLU of each (4·p·T·f) twice instead of once, plus router and slot bookkeeping
    swiglu = 4 * 2 * 4096 * MIXTRAL.ffn_dim * MIXTRAL.n_layers
    assert swiglu < extra < 1.5 * swiglu


def test_bad_moe_layouts_are_refused():
    with pytest.raises(UserError) as info:
        estimate_memory(MIXTRAL, Layout(dp=6, ep=3, seq_len=4096))
    assert "ep=3 does not divide n_experts=8" in str(info.value)
    with pytest.raises(UserError) as info:
        estimate_memory(PRESETS["llama3-8b"], Layout(dp=2, ep=2, seq_len=4096))
    assert "needs a mixture-of-experts model" in str(info.value)
    with pytest.raises(UserError) as info:
        estimate_memory(MIXTRAL, Layout(dp=2, ep=4, seq_len=4096))
    assert "ep=4 does not divide dp=2" in str(info.value)


def test_search_prices_expert_parallel_layouts_on_active_flops():
    spec = SearchSpec(MIXTRAL, get_accelerator("h100-sxm"), 16, 8, 2**20, 4096)
    layouts = list(enumerate_layouts(spec))
    assert {lay.ep for lay in layouts} == {1, 2, 4, 8}
    lay = Layout(dp=16, ep=8, zero=3, micro_batch_size=1, grad_accum=16, seq_len=4096, recompute="full")
    est = estimate_step(spec, lay)
    assert est.ep_comm_s > 0 and any("EP all-to-all" in r for r in est.reasons)
    assert estimate_step(spec, dataclasses.replace(lay, ep=1)).ep_comm_s == 0
    pipelined = est.compute_s + est.elementwise_s + est.tp_comm_s + est.cp_exposed_s + est.pp_comm_s + est.ep_comm_s
    assert est.step_s == pytest.approx(pipelined + est.bubble_s + est.dp_exposed_s + est.optimizer_s)
    counts = count_params_of(MIXTRAL)
    flops = flops_per_token_of(MIXTRAL, 4096)
    assert flops < 6 * counts.total / 2  # active: about a quarter of the total's 6·N
    assert est.mfu == pytest.approx(est.tokens_per_s_per_gpu * flops / spec.accelerator.flops["bf16"])


def test_search_proposes_cp_only_where_the_trainer_runs_it():
    spec = SearchSpec(PRESETS["llama3-8b"], get_accelerator("h100-sxm"), 16, 8, 2**20, 32768)
    layouts = list(enumerate_layouts(spec))
    assert any(lay.cp > 1 for lay in layouts)
    assert any(lay.cp > 1 and lay.pp > 1 for lay in layouts)  # the trainer runs context parallel in stages too
    mem = estimate_memory(PRESETS["llama3-8b"], Layout(dp=2, cp=4, seq_len=32768))
    one = estimate_memory(PRESETS["llama3-8b"], Layout(dp=8, seq_len=32768))
    # every per-layer tensor is over a quarter of the tokens; autocast's bf16 weight copies are not
    items, whole = mem.extra["per_layer_activation_items"], one.extra["per_layer_activation_items"]
    assert items.keys() == whole.keys()
    for name, size in items.items():
        assert size == pytest.approx(whole[name] if name == "bf16 weight copies" else whole[name] / 4), name
    assert mem.peak_bytes / GiB < one.peak_bytes / GiB
