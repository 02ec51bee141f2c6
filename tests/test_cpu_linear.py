"""training.cpu_linear: fp32 linear layers through oneDNN's matmul give F.linear's values and
gradients, train like torch's own kernel, and step aside wherever they do not apply."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tolerances import KERNELS_LOSS, relative_gap
from ultratron.config import load_config
from ultratron.errors import ConfigError
from ultratron.kernels.cpu_linear import OneDNNLinear, apply_cpu_linear, onednn_linear, probe
from ultratron.models.registry import build_model
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import Trainer, train

pytestmark = pytest.mark.skipif(probe() is not None, reason=f"oneDNN's linear unavailable here: {probe()}")


def _close(a, b, tol=1e-5):
    a, b = a.detach(), b.detach()
    return torch.allclose(a, b, rtol=tol, atol=tol * float(b.abs().max()))


@pytest.mark.parametrize("transposed", [False, True])
def test_the_op_equals_f_linear_forward_and_backward(transposed):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 33, 80, generator=gen)
    if transposed:  # a non-contiguous input, as a transpose in the model would give
        x = torch.randn(4, 80, 33, generator=gen).transpose(1, 2)
    x.requires_grad_(True)
    w = torch.randn(56, 80, generator=gen, requires_grad=True)
    g = torch.randn(4, 33, 56, generator=gen)
    ours = onednn_linear(x, w)
    ref = F.linear(x, w)
    assert ours.shape == ref.shape == (4, 33, 56) and _close(ours, ref)
    for a, b in zip(torch.autograd.grad(ours, (x, w), g), torch.autograd.grad(ref, (x, w), g), strict=True):
        assert a.shape == b.shape and _close(a, b)


def test_swap_keeps_the_state_and_steps_aside_where_it_does_not_apply(tiny_overrides):
    cfg = load_config(None, tiny_overrides)
    model = build_model(cfg.model, torch.device("cpu"))
    names = {k: v.clone() for k, v in model.state_dict().items()}
    weights = {name: m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    apply_cpu_linear(model, "onednn", tp=1)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert linears.keys() == weights.keys() and all(type(m) is OneDNNLinear for m in linears.values())
    # each new layer holds the old one's own parameter: optimizer, tied weights and names unchanged
    assert all(linears[name].weight is weight for name, weight in weights.items())
    if cfg.model.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    assert model.state_dict().keys() == names.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in names.items())
    layer = next(iter(linears.values()))
    x = torch.randn(2, 5, layer.in_features)
    assert _close(layer(x), F.linear(x, layer.weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 autocast: torch's own (bf16) linear
        assert layer(x).dtype == torch.bfloat16
    as_double = apply_cpu_linear(nn.Sequential(nn.Linear(layer.in_features, 3, bias=False).double()), "onednn",
                                 tp=1)[0]
    assert type(as_double) is OneDNNLinear
    assert _close(as_double(x.double()), F.linear(x.double(), as_double.weight), tol=1e-12)  # other dtypes: F.linear
    with_bias = apply_cpu_linear(nn.Sequential(nn.Linear(8, 4)), "onednn", tp=1)[0]
    assert type(with_bias) is nn.Linear  # only bias-free layers change


def test_onednn_refuses_with_a_reason_and_aten_leaves_the_model_alone(tiny_overrides):
    cfg = load_config(None, tiny_overrides)
    model = build_model(cfg.model, torch.device("cpu"))
    with pytest.raises(ConfigError, match="training.cpu_linear = onednn: tensor parallel"):
        apply_cpu_linear(model, "onednn", tp=2)
    for tp in (1, 2):
        apply_cpu_linear(model, "aten", tp=tp)
        assert not any(type(m) is OneDNNLinear for m in model.modules())


def test_training_with_onednn_equals_aten_within_1e_4(tiny_overrides, tmp_path):
    losses = {}
    for mode in ("aten", "onednn"):
        cfg = load_config(None, tiny_overrides + ["--training.cpu_linear", mode, "--training.steps", "5",
                                                  "--eval.interval", "0", "--run.dir", str(tmp_path / mode)])
        assert train(cfg, echo=False).steps_done == 5
        losses[mode] = [r["loss"] for r in read_metrics(cfg.run.dir) if "loss" in r]
    assert len(losses["onednn"]) == 5
    for aten, ours in zip(losses["aten"], losses["onednn"], strict=True):
        assert relative_gap(ours, aten) <= KERNELS_LOSS, losses
    assert losses["onednn"][-1] < losses["onednn"][0]
    # opt-in: the trainer's default keeps torch's kernel
    trainer = Trainer(load_config(None, tiny_overrides + ["--run.dir", str(tmp_path / "default")]), echo=False)
    assert trainer.cfg.training.cpu_linear == "aten"
    assert not any(type(m) is OneDNNLinear for m in trainer.model.modules())
