"""Activations under tensor and data parallelism, measured on 2 CPU processes and compared with
`plan memory` (`estimate_memory`): the bytes the trainer's second micro-batch leaves alive after
forward (`parallel.memory.LiveTensors`), on each rank. Tensor parallel with and without sequence
parallel, fp32 and bf16, selective recompute; FSDP2 (bf16 weights gathered, a bf16 residual
stream) and DDP (autocast over fp32 weights). What the planner counts, with sequence parallel
especially: the norm outputs are all-gathered before the column-parallel matmuls and kept whole."""

from __future__ import annotations

import json

import pytest
from dist_common import dist_base_fixture  # noqa: F401 (fixture)

from ultratron.config import load_config
from ultratron.planning.layout import Layout
from ultratron.planning.memory import estimate_memory

LAYOUTS = {
    "tp2": ["--parallel.tp", "2"],
    "tp2-sp-bf16": ["--parallel.tp", "2", "--parallel.sp", "true", "--training.precision", "bf16"],
    "tp2-sp-bf16-selective": ["--parallel.tp", "2", "--parallel.sp", "true", "--training.precision", "bf16",
                              "--training.recompute", "selective"],
    "dp2-zero2-bf16": ["--parallel.dp", "2", "--parallel.zero", "2", "--training.precision", "bf16"],
    "dp2-bf16": ["--parallel.dp", "2", "--training.precision", "bf16"],
}


@pytest.fixture(scope="module")
def measured(dist_base, tmp_path_factory):
    from dist_jobs import measure_step_memory

    from ultratron.launch.local import run_local

    out = tmp_path_factory.mktemp("step-memory")
    run_local(2, measure_step_memory, dist_base, list(LAYOUTS.values()), str(out))
    return [dict(zip(LAYOUTS, json.loads((out / f"rank{r}.json").read_text()), strict=True)) for r in range(2)]


@pytest.mark.parametrize("name", LAYOUTS)
def test_activations_after_forward_match_the_plan(measured, dist_base, name):
    cfg = load_config(None, dist_base + LAYOUTS[name])
    par, t = cfg.parallel, cfg.training
    layout = Layout(dp=par.dp, zero=par.zero, tp=par.tp, sp=par.sp, micro_batch_size=t.micro_batch_size,
                    seq_len=t.seq_len,
                    grad_accum=cfg.grad_accum_steps, recompute=t.recompute, precision=t.precision,
                    attention_fp32=t.precision == "bf16")  # on CPU the trainer runs attention in fp32
    planned = estimate_memory(cfg.model, layout)
    # measured here: within 0.15%, except 2.8% under sequence parallel with selective recompute,
    # where the embedding's partial lookup is kept at 1/tp of the size the planner counts
    for rank in range(2):
        assert measured[rank][name] == pytest.approx(planned.activations + planned.loss_logits, rel=0.03), rank
