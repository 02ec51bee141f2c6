import pytest

from ultratron.planning.hardware import peak_flops
from ultratron.planning.scaling import (
    FITS,
    budget_flops,
    checkpoint_bytes,
    checkpoint_storage,
    compute_optimal,
    tokens_per_param_rule,
    training_seconds,
)


def test_twenty_tokens_per_param_gives_69b_and_1_39t():
    rule = tokens_per_param_rule(5.76e23)
    assert rule.params == pytest.approx(69e9, rel=0.01)
    assert rule.tokens == pytest.approx(1.39e12, rel=0.01)
    assert 6 * rule.params * rule.tokens == pytest.approx(5.76e23)


@pytest.mark.parametrize("flops", [1e21, 1e22, 1e23, 1e24, 1e25])
def test_epoch_fit_tokens_per_param_between_15_and_25(flops):
    epoch = compute_optimal(flops, FITS["epoch"])
    assert 15 < epoch.tokens_per_param < 25
    assert 6 * epoch.params * epoch.tokens == pytest.approx(flops)
    # The allocation is a minimum of the fit along 6·N·D = C.
    for factor in (0.8, 1.25):
        n = epoch.params * factor
        assert FITS["epoch"].loss(n, flops / (6 * n)) > epoch.loss


def test_hoffmann_rounded_constants_disagree_with_the_rule():
    # Shown beside the Epoch answer: the rounded approach-3 constants want far more tokens per parameter.
    hoffmann = compute_optimal(5.76e23, FITS["hoffmann"])
    epoch = compute_optimal(5.76e23, FITS["epoch"])
    assert hoffmann.tokens_per_param > 3 * epoch.tokens_per_param
    assert epoch.params == pytest.approx(72e9, rel=0.05)
    expected = 1.69 + 406.4 / 70e9**0.34 + 410.7 / 1.4e12**0.28
    assert FITS["hoffmann"].loss(70e9, 1.4e12) == pytest.approx(expected)


def test_gpu_days_budget_time_and_moe_active_params():
    peak = peak_flops("h100-sxm", "bf16")[0]
    budget = budget_flops(n_gpus=1024, days=30, mfu=0.4, peak_flops=peak)
    assert budget == pytest.approx(1024 * 30 * 86400 * 0.4 * 989.4e12)
    assert training_seconds(budget, 1024, 0.4, peak) == pytest.approx(30 * 86400)
    # An MoE with 37B active of 671B total: FLOPs follow active, the checkpoint follows total.
    tokens = 14.8e12
    dense_equivalent = training_seconds(6 * 37e9 * tokens, 2048, 0.4, peak)
    assert dense_equivalent == pytest.approx(6 * 37e9 * tokens / (2048 * 0.4 * 989.4e12))
    assert checkpoint_bytes(671e9) == 671e9 * 14


def test_checkpoint_size_and_retention():
    assert checkpoint_bytes(7e9) == pytest.approx(98e9)
    storage = checkpoint_storage(7e9, total_steps=10_000, save_interval=1000, keep=3)
    assert storage.saves == 10 and storage.kept == 3
    assert storage.peak_bytes == pytest.approx(4 * 98e9)  # three kept + one being written
    assert storage.written_bytes == pytest.approx(10 * 98e9)
    assert checkpoint_storage(7e9, total_steps=10_500, save_interval=1000, keep=20).saves == 11
    assert checkpoint_storage(7e9, total_steps=10_500, save_interval=1000, keep=20).peak_bytes == 11 * 98e9
