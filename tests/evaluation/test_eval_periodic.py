"""Task evaluation during training runs in a child process (local, or through a configured
OpenAI-compatible endpoint) and does not stall the loop."""

import json
import os
import re
import socket
import statistics
import sysconfig
import threading
import time
from pathlib import Path

import pytest

from ultratron.checkpoint.store import step_dir_name
from ultratron.config import load_config
from ultratron.evaluation.backends import LocalBackend
from ultratron.evaluation.runner import evaluate
from ultratron.evaluation.tasks import load_task_file
from ultratron.training import metrics as metrics_module
from ultratron.training.trainer import train

from .conftest import TINY, free_port


def _quick_task(tmp_path):
    task = tmp_path / "quick.jsonl"
    task.write_text("\n".join(json.dumps({"type": "multiple_choice", "context": f"x{i} = ",
                                          "choices": [str(i), "~~"], "answer": 0}) for i in range(4)) + "\n")
    return task


def _text_task(tmp_path):
    """A held-out text scored in bits per byte: a number that moves with every update of the model."""
    task = tmp_path / "prose.jsonl"
    if not task.exists():
        source = Path(sysconfig.get_paths()["stdlib"]) / "json" / "scanner.py"  # not in the training corpus
        task.write_text(json.dumps({"type": "text", "text": source.read_text()[:3000]}) + "\n")
    return task


def _train_with_stamps(monkeypatch, overrides):
    """Train; return [(monotonic time, record)] for every metrics record, in write order."""
    stamps = []
    original = metrics_module.MetricsWriter.write
    monkeypatch.setattr(metrics_module.MetricsWriter, "write",
                        lambda self, record: (stamps.append((time.monotonic(), record)), original(self, record)))
    train(load_config(None, overrides), echo=False)
    return stamps


def _step_gaps(stamps, eval_steps, key, last):
    """Gaps between consecutive training steps while an evaluation was running, and otherwise."""
    train_times = {rec["step"]: t for t, rec in stamps if "loss" in rec}
    assert sorted(train_times) == list(range(1, last + 1))  # every step trained
    done = {rec["step"]: t for t, rec in stamps if key in rec}
    during, outside = [], []
    for step in range(2, last + 1):
        running = any(s < step and done[s] > train_times[step] for s in eval_steps)
        (during if running else outside).append(train_times[step] - train_times[step - 1])
    return during, outside


def test_periodic_evaluation_records_results_without_stalling(small_corpus, tmp_path, monkeypatch):
    task = _quick_task(tmp_path)
    run = tmp_path / "run"
    stamps = _train_with_stamps(monkeypatch, TINY + [
        "--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run),
        "--training.steps", "160", "--eval.interval", "0", "--eval.task_interval", "40",
        "--eval.tasks", f"{task},{_text_task(tmp_path)}", "--checkpoint.interval", "80", "--checkpoint.keep", "5"])
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/quick/acc" in r]
    steps = [r["step"] for r in evals]
    assert steps and all(s % 40 == 0 for s in steps) and 160 in steps  # the end waits for its evaluation
    # each result is that step's model evaluated: the numbers an offline evaluation of the checkpoint
    # saved at that step gives (steps 80 and 160; 40 and 120 were snapshots of the live model)
    texts = [r["eval/prose/bits_per_byte"] for r in evals]
    assert len(texts) == len(evals) and all(a > b for a, b in zip(texts, texts[1:], strict=False))  # learns
    for r in evals:
        if r["step"] % 80 == 0:
            backend = LocalBackend.from_checkpoint(run / "checkpoints" / step_dir_name(r["step"]))
            offline = evaluate(backend, [load_task_file(task), load_task_file(_text_task(tmp_path))])
            assert (r["eval/quick/acc"], r["eval/quick/acc_norm"]) == (offline["quick"]["acc"],
                                                                       offline["quick"]["acc_norm"])
            assert r["eval/prose/bits_per_byte"] == pytest.approx(offline["prose"]["bits_per_byte"], rel=1e-5)
    assert not list((run / "eval" / "snapshots").glob("step-*"))  # snapshots are cleaned up
    # training went on while evaluations ran: steps were logged between launch and result
    during, outside = _step_gaps(stamps, steps, "eval/quick/acc", 160)
    assert len(during) >= 10
    print(f"periodic eval: median step gap {statistics.median(during) * 1e3:.1f} ms while evaluating, "
          f"{statistics.median(outside) * 1e3:.1f} ms otherwise")
    assert statistics.median(during) < 4 * statistics.median(outside) + 0.05
    assert max(during) < 2.0  # no step waits for an evaluation


def test_periodic_evaluation_through_a_configured_endpoint(served, trained_checkpoint, small_corpus, tmp_path,
                                                           monkeypatch):
    """eval.endpoint: the child evaluates through `ultratron serve` (which serves a fixed checkpoint),
    and its results land in metrics.jsonl at the configured steps while training goes on."""
    url, key = served
    monkeypatch.setenv("ULTRATRON_PERIODIC_KEY", key)  # the child reads the key from this variable
    task = _quick_task(tmp_path)
    run = tmp_path / "run"
    stamps = _train_with_stamps(monkeypatch, TINY + [
        "--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run),
        "--training.steps", "160", "--eval.interval", "0", "--eval.task_interval", "40", "--eval.tasks", str(task),
        "--eval.endpoint", url + "/v1", "--eval.endpoint_model", "ultratron",
        "--eval.api_key_env", "ULTRATRON_PERIODIC_KEY", "--eval.price_per_request", "0.5"])
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/quick/acc" in r]
    steps = [r["step"] for r in evals]
    assert steps and all(s % 40 == 0 for s in steps) and 160 in steps
    # the numbers are the served checkpoint's, as evaluating it here gives them
    expected = evaluate(LocalBackend.from_checkpoint(trained_checkpoint), [load_task_file(task)])["quick"]
    for r in evals:
        assert r["eval/quick/acc"] == expected["acc"] and r["eval/quick/acc_norm"] == expected["acc_norm"]
    for step in steps:
        result = json.loads((run / "eval" / f"{step_dir_name(step)}.json").read_text())
        assert result["backend"] == f"endpoint {url}/v1 model ultratron" and result["step"] == step
        assert result["usage"]["requests"] >= 1 and result["usage"]["failed_requests"] == 0
        assert result["usage"]["cost"] == result["usage"]["requests"] * 0.5
    assert not (run / "eval" / "snapshots").exists()  # an endpoint needs no weights from the run
    log = (run / "train.log").read_text()
    assert f"started task evaluation of step 40 on {url}/v1" in log
    during, outside = _step_gaps(stamps, steps, "eval/quick/acc", 160)
    assert len(during) >= 10
    print(f"periodic eval via endpoint: median step gap {statistics.median(during) * 1e3:.1f} ms while evaluating, "
          f"{statistics.median(outside) * 1e3:.1f} ms otherwise")
    assert statistics.median(during) < 4 * statistics.median(outside) + 0.05
    assert max(during) < 2.0


def test_an_unreachable_endpoint_neither_stops_nor_stalls_training(small_corpus, tmp_path, monkeypatch):
    task = _quick_task(tmp_path)
    run = tmp_path / "run"
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    start = time.monotonic()
    stamps = _train_with_stamps(monkeypatch, TINY + [
        "--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run),
        "--training.steps", "120", "--eval.interval", "0", "--eval.task_interval", "40", "--eval.tasks", str(task),
        "--eval.endpoint", dead, "--eval.max_retries", "1", "--eval.timeout", "5"])
    elapsed = time.monotonic() - start
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if any(k.startswith("eval/") for k in r)]
    log = (run / "train.log").read_text()
    failed = [line for line in log.splitlines() if "failed (exit" in line]
    assert failed and "step 120" in failed[-1] and "training goes on" in failed[-1]
    train_times = {rec["step"]: t for t, rec in stamps if "loss" in rec}
    assert sorted(train_times) == list(range(1, 121))  # every step trained
    gaps = [train_times[s] - train_times[s - 1] for s in range(2, 121)]
    print(f"unreachable endpoint: {len(failed)} failed evaluations logged, longest step gap {max(gaps) * 1e3:.0f} ms, "
          f"run {elapsed:.1f} s")
    assert max(gaps) < 2.0


def test_the_end_of_training_stops_an_evaluation_that_outlives_final_wait(small_corpus, tmp_path):
    """An endpoint that accepts connections and never answers: the last evaluation hangs (or is still
    starting: either way it is not done), and the end of training waits eval.final_wait seconds for
    it, then stops it and returns."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    threading.Thread(target=lambda: held.extend(listener.accept() for _ in iter(int, 1)), daemon=True).start()
    run = tmp_path / "run"
    task = _quick_task(tmp_path)
    start = time.monotonic()
    train(load_config(None, TINY + [
        "--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run), "--training.steps", "4",
        "--eval.interval", "0", "--eval.task_interval", "4", "--eval.tasks", str(task),
        "--eval.endpoint", f"http://127.0.0.1:{listener.getsockname()[1]}/v1", "--eval.endpoint_model", "m",
        "--eval.timeout", "120", "--eval.max_retries", "0", "--eval.final_wait", "3"]), echo=False)
    elapsed = time.monotonic() - start
    log = (run / "train.log").read_text()
    pid = int(re.search(r"started task evaluation of step 4 on .* \(pid (\d+)\)", log).group(1))
    assert "the evaluation of step 4 did not finish within 3 s; stopped it" in log
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped, not left running
    print(f"final wait: training returned {elapsed:.1f} s after it started (final_wait 3 s)")
    assert elapsed < 60
    listener.close()
