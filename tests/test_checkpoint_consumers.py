"""`eval`, `serve` and `export` read a checkpoint from an object store as training writes it
(moto's S3 server on loopback, through s3fs), and two `serve` on one machine both start, each on
a free port it prints."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from conftest import S3_BUCKET as BUCKET
from ultratron.checkpoint.inference import load_for_inference
from ultratron.cli import main
from ultratron.config import load_config
from ultratron.training.trainer import train


@pytest.fixture
def s3_run(s3, tiny_overrides):
    server, _ = s3
    url = f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:8]}"  # moto keeps objects for the life of this process
    train(load_config(None, tiny_overrides + ["--eval.interval", "0", "--training.steps", "2", "--checkpoint.dir", url,
                                              "--checkpoint.endpoint", server.endpoint]), echo=False)
    return url, server.endpoint


def test_eval_and_export_read_a_checkpoint_from_s3(s3_run, tmp_path, capsys):
    url, endpoint = s3_run
    loaded = load_for_inference(url, endpoint=endpoint)  # the checkpoints root: its latest checkpoint
    assert loaded.step == 2 and str(loaded.checkpoint_dir) == f"{url}/step-0000002"
    same = load_for_inference(f"{url}/step-0000002", endpoint=endpoint).model.state_dict()
    assert all((same[k] == v).all() for k, v in loaded.model.state_dict().items())

    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", url, "--checkpoint-endpoint", endpoint, "--tasks", "builtin",
                 "--max-examples", "2", "--json", str(out), "--quiet"]) == 0
    result = json.loads(out.read_text())
    assert result["step"] == 2 and result["checkpoint"] == url

    assert main(["export", "hf", "--checkpoint", f"{url}/latest", "--checkpoint-endpoint", endpoint,
                 "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert f"exported {url}/step-0000002" in capsys.readouterr().out


def _port(proc: subprocess.Popen, deadline: float) -> int:
    """The port a starting `ultratron serve` prints (it binds before printing)."""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}")
        if line.startswith("serving "):
            return int(line.split("http://127.0.0.1:")[1].split("/")[0])
    raise AssertionError("serve printed no address")


def test_two_servers_from_s3_on_one_machine_both_start(s3_run):
    url, endpoint = s3_run
    procs = [subprocess.Popen([sys.executable, "-m", "ultratron", "serve", "--checkpoint", url, "--checkpoint-endpoint",
                               endpoint, "--threads", "1", "--max-batch", "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        ports = [_port(proc, deadline) for proc in procs]
        assert ports[0] != ports[1] and 0 not in ports
        for port in ports:
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                        assert resp.status == 200
                        break
                except OSError:
                    assert time.monotonic() < deadline, "a server never answered"
                    time.sleep(0.2)
            body = json.dumps({"model": "ultratron", "prompt": "def", "max_tokens": 3}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                assert json.loads(resp.read())["usage"]["completion_tokens"] >= 1
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
