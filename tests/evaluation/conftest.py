"""One briefly trained tiny checkpoint shared by the evaluation, export and serving tests."""

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# Brief, but long enough to learn from: many small steps at a high learning rate learn fastest
# (the quickstart's finding), with the model's whole 128-token context in every sequence so it
# learns to read the several previous lines the next-line task gives it.
TRAIN_STEPS = 500
TRAIN = ["--training.steps", str(TRAIN_STEPS), "--training.batch_tokens", "2048", "--training.micro_batch_size", "16",
         "--training.seq_len", "128", "--optim.lr", "3e-3", "--optim.warmup_steps", "20"]
# The root conftest's TINY model, with a 128-token context.
TINY = [
    "--model.preset", "tiny", "--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
    "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "512", "--model.max_seq_len", "128",
    "--training.seq_len", "64", "--training.micro_batch_size", "4", "--training.batch_tokens", "512",
    "--training.progress", "false", "--training.sample_tokens", "0", "--run.tensorboard", "false",
    "--data.held_out_fraction", "0.1",
]


@pytest.fixture(scope="session")
def trained_run(small_corpus, tmp_path_factory) -> Path:
    from ultratron.config import load_config
    from ultratron.training.trainer import train

    run = tmp_path_factory.mktemp("evalrun") / "run"
    overrides = TINY + ["--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run),
                        "--eval.interval", "0", *TRAIN]
    train(load_config(None, overrides), echo=False)
    return run


@pytest.fixture(scope="session")
def trained_checkpoint(trained_run) -> Path:
    from ultratron.checkpoint.store import resolve_checkpoint_dir

    return resolve_checkpoint_dir(trained_run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("server did not become healthy")


@pytest.fixture(scope="session")
def served(trained_checkpoint):
    """`ultratron serve` on a loopback port with an API key; yields (base_url, key)."""
    port, key = free_port(), "test-key-123"
    proc = subprocess.Popen([sys.executable, "-m", "ultratron", "serve", "--checkpoint", str(trained_checkpoint),
                             "--port", str(port), "--api-key", key, "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, key
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
