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
