import shutil
import socket
import sys
import sysconfig
import uuid
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


def losses(run_dir) -> dict[int, float]:
    """A run's training loss by step, from its metrics."""
    from ultratron.training.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


S3_BUCKET = f"test-{uuid.uuid4().hex[:8]}"  # moto keeps buckets for the life of the process


class S3Server:
    """moto's S3 server in a thread on loopback, reached through s3fs exactly as a cluster reaches S3
    or MinIO (not a mock of the client); stop() and start() keep its objects (they live in this process)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self._make = lambda: ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = None

    def start(self):
        self.server = self._make()
        self.server.start()

    def stop(self):
        self.server.stop()


@pytest.fixture
def s3(monkeypatch):
    """(the server, an s3fs filesystem on it); the bucket S3_BUCKET exists and is empty: moto keeps a
    process's objects across servers, and two tests on one worker must not read each other's files."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    server = S3Server()
    server.start()
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=server.endpoint)
    if not fs.exists(S3_BUCKET):
        fs.mkdir(S3_BUCKET)
    left = fs.find(S3_BUCKET)
    if left:
        fs.rm(left)
        fs.invalidate_cache()
    yield server, fs
    server.stop()


# The files that take longest on CI's 2 cores, heaviest first (seconds: the last fresh-clone run's
# --durations, whole file, before run_local forked its ranks; the order also holds in a side-by-side
# run since, where the simulate file gained least). `make test` hands files to its two xdist workers
# in this order, then the rest as xdist orders them (most tests first): one of these started last
# would run alone at the end while the other worker idles. Keep it in step with the slowest files
# that `make test`'s --durations report.
HEAVIEST_FIRST = [
    "tests/distributed/test_dist_pipeline.py",        # ~380: launches of 2, 4 and 8 ranks
    "tests/test_readme.py",                           # ~300: every README command, torchrun included
    "tests/distributed/test_dist_simulate.py",        # ~170
    "tests/distributed/test_dist_cp_ep.py",           # ~210
    "tests/distributed/test_dist_combinations.py",    # ~180
    "tests/test_simulate_scale.py",                   # ~145
    "tests/bench/test_gpu_check.py",                  # ~150 (load average 12): the tiny GPU check, compile included
    "tests/distributed/test_dist_equivalence.py",     # ~140
    "tests/distributed/test_dist_start_at_scale.py",  # ~100: a ~0.95 GB model on 4 ranks
    "tests/test_fp8.py",                              # ~70
    "tests/distributed/test_dist_remote_data.py",     # ~50 (load average 12): curate to S3, dp2, kill, dp4, dp1
]
_HEAVIEST_RANK = {name: i for i, name in enumerate(HEAVIEST_FIRST)}


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist, which the test extra installs)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class HeaviestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            first = min(self.workqueue, key=lambda scope: _HEAVIEST_RANK.get(scope, len(_HEAVIEST_RANK)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node):
            # xdist hands a worker its next file when two of its tests are left, so a file of two
            # tests takes a second file at once; here only when its last test is left (a worker
            # runs a test once it holds the next one)
            if self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return HeaviestFirst(config, log)
