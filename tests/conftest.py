import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """About 400 kB of real Python: standard-library modules copied into a directory."""
    src = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    names = ["argparse.py", "collections/__init__.py", "json/decoder.py", "json/encoder.py", "textwrap.py",
             "string.py", "heapq.py", "bisect.py", "functools.py", "shlex.py", "fractions.py", "statistics.py",
             "dataclasses.py", "enum.py", "pprint.py", "difflib.py", "csv.py", "glob.py", "fnmatch.py",
             "copy.py", "queue.py", "random.py", "calendar.py", "configparser.py"]
    for name in names:
        dest = out / name.replace("/", "_")
        shutil.copy(src / name, dest)
    return out


# A model and batch small enough that a training step takes milliseconds on one core.
TINY = [
    "--model.preset", "tiny", "--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
    "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "512",
    "--training.seq_len", "64", "--training.micro_batch_size", "4", "--training.batch_tokens", "512",
    "--training.progress", "false", "--training.sample_tokens", "0", "--run.tensorboard", "false",
    "--data.held_out_fraction", "0.1",
]


@pytest.fixture
def tiny_overrides(small_corpus, tmp_path) -> list[str]:
    return TINY + ["--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(tmp_path / "run")]


def run_cli(*args: str, cwd=None):
    """Run `python -m ultratron ARGS` in a subprocess; returns the CompletedProcess."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "ultratron", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


class Counter:
    """A minimal Stateful (a step count) for checkpoint tests."""

    def __init__(self, step=0):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]
