"""Exact resume: 2K steps in one run equal K steps, stop, resume, K more."""

from conftest import losses
from tolerances import replayed
from ultratron.config import load_config
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import train

K = 4



def test_resume_reproduces_the_uninterrupted_run(tiny_overrides, tmp_path):
    common = tiny_overrides + ["--training.steps", str(2 * K), "--eval.interval", "0",
                               "--data.cache_dir", str(tmp_path / "data")]
    full = load_config(None, common + ["--run.dir", str(tmp_path / "full")])
    train(full, echo=False)

    first = load_config(None, common + ["--run.dir", str(tmp_path / "split"), "--training.stop_after", str(K)])
    result = train(first, echo=False)
    assert result.steps_done == K and (tmp_path / "split/checkpoints/latest").read_text().strip() == "step-0000004"

    second = load_config(None, common + ["--run.dir", str(tmp_path / "split"), "--checkpoint.resume", "auto"])
    assert train(second, echo=False).steps_done == 2 * K

    expected, got = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert sorted(got) == list(range(1, 2 * K + 1))  # each step logged once
    for step in range(K + 1, 2 * K + 1):
        assert replayed(got[step], expected[step]), (step, got[step], expected[step])
    # and the run did learn something, so equality is not the trivial kind
    assert expected[2 * K] < expected[1]


def test_resume_after_a_crash_drops_the_steps_logged_past_the_checkpoint(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    common = tiny_overrides + ["--training.steps", "6", "--eval.interval", "0", "--run.dir", str(run)]
    train(load_config(None, common + ["--checkpoint.interval", "2", "--training.stop_after", "3"]), echo=False)
    # stop_after=3 saved at 2 (interval) and 3 (stop); remove step 3 as if the crash came before it
    import shutil

    shutil.rmtree(run / "checkpoints/step-0000003")
    train(load_config(None, common + ["--checkpoint.resume", "auto"]), echo=False)
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_fresh_start_refuses_to_overwrite_checkpoints(tiny_overrides, tmp_path):
    from ultratron.errors import CheckpointError

    common = tiny_overrides + ["--training.steps", "2", "--eval.interval", "0"]
    train(load_config(None, common), echo=False)
    import pytest

    with pytest.raises(CheckpointError, match="already holds checkpoints.*--checkpoint.resume auto"):
        train(load_config(None, common), echo=False)
