"""benchmarks/plan_vs_measured.py's published rows: torchtitan's runs priced like with like (their
op-level selective checkpointing, their HBM2e bandwidth), by hand."""

import dataclasses
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
    name, model, machine, layout, op_sac, _ = bench.PUBLISHED[0]
    assert layout.recompute == "selective" and layout.zero == 3 and layout.dp == 8 and op_sac
    from dataclasses import replace

    from ultratron.planning.hardware import get_accelerator
    from ultratron.planning.search import SearchSpec

    shape = PRESETS[model]
    spec = SearchSpec(shape, replace(get_accelerator("h100-sxm"), memory_bw=bench.TITAN_HBM), 8, 8, 8 * 2 * 8192,
                      8192)
    est = estimate_step(spec, layout)
    # by hand: q, k, v, o, gate+up and down of every layer, forward, for the 16,384 tokens; half of them again
    h, hd = shape.dim, shape.dim // shape.n_heads
    q, kv, f = shape.n_heads * hd, shape.n_kv_heads * hd, shape.ffn_dim
    per_token = 2 * (h * (q + 2 * kv) + q * h + h * 2 * f + f * h) * shape.n_layers
    expected = 0.5 * per_token * 2 * 8192 / (est.efficiency * 989.4e12)
    assert bench.titan_op_sac_s(spec, est) == pytest.approx(expected)
    assert 0.05 < expected / est.step_s < 0.2  # about a sixth of the matmuls' share of the step
    # at the SXM peak the row is that step; a lower peak only lengthens it
    tokens, _ = bench.predict_published(model, machine, layout, op_sac, 989.4e12)
    assert tokens == pytest.approx(8 * 2 * 8192 / (est.step_s + expected) / 8)
    assert bench.predict_published(model, machine, layout, op_sac, 835.5e12)[0] < tokens


def test_under_tensor_parallel_op_sac_keeps_the_reduce_scatters():
    """torchtitan's op-level SAC saves the reduce-scatters' outputs, and so does our selective
    recompute: a layer issues 4 (2 forward, 2 backward), none again, and the difference priced for
    torchtitan is its half of the matmuls recomputed alone."""
    from dataclasses import replace

    from ultratron.planning.compute import layer_matmuls
    from ultratron.planning.hardware import get_accelerator
    from ultratron.planning.search import SearchSpec

    bench = _benchmark()
    name, model, _, layout, op_sac, _ = next(row for row in bench.PUBLISHED if row[3].tp > 1 and row[4])
    assert layout.sp and layout.compile
    shape = PRESETS[model]
    spec = SearchSpec(shape, replace(get_accelerator("h100-sxm"), memory_bw=bench.TITAN_HBM), layout.n_gpus, 8,
                      layout.dp * layout.micro_batch_size * layout.seq_len, layout.seq_len)
    est = estimate_step(spec, layout)
    (scatters,) = [c for c in est.collectives if c.axis == "tp" and c.op == "reduce-scatter"]
    assert scatters.calls == 4 * shape.n_layers + 2  # the ends: the embedding's, the head's gradient
    tokens = layout.micro_batch_size * layout.seq_len
    matmuls = 0.5 * sum(2 * m * k * n * c for m, k, n, c in layer_matmuls(shape, tokens, 8)) * shape.n_layers
    assert bench.titan_op_sac_s(spec, est) == pytest.approx(matmuls / (est.efficiency * 989.4e12))


def test_fp8_rows_price_the_matmuls_at_the_fp8_peak():
    """The Float8 rows run at their precision: the blocks' matmuls at the fp8 peak, twice the bf16
    one on Grand Teton's H100s at either end of its range, the H200's own table figure there."""
    bench = _benchmark()
    bf16 = {row[0]: row for row in bench.PUBLISHED}
    fp8 = bench.PUBLISHED_FP8[0]
    twin = bf16[fp8[0].replace("+fp8", "")]
    assert fp8[3].precision == "fp8" and twin[3] == dataclasses.replace(fp8[3], precision="bf16")
    for peak in (989.4e12, 835.5e12):
        fast, _ = bench.predict_published(fp8[1], fp8[2], fp8[3], fp8[4], peak)
        slow, _ = bench.predict_published(twin[1], twin[2], twin[3], twin[4], peak)
        assert 1.2 < fast / slow < 2  # the matmuls twice as fast, the rest of the step as it was
    # an H200 row at its own table figures: the planner's step on that GPU as it is, op-SAC's recompute added
    from ultratron.planning.hardware import get_accelerator
    from ultratron.planning.search import SearchSpec

    name, model, machine, layout, op_sac, _ = next(row for row in bench.PUBLISHED_FP8 if row[2] == "h200")
    spec = SearchSpec(PRESETS[model], get_accelerator("h200"), layout.n_gpus, 8,
                      layout.dp * layout.micro_batch_size * layout.seq_len, layout.seq_len, precision="fp8")
    est = estimate_step(spec, layout)
    expected = spec.global_batch_tokens / (est.step_s + bench.titan_op_sac_s(spec, est)) / spec.n_gpus
    assert bench.predict_published(model, machine, layout, op_sac, None)[0] == pytest.approx(expected)
