"""training.compile: each transformer block compiled, the losses equal to eager's."""

import pytest

from tolerances import KERNELS_LOSS, relative_gap
from ultratron.config import load_config
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import train

ONE_LAYER = ["--model.n_layers", "1", "--training.steps", "5", "--eval.interval", "0"]


@pytest.mark.parametrize("loss_chunk", ["0", "100"])  # (100: the chunked loss after compiled blocks)
def test_compiled_blocks_train_like_eager(tiny_overrides, tmp_path, loss_chunk):
    losses = {}
    for mode in ("false", "true"):
        cfg = load_config(None, tiny_overrides + ONE_LAYER + ["--training.compile", mode, "--training.loss_chunk",
                                                              loss_chunk, "--run.dir", str(tmp_path / mode)])
        result = train(cfg, echo=False)
        assert result.steps_done == 5
        losses[mode] = [r["loss"] for r in read_metrics(cfg.run.dir) if "loss" in r]
    assert len(losses["true"]) == 5
    for eager, compiled in zip(losses["false"], losses["true"], strict=True):
        assert relative_gap(compiled, eager) <= KERNELS_LOSS, (losses)
    assert losses["true"][-1] < losses["true"][0]  # it trained


def test_compile_wraps_each_block_and_checkpoint_names_stay_plain(tiny_overrides):
    import torch

    from ultratron.checkpoint.state import ModelState
    from ultratron.models.registry import build_model, plan_of
    from ultratron.parallel.compile import apply_compile

    model = build_model(load_config(None, tiny_overrides).model, torch.device("cpu"))
    plain = set(ModelState(model).state_dict()["model"])
    apply_compile(model, True, plan_of(model))  # (compiles lazily: nothing runs here)
    blocks = plan_of(model).blocks(model)
    assert len(blocks) == 2 and all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in blocks.values())
    assert any("_orig_mod." in name for name in model.state_dict())
    assert set(ModelState(model).state_dict()["model"]) == plain


def test_rope_under_compile_equals_the_eager_complex_form():
    """Compiled blocks take apply_rope's real-valued branch (Inductor fuses it; it has no complex
    code generation); it must rotate exactly as the eager complex product does, forward and backward."""
    import torch

    from ultratron.models.llama.model import apply_rope, rope_tables

    torch.manual_seed(0)
    cos, sin = rope_tables(16, 32, 10000.0)
    x = torch.randn(2, 12, 3, 16)
    positions = torch.randint(0, 32, (2, 12))  # rows at their own positions: (batch, seq, half) tables
    for c, s in ((cos[:12], sin[:12]), (cos[positions], sin[positions])):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager = apply_rope(a, c, s)
        compiled = torch.compile(apply_rope, fullgraph=True)(b, c, s)
        assert torch.allclose(compiled, eager, atol=1e-6, rtol=0)
        assert not torch.equal(eager, x)  # it rotated
        weights = torch.randn_like(eager)
        (eager * weights).sum().backward()
        (compiled * weights).sum().backward()
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=0)


def test_the_training_loss_is_compiled_only_with_compile_and_whole_logits():
    import torch

    from ultratron.parallel.dims import ParallelDims
    from ultratron.parallel.parallelize import Parallel
    from ultratron.training.loss import cross_entropy

    one, tp2 = Parallel(None, None, ParallelDims()), Parallel(None, None, ParallelDims(tp=2))
    assert one.compiled_loss(cross_entropy, False) is cross_entropy
    assert tp2.compiled_loss(cross_entropy, True) is cross_entropy  # loss_parallel's DTensors stay eager
    fn = one.compiled_loss(cross_entropy, True)
    assert fn is not cross_entropy
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 8, 50), torch.randint(0, 50, (2, 8))
    for z in (0.0, 1e-4):
        got, want = fn(logits, targets, z), cross_entropy(logits, targets, z)
        assert all(torch.allclose(g, w, rtol=1e-6) for g, w in zip(got, want, strict=True))
