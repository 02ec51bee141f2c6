import math
from types import SimpleNamespace

import pytest

from ultratron.training.optim import lr_at


def optim(**kw):
    base = dict(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, schedule="cosine", decay_fraction=0.2)
    return SimpleNamespace(**{**base, **kw})


def test_linear_warmup_then_cosine_to_the_floor():
    cfg = optim()
    assert lr_at(0, 110, cfg) == pytest.approx(0.1)
    assert lr_at(9, 110, cfg) == pytest.approx(1.0)
    assert lr_at(10, 110, cfg) == pytest.approx(1.0)
    mid = 10 + (110 - 10 - 1) / 2
    assert lr_at(int(mid), 110, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * int(mid - 10) / 99)))
    assert lr_at(109, 110, cfg) == pytest.approx(0.1)
    values = [lr_at(s, 110, cfg) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_warmup_stable_decay():
    cfg = optim(schedule="wsd")
    assert lr_at(50, 100, cfg) == 1.0 and lr_at(79, 100, cfg) == 1.0
    assert lr_at(89, 100, cfg) == pytest.approx(1.0 - 0.9 * 10 / 20)
    assert lr_at(99, 100, cfg) == pytest.approx(0.1)


def test_constant_after_warmup():
    assert lr_at(500, 1000, optim(schedule="constant")) == 1.0


def test_weight_decay_shrinks_the_matrices_and_leaves_the_norm_gains():
    """AdamW's groups: decay on every matrix (embeddings included), none on the 1-D norm gains. With
    zero gradients Adam's update is 0/ε = 0, so one step is the decay alone: w·(1 − lr·wd) exactly."""
    import torch

    from ultratron.config import ModelConfig
    from ultratron.models.registry import build_model
    from ultratron.training.optim import build_optimizer

    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=None, n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                    vocab_size=64, max_seq_len=16, tie_embeddings=False, rope_theta=10_000.0))
    from ultratron.config.training import OptimConfig

    optimizer = build_optimizer(model, OptimConfig(lr=0.5, weight_decay=0.1))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    shapes = {name: p.dim() for name, p in model.named_parameters()}
    assert sorted(set(shapes.values())) == [1, 2]  # both kinds are there
    for name, p in model.named_parameters():
        expected = before[name] * (1 - 0.5 * 0.1) if p.dim() >= 2 else before[name]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7, msg=name)
