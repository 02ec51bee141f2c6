"""benchmarks/plan_vs_measured.py's published rows: torchtitan's runs priced like with like (their
op-level selective checkpointing, their HBM2e bandwidth), by hand."""

import importlib.util
from pathlib import Path

import pytest

from ultratron.models.presets import PRESETS
from ultratron.planning.search import estimate_step

ROOT = Path(__file__).parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location("ultratron_plan_vs_measured", ROOT / "benchmarks" /
                                                  "plan_vs_measured.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchtitan_rows_recompute_every_second_matmul_at_their_bandwidth():
    bench = _benchmark()
    assert bench.TITAN_HBM == 2.4e12  # the file's "2.4 TB/sec peak memory bandwidth"
    name, model, gpu, layout, _ = bench.PUBLISHED[0]
    assert layout.recompute == "selective" and layout.zero == 3 and layout.dp == 8
    from dataclasses import replace

    from ultratron.planning.hardware import get_accelerator
    from ultratron.planning.search import SearchSpec

    shape = PRESETS[model]
    spec = SearchSpec(shape, replace(get_accelerator(gpu), memory_bw=bench.TITAN_HBM), 8, 8, 8 * 2 * 8192, 8192)
    est = estimate_step(spec, layout)
    # by hand: q, k, v, o, gate+up and down of every layer, forward, for the 16,384 tokens; half of them again
    h, hd = shape.dim, shape.dim // shape.n_heads
    q, kv, f = shape.n_heads * hd, shape.n_kv_heads * hd, shape.ffn_dim
    per_token = 2 * (h * (q + 2 * kv) + q * h + h * 2 * f + f * h) * shape.n_layers
    expected = 0.5 * per_token * 2 * 8192 / (est.efficiency * 989.4e12)
    assert bench.titan_op_sac_s(spec, est) == pytest.approx(expected)
    assert 0.05 < expected / est.step_s < 0.2  # about a sixth of the matmuls' share of the step
