"""The start's peak (planning.memory, "Start"): what a rank holds from `meta` to the first step — its
shards in fp32, the rope tables, and initialization's two blocks or a load's largest stored tensor —
figured by hand from the planner's own parameter count, and a layout whose start does not fit refused
with the start's number."""

import json
from dataclasses import replace
from math import prod

import pytest

from ultratron.cli import main
from ultratron.models.init_blocks import INIT_BLOCK_ELEMENTS
from ultratron.models.presets import PRESETS
from ultratron.planning.hardware import get_accelerator
from ultratron.planning.layout import Layout
from ultratron.planning.lora import adapter_params_per_layer
from ultratron.planning.memory import (
    GiB,
    estimate_memory,
    estimate_memory_per_rank,
    layer_tensor_shapes,
    pipeline_ranks,
)
from ultratron.planning.params import count_params_of
from ultratron.planning.search import SearchSpec, search

MiB = 2**20
TWO_BLOCKS = 2 * INIT_BLOCK_ELEMENTS * 4  # every matrix here has ≥ 4 Mi elements: two full 16 MiB blocks
# a small model with a 2 Mi-token vocabulary: its tied embedding, 2 Mi × 2048 in fp32, is 16 GiB whole
HUGE_VOCAB = replace(PRESETS["llama3-1b"], vocab_size=2_097_152, tie_embeddings=True)


def rope(shape) -> int:
    """cos and sin, max_seq_len × head_dim/2 each, fp32."""
    return 2 * shape.max_seq_len * (shape.dim // shape.n_heads // 2) * 4


def test_every_presets_tensor_shapes_add_up_to_its_parameter_count():
    for name, shape in PRESETS.items():
        counts = count_params_of(shape)
        assert sum(prod(s) for s in layer_tensor_shapes(shape, moe=False)) == counts.per_layer, name
        if shape.n_experts:
            assert sum(prod(s) for s in layer_tensor_shapes(shape, moe=True)) == counts.moe_layer, name


def test_llama3_70b_dp64_zero3_holds_a_64th_of_the_model_and_its_embedding_whole_to_load_it():
    shape = PRESETS["llama3-70b"]
    m = estimate_memory(shape, Layout(dp=64, zero=3, seq_len=8192))
    params = count_params_of(shape).total  # 70.55e9, untied: embedding and head both on the one stage
    assert params == 70_553_706_496
    shards = params * 4 / 64
    assert m.start_shards == pytest.approx(shards, rel=1e-12)
    assert m.start_buffers == rope(shape) == 4 * MiB  # 8192 × 64 × 2 × 4
    assert m.start_init_transient == TWO_BLOCKS == 32 * MiB
    assert m.start_init_bytes == pytest.approx(shards + 4 * MiB + 32 * MiB, rel=1e-12)  # 4.14 GiB
    # a load reads the largest tensor it holds part of whole: the embedding (or head), 128256 × 8192 fp32
    assert m.extra["largest_stored_tensor"] == (128256, 8192)
    assert m.start_load_bytes == pytest.approx(shards + 4 * MiB + 128256 * 8192 * 4, rel=1e-12)  # 8.02 GiB
    assert m.start_bytes == m.start_load_bytes
    # the step's peak is far larger: it is what must fit
    assert m.fit_bytes == m.peak_bytes and m.fit_moment == "step"


def test_llama3_405b_tp8_pp16_dp16_zero3_first_middle_and_last_ranks():
    shape = PRESETS["llama3-405b"]
    layout = Layout(tp=8, pp=16, dp=16, zero=3, seq_len=8192, grad_accum=16)
    ranks = estimate_memory_per_rank(shape, layout)
    where = pipeline_ranks(shape, layout)
    counts = count_params_of(shape)
    norms = 2 * shape.dim  # stay whole under tp
    per_layer = (counts.per_layer - norms) / 8 + norms
    embedding = shape.vocab_size * shape.dim
    head = embedding  # untied
    buffers = rope(shape)  # 8192 × 64 × 2 × 4: every rank
    for rank, expected_extra, largest in ((0, embedding / 8, (128256, 16384)),
                                          (7, 0, (53248, 16384)),  # w1 and w3: ffn × dim
                                          (15, head / 8 + shape.dim, (128256, 16384))):
        m, w = ranks[rank], where[rank]
        assert (w.first, w.last) == (rank == 0, rank == 15)
        params = sum(w.layers) * per_layer + expected_extra
        assert m.start_shards == pytest.approx(params * 4 / 16, rel=1e-12), rank
        assert m.start_init_bytes == pytest.approx(params * 4 / 16 + buffers + TWO_BLOCKS, rel=1e-12), rank
        assert m.extra["largest_stored_tensor"] == largest
        assert m.start_load_bytes == pytest.approx(params * 4 / 16 + buffers + prod(largest) * 4, rel=1e-12), rank
    # the first rank, 9 layers: 0.81 GiB of shards, and 7.83 GiB to read the embedding whole
    assert ranks[0].start_shards / GiB == pytest.approx(0.80, abs=0.01)
    assert ranks[0].start_load_bytes / GiB == pytest.approx(8.64, abs=0.01)
    # the heaviest rank's breakdown carries the largest start of any rank
    heaviest = estimate_memory(shape, layout)
    assert heaviest.start_bytes == max(m.start_bytes for m in ranks)
    assert heaviest.extra["start_pp_rank"] in (0, 15)


def test_zero1_and_ddp_hold_whole_parameters_fsdp_a_shard_without_zero2s_gathered_copy():
    shape = PRESETS["llama3-8b"]
    params = count_params_of(shape).total
    for zero in (0, 1):  # DDP (ZeroRedundancyOptimizer shards only the moments)
        m = estimate_memory(shape, Layout(dp=8, zero=zero, seq_len=8192))
        assert m.start_shards == pytest.approx(params * 4, rel=1e-12)
        assert m.start_init_bytes == pytest.approx(params * 4 + rope(shape) + TWO_BLOCKS, rel=1e-12)
    zero2 = estimate_memory(shape, Layout(dp=8, zero=2, seq_len=8192))  # FSDP2: shards at rest
    assert zero2.start_shards == pytest.approx(params * 4 / 8, rel=1e-12)
    assert zero2.parameters == pytest.approx(params * (4 / 8 + 2), rel=1e-12)  # the step's: + the bf16 copy
    tp_zero1 = estimate_memory(shape, Layout(dp=4, tp=2, zero=1, seq_len=8192))  # dp meets tp: FSDP2
    assert tp_zero1.start_shards == pytest.approx(tp_zero1.extra["params_on_gpu"] * 4 / 4, rel=1e-12)


def test_split_experts_are_held_whole_and_a_load_reads_the_grouped_experts_whole():
    shape = PRESETS["mixtral-8x7b"]
    m = estimate_memory(shape, Layout(dp=8, ep=8, zero=3, seq_len=4096))
    experts = m.extra["expert_params_on_gpu"]
    assert experts > 0
    assert m.start_shards == pytest.approx((m.extra["params_on_gpu"] - experts) * 4 / 8 + experts * 4, rel=1e-12)
    # experts.w1: 8 × 14336 × 4096, larger than the 32000 × 4096 embedding
    assert m.extra["largest_stored_tensor"] == (8, 14336, 4096)
    assert m.start_load_transient == 8 * 14336 * 4096 * 4


def test_lora_holds_the_frozen_bases_shards_and_the_adapters():
    shape, layout = PRESETS["llama3-8b"], Layout(dp=8, zero=3, seq_len=4096)
    base = estimate_memory(shape, layout)
    lora = estimate_memory(shape, layout, lora=(16, ("q", "v")))
    adapters = shape.n_layers * adapter_params_per_layer(shape, 16, ("q", "v"))
    assert lora.start_shards == pytest.approx(base.start_shards + adapters * 4 / 8, rel=1e-12)
    assert lora.start_load_transient == base.start_load_transient


def test_a_start_that_does_not_fit_refuses_the_layout_with_its_number(capsys):
    layout = Layout(dp=8, tp=8, sp=True, zero=3, seq_len=2048, grad_accum=8, recompute="full", loss_chunk=1024)
    m = estimate_memory(HUGE_VOCAB, layout)
    whole = 2_097_152 * 2048 * 4
    assert m.start_load_transient == whole == 16 * GiB
    assert m.peak_bytes < 14.4 * GiB < m.start_load_bytes  # the step fits 16 GiB (less 10 %), the load does not
    assert m.fit_moment == "load" and m.fit_bytes == m.start_load_bytes
    assert m.fit_description().startswith(f"{m.start_load_bytes / GiB:.1f} GiB at its start from a checkpoint")

    # plan search: refused, and the summary names the start's peak
    acc = replace(get_accelerator("h100-sxm"), memory_bytes=16 * GiB)
    spec = SearchSpec(HUGE_VOCAB, acc, 64, 8, 8 * 8 * 2048, 2048,
                      fixed={"tp": 8, "pp": 1, "cp": 1, "zero": 3, "recompute": "full", "loss_chunk": 1024})
    result = search(spec)
    assert result.best is None and result.too_big == result.considered > 0
    summary = "\n".join(result.summary)
    assert "16.3 GiB at its start from a checkpoint" in summary and "2097152×2048 tensor reads 16.0 GiB" in summary
    # on a GPU with room for the load, the same layouts fit
    assert search(replace(spec, accelerator=replace(acc, memory_bytes=20 * GiB))).best is not None

    # plan estimate: the verdict says which moment does not fit
    flags = ["--model", "llama3-1b", "--vocab-size", "2097152", "--tie-embeddings", "--dp", "8", "--tp", "8",
             "--sp", "--zero", "3", "--seq", "2048", "--grad-acc", "8", "--recompute", "full", "--loss-chunk", "1024",
             "--gpu", "h100-sxm", "--memory-gib", "16"]
    assert main(["plan", "estimate", *flags]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit: 16.3 GiB at its start from a checkpoint" in out
    assert main(["plan", "estimate", *flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["memory"]["fit_moment"] == "load"


def test_plan_memory_prints_the_start_beside_the_peak_and_puts_it_in_json(capsys):
    flags = ["plan", "memory", "--model", "llama3-70b", "--dp", "64", "--zero", "3", "--seq", "8192"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "start (meta → materialize → init): 4.14 GiB; from a checkpoint: 8.02 GiB" in out
    rows = {line.split("  ")[0]: line.split()[-1] for line in out.splitlines() if line.startswith("start: ")}
    assert rows == {"start: init": "4.14", "start: from a checkpoint": "8.02"}
    assert main([*flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    layout = data["layouts"][0]
    assert data["start_load_bytes"] == layout["start_load_bytes"] == pytest.approx(8.02 * GiB, rel=1e-3)
    assert data["start_init_bytes"] == layout["start_init_bytes"]
    assert layout["start_init_bytes"] == layout["start_shards"] + layout["start_buffers"] + 32 * MiB
    assert layout["fit_bytes"] == layout["peak_bytes"]


# benchmarks/start_at_scale.py's model: a 4.6 GB Llama in fp32, LoRA rank 8 on dp 4 under ZeRO-3
START_AT_SCALE = replace(PRESETS["llama3-1b"], n_layers=24, dim=2048, ffn_dim=5632, n_heads=16, n_kv_heads=8,
                         vocab_size=4096, tie_embeddings=False, max_seq_len=2048, head_dim=None)


def _gpu_minus_cpu(precision: str) -> float:
    """A block's backward on a GPU (two blocks gathered, one block's fp32 gradients reduce-scattered)
    minus on a CPU (the largest linear layer, w1, 5632 × 2048, gathered and reduced), in bytes."""
    block = sum(prod(s) for s in layer_tensor_shapes(START_AT_SCALE, moe=False))  # elements, gathered whole
    unit = START_AT_SCALE.ffn_dim * START_AT_SCALE.dim
    return (2 * block - unit) * (4 if precision == "fp32" else 2) + (block - unit) * 4


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_with_a_unit_per_linear_layer_zero3_gathers_the_largest_layer_not_two_blocks(precision):
    """On a CPU the trainer makes each linear layer a ZeRO-3 unit with no backward prefetch
    (parallel/data.py): a block's backward holds one layer's weight gathered, not that block and the
    next; the start has no gathered block either way."""
    layout = Layout(dp=4, zero=3, seq_len=64, precision=precision)
    for lora in (None, (8, ("q", "k", "v", "o", "gate", "up", "down"))):
        gpu = estimate_memory(START_AT_SCALE, layout, lora=lora)
        cpu = estimate_memory(START_AT_SCALE, replace(layout, zero3_units="linear"), lora=lora)
        assert gpu.transient - cpu.transient == pytest.approx(_gpu_minus_cpu(precision), rel=1e-12)
        if lora:  # (without it the optimizer step's temporaries are the peak)
            assert gpu.peak_moment == cpu.peak_moment == "backward"
            assert gpu.peak_bytes - cpu.peak_bytes == pytest.approx(_gpu_minus_cpu(precision), rel=1e-12)
        assert (cpu.start_init_bytes, cpu.start_load_bytes) == (gpu.start_init_bytes, gpu.start_load_bytes)
    for zero in (0, 2):  # nothing is gathered just in time: the units change nothing
        on = estimate_memory(START_AT_SCALE, replace(layout, zero=zero))
        assert estimate_memory(START_AT_SCALE, replace(layout, zero=zero, zero3_units="linear")) == on


def test_a_small_block_stays_one_unit_on_a_cpu_without_the_prefetch():
    """Below 64 MiB a block is one ZeRO-3 unit on a CPU too (its collectives would cost more than the
    memory saved): one block gathered in backward instead of two, its gradients reduced whole."""
    shape = PRESETS["tiny"]
    block = sum(prod(s) for s in layer_tensor_shapes(shape, moe=False))
    assert block * 4 < 64 * 2**20
    layout = Layout(dp=4, zero=3, seq_len=64, precision="fp32")
    gpu = estimate_memory(shape, layout, lora=(8, ("q", "v")))
    cpu = estimate_memory(shape, replace(layout, zero3_units="linear"), lora=(8, ("q", "v")))
    assert gpu.transient - cpu.transient == pytest.approx(block * 4, rel=1e-12)


def test_per_linear_units_of_a_mixture_of_experts_gather_the_unsplit_experts_with_the_block():
    """The grouped experts are no linear layer: unsplit, they stay in the block's own unit, which is
    then the largest; split over ep they are outside ZeRO and the largest linear layer counts."""
    from ultratron.planning.memory import _largest_unit, pipeline_ranks

    shape = PRESETS["moe-tiny"]
    (where,) = pipeline_ranks(shape, Layout(dp=2, zero=3))
    experts = 3 * shape.n_experts * shape.expert_ffn_dim * shape.dim
    assert _largest_unit(shape, where, 1, split_experts=False) >= experts
    matrices = [prod(s) for s in layer_tensor_shapes(shape, moe=True) if len(s) == 2]  # every layer routes
    assert _largest_unit(shape, where, 1, split_experts=True) == max(matrices)


def test_plan_memory_takes_zero3_units_as_a_flag(capsys):
    flags = ["plan", "memory", "--n-layers", "24", "--dim", "2048", "--ffn-dim", "5632", "--n-heads", "16",
             "--n-kv-heads", "8", "--vocab-size", "4096", "--no-tie-embeddings", "--max-seq-len", "2048", "--dp", "4",
             "--zero", "3", "--seq", "64", "--precision", "fp32", "--lora-rank", "8", "--json"]
    peaks = {}
    for units in ("block", "linear"):
        assert main([*flags, "--zero3-units", units]) == 0
        (layout,) = json.loads(capsys.readouterr().out)["layouts"]
        assert layout["layout"]["zero3_units"] == units
        peaks[units] = layout["peak_bytes"]
    assert peaks["block"] - peaks["linear"] == pytest.approx(_gpu_minus_cpu("fp32"), rel=1e-12)
