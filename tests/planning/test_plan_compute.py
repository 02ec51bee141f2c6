"""The compute term's efficiency by shape (`planning.compute`), against hand computations."""

import math

import pytest

from ultratron.models.presets import PRESETS, ModelShape
from ultratron.planning.compute import (
    MATMUL_EFFICIENCY,
    MATMUL_OVERHEAD_S,
    attention_efficiency,
    compute_efficiency,
    layer_matmuls,
    matmul_seconds,
)
from ultratron.planning.flops import flops_per_token_of
from ultratron.planning.hardware import get_accelerator
from ultratron.planning.layout import Layout
from ultratron.planning.search import SearchSpec, estimate_step

H100 = get_accelerator("h100-sxm")
PEAK, HBM = 989.4e12, 3.35e12


def test_a_matmul_is_bound_by_its_flops_or_its_bytes():
    big = matmul_seconds(8192, 8192, 8192, PEAK, HBM, 2)
    assert big == pytest.approx(2 * 8192**3 / (0.645 * PEAK) + 5e-6)
    thin = matmul_seconds(256, 8192, 128, PEAK, HBM, 2)  # 0.5 GFLOP moving 4.5 MB: memory-bound
    assert thin == pytest.approx(2 * (256 * 8192 + 8192 * 128 + 256 * 128) / HBM + 5e-6)
    assert MATMUL_EFFICIENCY == 0.645 and MATMUL_OVERHEAD_S == 5e-6


def test_attention_efficiency_interpolates_the_measured_table_in_log_seq():
    assert attention_efficiency(4096) == pytest.approx(0.631)
    assert attention_efficiency(100) == pytest.approx(0.023) and attention_efficiency(1e6) == pytest.approx(0.999)
    # halfway between 4096 and 8192 in log: the mean of their efficiencies
    assert attention_efficiency(4096 * math.sqrt(2)) == pytest.approx((0.631 + 0.908) / 2)


def test_compute_efficiency_of_a_small_model_by_hand():
    shape = ModelShape(n_layers=2, dim=1024, n_heads=8, n_kv_heads=2, ffn_dim=4096, vocab_size=32000,
                       tie_embeddings=False, rope_theta=1e4, max_seq_len=2048)
    lay = Layout(tp=2, micro_batch_size=2, seq_len=2048)
    tokens, q, kv = 4096, 1024, 256
    products = [(tokens, 1024, (q + 2 * kv) / 2), (tokens, q / 2, 1024), (tokens, 1024, 4096),
                (tokens, 2048, 1024)]
    assert [p[:3] for p in layer_matmuls(shape, tokens, 2)] == products
    flops = seconds = 0.0
    for m, k, n in [*products, *products, (tokens, 1024, 16000)]:  # 2 layers, then the head
        flops += 6 * m * k * n
        seconds += 3 * matmul_seconds(m, k, n, PEAK, HBM, 2)
    attention = 12 * 2 * 1024 * 2048 * tokens / 2
    flops += attention
    seconds += attention / (attention_efficiency(2048) * PEAK)
    assert compute_efficiency(shape, lay, PEAK, HBM) == pytest.approx(flops / seconds / PEAK)


def test_small_per_rank_matmuls_run_slower_and_the_step_uses_it():
    shape = PRESETS["llama3-70b"]
    wide = compute_efficiency(shape, Layout(tp=1, micro_batch_size=1, seq_len=8192), PEAK, HBM)
    split = compute_efficiency(shape, Layout(tp=32, micro_batch_size=1, seq_len=1024), PEAK, HBM)
    assert 0.65 < wide < 0.75 and split < 0.8 * wide  # 1024 tokens × 320-wide products: launch and bytes show
    spec = SearchSpec(PRESETS["llama3-8b"], H100, 8, 8, 8 * 4 * 4096, 4096)
    lay = Layout(dp=8, micro_batch_size=2, grad_accum=2, seq_len=4096)
    est = estimate_step(spec, lay)
    eff = compute_efficiency(spec.shape, lay, PEAK, HBM)
    assert est.efficiency == pytest.approx(eff)
    assert est.compute_s == pytest.approx(spec.global_batch_tokens * flops_per_token_of(spec.shape, 4096)
                                          / (8 * PEAK * eff))
