"""training.compile: each transformer block compiled, the losses equal to eager's."""

from ultratron.config import load_config
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import train

ONE_LAYER = ["--model.n_layers", "1", "--training.steps", "5", "--eval.interval", "0"]


def test_compiled_blocks_train_like_eager(tiny_overrides, tmp_path):
    losses = {}
    for mode in ("false", "true"):
        cfg = load_config(None, tiny_overrides + ONE_LAYER + ["--training.compile", mode,
                                                              "--run.dir", str(tmp_path / mode)])
        result = train(cfg, echo=False)
        assert result.steps_done == 5
        losses[mode] = [r["loss"] for r in read_metrics(cfg.run.dir) if "loss" in r]
    assert len(losses["true"]) == 5
    for eager, compiled in zip(losses["false"], losses["true"], strict=True):
        assert abs(compiled - eager) <= 1e-4 * abs(eager), (losses)
    assert losses["true"][-1] < losses["true"][0]  # it trained


def test_compile_wraps_each_block_and_checkpoint_names_stay_plain(tiny_overrides):
    import torch

    from ultratron.checkpoint.state import ModelState
    from ultratron.models.llama.model import build_model
    from ultratron.models.registry import plan_of
    from ultratron.parallel.compile import apply_compile

    model = build_model(load_config(None, tiny_overrides).model, torch.device("cpu"))
    plain = set(ModelState(model).state_dict()["model"])
    apply_compile(model, True, plan_of(model))  # (compiles lazily: nothing runs here)
    blocks = plan_of(model).blocks(model)
    assert len(blocks) == 2 and all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in blocks.values())
    assert any("_orig_mod." in name for name in model.state_dict())
    assert set(ModelState(model).state_dict()["model"]) == plain
