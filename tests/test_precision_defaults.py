"""What runs where (issue 45, part 3): training.precision auto, the default, is bf16 on a GPU and fp32
on a CPU; a GPU's fp32 matmuls run in TF32. On this CPU the GPU is stood in for where it matters:
the config's guess (the driver's GPU list) and the device the trainer picks."""

import subprocess
import sys

import pytest
import torch

from ultratron.config import load_config
from ultratron.config import precision as config_training
from ultratron.training.precision import configure_matmuls, settle_precision


@pytest.mark.parametrize("gpu, device, expected", [
    (False, "auto", "fp32"), (True, "auto", "bf16"),  # the default device: whether a GPU is visible
    (True, "cpu", "fp32"), (False, "cuda", "bf16"),  # a device named: its own
])
def test_auto_is_bf16_on_a_gpu_and_fp32_on_a_cpu(monkeypatch, gpu, device, expected):
    monkeypatch.setattr(config_training, "gpu_visible", lambda: gpu)
    cfg = load_config(None, ["--training.device", device])
    assert cfg.training.precision == cfg.layout.precision == expected


def test_a_precision_given_is_kept(monkeypatch):
    monkeypatch.setattr(config_training, "gpu_visible", lambda: True)
    cfg = load_config(None, ["--training.precision", "fp32"])
    assert cfg.training.precision == "fp32"
    settle_precision(cfg.training, torch.device("cuda"))
    assert cfg.training.precision == "fp32"


@pytest.mark.parametrize("guess, device, expected", [(True, "cpu", "fp32"), (False, "cuda", "bf16")])
def test_the_trainer_settles_auto_on_the_device_it_picked(monkeypatch, guess, device, expected):
    """The driver said there is a GPU but torch has none (a CPU build), and the other way round."""
    monkeypatch.setattr(config_training, "gpu_visible", lambda: guess)
    cfg = load_config(None, [])
    assert settle_precision(cfg.training, torch.device(device)) == expected == cfg.training.precision


def test_hidden_gpus_are_not_visible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not config_training.gpu_visible()


def test_help_shows_auto():
    out = subprocess.run([sys.executable, "-m", "ultratron", "train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("--training.precision"))
    assert "(\"auto\")" in line and "bf16 on a GPU, fp32 on a CPU" in line


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_tf32_for_fp32_matmuls_on_a_gpu_only(matmul_precision):
    configure_matmuls(torch.device("cpu"))
    assert torch.get_float32_matmul_precision() == "highest"  # a CPU's fp32 matmuls stay fp32
    configure_matmuls(torch.device("cuda", 0))
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32
