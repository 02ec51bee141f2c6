"""Shared setup of the multi-process tests: one tokenized corpus for every run, one-process
reference runs, a helper that launches N ranks running several training runs in a row, and the one
comparison every layout passes against one process (`assert_equivalent`).
(Not a conftest.py: a second module named conftest would shadow tests/conftest.py for the
modules that import from it.) Test modules import the fixtures by their *_fixture names.

What "equal to one process" means, and where each tolerance comes from: tests/tolerances.py
(LAYOUTS), the suite's one derivation.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tolerances import LAYOUTS
from ultratron.config import load_config
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import train


def _root_conftest():
    # tests/conftest.py holds TINY; it is imported by file so this module's name cannot shadow it.
    spec = importlib.util.spec_from_file_location("_ultratron_root_conftest", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = _root_conftest().TINY
STEPS = 6
WARMUP = 2
CLIP = 0.25
_SESSION: dict = {}
# batch 1024 tokens = 16 sequences of 64: one process accumulates 4 micro-batches of 4, dp2 runs 2
# per rank (so no_sync / set_requires_gradient_sync are exercised) and dp4 runs one. Two warmup
# steps of six, so that most steps run the decaying schedule, and a clip below every step's gradient
# norm (0.4-0.7 here), so that clipping scales every update; validation at steps 0 and 6 on two
# micro-batches; every run ends with a checkpoint, whose weights are compared too.
BATCH = ["--training.batch_tokens", "1024", "--training.steps", str(STEPS), "--optim.warmup_steps", str(WARMUP),
         "--training.grad_clip", str(CLIP), "--eval.interval", str(STEPS), "--eval.batches", "2"]


def records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


def assert_equivalent(run_dir: Path, reference_dir: Path, precision: str, name: str, first_step: int = 1,
                      weights: bool = True) -> None:
    """`run_dir` trained like the one-process `reference_dir`: every step logged once (from
    `first_step`, after a resume), the same losses, gradient norms (before clipping; every step was
    clipped), validation losses and, with `weights`, the same final weights (module docstring);
    a mixture of experts also routes slot for slot as one process and reports the same balancing loss."""
    tol = LAYOUTS[precision]
    got, expected = read_metrics(run_dir), {r["step"]: r for r in read_metrics(reference_dir) if "step" in r}
    steps = [r for r in got if "loss" in r]
    assert [r["step"] for r in steps] == list(range(first_step, STEPS + 1)), f"{name}: each step logged once"
    gaps = {"loss": 0.0, "grad_norm": 0.0, "val_loss": 0.0}
    for mine in got:
        ref = expected[mine["step"]]
        for key in gaps:
            if key in mine:
                gap = abs(mine[key] - ref[key]) / abs(ref[key])
                gaps[key] = max(gaps[key], gap)
                assert gap <= tol[key], (name, precision, key, mine, ref)
        if "moe_load" in ref and "loss" in mine:
            assert mine["moe_load"] == ref["moe_load"], (name, mine["step"])
            assert abs(mine["moe_aux_loss"] - ref["moe_aux_loss"]) <= tol["loss"] * ref["moe_aux_loss"], name
    validated = [r["step"] for r in got if "val_loss" in r]
    assert validated == ([0] if first_step == 1 else []) + [STEPS], (name, validated)
    if weights:
        gaps["weights"] = weights_gap(run_dir, reference_dir)
        assert gaps["weights"] <= tol["weights"], (name, precision, gaps)
    print(f"{name} ({precision}): " + ", ".join(f"{k} within {v:.1e}" for k, v in gaps.items()))
    reference_steps = [expected[s] for s in range(1, STEPS + 1)]
    assert reference_steps[-1]["loss"] < reference_steps[0]["loss"]  # the runs learn: agreement is not trivial
    assert all(r["grad_norm"] > CLIP for r in reference_steps)  # and every step was clipped

def launch(world: int, runs: list[list[str]]) -> None:
    from dist_jobs import train_runs

    from ultratron.launch.local import run_local

    run_local(world, train_runs, runs)


@pytest.fixture(scope="session", name="dist_base")
def dist_base_fixture(small_corpus, tmp_path_factory) -> list[str]:
    if "dist_base" in _SESSION:
        return _SESSION["dist_base"]
    data = tmp_path_factory.mktemp("dist-data")
    base = TINY + BATCH + ["--data.path", str(small_corpus), "--data.extensions", ".py", "--data.cache_dir", str(data)]
    _SESSION["dist_base"] = base
    return base


@pytest.fixture(scope="session", name="references")
def references_fixture(dist_base, tmp_path_factory) -> dict[str, Path]:
    """The run directories of one-process runs in fp32 and bf16 (these also tokenize the corpus for
    everyone else). Each test module imports this fixture, so it runs once per session."""
    if "references" in _SESSION:
        return _SESSION["references"]
    out = _SESSION["references"] = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path_factory.mktemp(f"ref-{precision}")
        train(load_config(None, dist_base + ["--training.precision", precision, "--run.dir", str(run)]), echo=False)
        out[precision] = run
        assert [r["step"] for r in records(run)] == list(range(1, STEPS + 1))
    return out


def weights_gap(run_dir: Path, reference_dir: Path, tensors_of=None) -> float:
    """The largest, over weight tensors, of |W_run − W_ref| / |W_ref − W_init| (Frobenius norms) for
    the final checkpoints: the weights' disagreement as a share of how far the reference moved them.
    `tensors_of`: run directory → the tensors compared, by name (default: its whole model)."""
    from ultratron.checkpoint.inference import load_for_inference

    whole = tensors_of is None
    tensors_of = tensors_of or (lambda run: load_for_inference(run).model.state_dict())
    got, expected = tensors_of(run_dir), tensors_of(reference_dir)
    initial = initial_weights(reference_dir)
    assert set(got) == set(expected) and (set(expected) == set(initial) if whole else set(expected) <= set(initial))
    return max(float((got[key] - ref).norm()) / float((ref - initial[key]).norm()) for key, ref in expected.items())


def initial_weights(reference_dir: Path) -> dict:
    """The weights the reference run started from: its config's trainer, built again elsewhere."""
    import tempfile

    from ultratron.config import load_config
    from ultratron.training.trainer import Trainer

    key = ("initial", str(reference_dir))
    if key not in _SESSION:
        cfg = load_config(Path(reference_dir) / "config.toml")
        cfg.run.dir = tempfile.mkdtemp(prefix="initial-")
        _SESSION[key] = {k: v.detach().clone() for k, v in Trainer(cfg, echo=False).model.state_dict().items()}
    return _SESSION[key]
