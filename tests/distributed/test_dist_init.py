"""Shard-wise initialization equals one process's (meta → parallelize → materialize → initialize).

Every layout builds the model on the meta device, applies its axes, gives each rank storage for its
own shards only and initializes them; each shard must hold, bit for bit (fp32), what one process's
initialization puts at the same rows and columns, so every equivalence test's one-process run starts
from the weights every layout starts from. Each rank checks its own shards against a whole model it
builds itself: a shard drawn from the wrong block, seed or rows, or a pipeline's tied copy drawn under
its own name, fails here.
"""

from __future__ import annotations

import json

import pytest
from dist_common import dist_base_fixture  # noqa: F401

FP32 = ["--training.precision", "fp32"]
LAYOUTS = {
    "dp4-zero3": ["--parallel.dp", "4", "--parallel.zero", "3"],
    "dp4-zero1": ["--parallel.dp", "4", "--parallel.zero", "1"],
    "dp2xtp2-sp-zero3": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sp", "true", "--parallel.zero", "3"],
    "hsdp2x2-zero3": ["--parallel.dp", "4", "--parallel.dp_replicate", "2", "--parallel.zero", "3"],
    "pp2xdp2-zero3-tied": ["--parallel.pp", "2", "--parallel.dp", "2", "--parallel.zero", "3"],
    "pp2xtp2-zbv-untied": ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.pp_schedule", "zbv",
                           "--model.tie_embeddings", "false", "--model.n_layers", "4"],
    "cp2xdp2-zero2": ["--parallel.cp", "2", "--parallel.dp", "2", "--parallel.zero", "2"],
    "lora-dp4-zero3": ["--parallel.dp", "4", "--parallel.zero", "3", "--lora.rank", "4"],
    "lora-tp2xdp2-zero0": ["--parallel.tp", "2", "--parallel.dp", "2", "--parallel.zero", "0", "--lora.rank", "4"],
    "moe-ep2xtp2": ["--model.preset", "moe-tiny", "--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2"],
    "fp8-dp2xtp2-zero3": ["--training.precision", "fp8", "--parallel.dp", "2", "--parallel.tp", "2",
                          "--parallel.zero", "3"],
    "moe-ep4-zero3": ["--model.preset", "moe-tiny", "--parallel.dp", "4", "--parallel.ep", "4", "--parallel.zero", "3"],
}


@pytest.fixture(scope="module")
def compared(dist_base, tmp_path_factory) -> dict[str, list[dict]]:
    from dist_jobs import compare_initial_shards

    from ultratron.launch.local import run_local

    out = tmp_path_factory.mktemp("init")
    run_local(4, compare_initial_shards, dist_base + FP32, list(LAYOUTS.values()), str(out))
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(LAYOUTS)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_shard_holds_what_one_process_puts_there(compared, layout):
    ranks = compared[layout]
    for rank, result in enumerate(ranks):
        assert result["shards"] > 0, f"rank {rank} holds no parameter"
        assert result["unequal"] == [], f"rank {rank}: shards unlike one process's: {result['unequal']}"


def test_shards_are_shards(compared):
    """ZeRO-3 over four ranks: each holds about a quarter of the elements DDP's ranks hold whole."""
    zero3 = [r["elements"] for r in compared["dp4-zero3"]]
    whole = [r["elements"] for r in compared["dp4-zero1"]]
    assert len(set(whole)) == 1
    # FSDP2 cuts each parameter's rows in four (torch.chunk): a rank holds at most ⌈rows/4⌉ of each
    assert all(whole[0] / 4 * 0.9 <= n <= whole[0] / 4 * 1.1 for n in zero3), (zero3, whole[0])


def test_one_process_start_is_the_models_own_initialization(dist_base, tmp_path):
    from dist_jobs import compare_initial_shards

    compare_initial_shards(dist_base + FP32, [[], ["--lora.rank", "4"]], str(tmp_path))
    for result in json.loads((tmp_path / "rank0.json").read_text()):
        assert result["shards"] > 0 and result["unequal"] == []
