"""A short real training run: what lands in the run directory, and what the user sees."""

import json

import pytest

from conftest import run_cli
from ultratron.config import load_config
from ultratron.training.trainer import train

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu"}


def test_run_directory_contents_and_metrics(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides + ["--training.steps", "30", "--eval.interval", "15",
                                              "--checkpoint.interval", "10", "--checkpoint.keep", "2",
                                              "--run.tensorboard", "true", "--training.sample_tokens", "20"])
    result = train(cfg, echo=False)
    run = tmp_path / "run"
    assert (run / "config.toml").is_file() and load_config(run / "config.toml") == cfg
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert all(METRIC_KEYS <= set(r) for r in steps)
    assert all(r["grad_norm"] > 0 and 0 < r["mfu"] < 1 for r in steps)
    assert [r["step"] for r in records if "val_loss" in r] == [0, 15, 30]
    assert result.final_val_loss < result.first_val_loss
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    # warmup then decay to the floor: lr peaks at the end of warmup
    lrs = [r["lr"] for r in steps]
    assert lrs.index(max(lrs)) == cfg.optim.warmup_steps - 1 and lrs[-1] == pytest.approx(cfg.optim.lr * 0.1)
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert ckpts == ["step-0000020", "step-0000030"]  # keep=2 pruned step 10
    assert (run / "checkpoints/latest").read_text().strip() == "step-0000030"
    assert list((run / "tensorboard").glob("events.out.tfevents*"))
    assert result.sample and result.sample.startswith("def")


def test_gradient_clipping_logs_the_norm_before_clipping(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides + ["--training.steps", "3", "--eval.interval", "0",
                                              "--training.grad_clip", "0.01"])
    result = train(cfg, echo=False)
    from ultratron.training.metrics import read_metrics

    norms = [r["grad_norm"] for r in read_metrics(result.run_dir)]
    assert min(norms) > 0.1  # well above the clip threshold: the logged norm is pre-clip


def test_bf16_tracks_fp32(tiny_overrides, tmp_path):
    base = tiny_overrides + ["--training.steps", "5", "--eval.interval", "0"]
    a = train(load_config(None, base + ["--run.dir", str(tmp_path / "a")]), echo=False)
    b = train(load_config(None, base + ["--run.dir", str(tmp_path / "b"), "--training.precision", "bf16"]),
              echo=False)
    assert abs(a.final_loss - b.final_loss) < 0.05


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_training(tiny_overrides, tmp_path, mode):
    base = tiny_overrides + ["--training.steps", "3", "--eval.interval", "0"]
    a = train(load_config(None, base + ["--run.dir", str(tmp_path / "a")]), echo=False)
    b = train(load_config(None, base + ["--run.dir", str(tmp_path / "b"), "--training.recompute", mode]),
              echo=False)
    assert abs(a.final_loss - b.final_loss) <= 1e-6


def test_train_and_report_from_the_command_line(tiny_overrides, tmp_path):
    # progress on (the default) but output to a pipe, as under CI, nohup or Slurm: plain lines only
    result = run_cli("train", *tiny_overrides, "--training.steps", "10", "--eval.interval", "5",
                     "--training.progress", "true", "--training.log_interval", "5")
    assert result.returncode == 0, result.stderr
    assert "trained to step 10" in result.stdout
    assert "\r" not in result.stderr and "\r" not in (tmp_path / "run" / "train.log").read_text()
    step_lines = [line for line in result.stderr.splitlines() if "] step " in line and " grad_norm " in line]
    assert [line.split("] step ")[1].split(":")[0] for line in step_lines] == ["5", "10"]
    report = run_cli("report", str(tmp_path / "run"))
    assert report.returncode == 0, report.stderr
    png = tmp_path / "run" / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_training_reads_a_prepared_shard_directory_directly(tiny_overrides, tmp_path):
    first = train(load_config(None, tiny_overrides + ["--training.steps", "2", "--eval.interval", "0"]), echo=False)
    prepared = first.run_dir / "data"  # tokenizer.json + train/ + val/, the same layout `ultratron data` writes
    cfg = load_config(None, tiny_overrides + ["--training.steps", "2", "--eval.interval", "1",
                                              "--data.path", str(prepared), "--run.dir", str(tmp_path / "again")])
    again = train(cfg, echo=False)
    assert not (tmp_path / "again" / "data").exists()  # nothing was re-tokenized
    assert again.final_val_loss is not None
    assert abs(again.first_loss - first.first_loss) < 1e-6  # same data, same seed, same first step
