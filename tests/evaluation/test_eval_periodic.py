"""Task evaluation during training runs in a child process (local, or through a configured
OpenAI-compatible endpoint) and does not stall the loop."""

import json
import os
import re
import socket
import sysconfig
import threading
from pathlib import Path

import pytest

from tolerances import LAYOUTS
from ultratron.checkpoint.store import step_dir_name
from ultratron.config import load_config
from ultratron.evaluation.backends import LocalBackend
from ultratron.evaluation.runner import evaluate
from ultratron.evaluation.tasks import load_task_file
from ultratron.training.trainer import Trainer, train

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


def _records(run) -> list[dict]:
    """metrics.jsonl in the order it was written."""
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _launched(run) -> list[int]:
    return [int(m) for m in re.findall(r"started task evaluation of step (\d+)", (run / "train.log").read_text())]


def _trained_during_evaluations(records, launched, last, result_key=None) -> dict[int, list[int]]:
    """The training loop's own evidence that evaluation never held it up: every step trained once,
    and each evaluation launched before the last step had steps train while its child process was
    alive (their records carry `eval_running`), from its launch on without a gap. With
    `result_key`, each result is written at the first step after its child ended. Returns
    {evaluation step: the steps trained while it ran}."""
    at = {r["step"]: i for i, r in enumerate(records) if "loss" in r}
    assert sorted(at) == list(range(1, last + 1)) and len(at) == len([r for r in records if "loss" in r])
    during: dict[int, list[int]] = {}
    for r in records:
        if "eval_running" in r:
            during.setdefault(r["eval_running"], []).append(r["step"])
    assert set(during) <= set(launched)
    for step in launched:
        steps = during.get(step, [])
        assert steps == list(range(step + 1, step + 1 + len(steps))), (step, steps)
        if step < last:  # a child process outlives a training step unless the loop waits for it
            assert steps, f"no step trained while the evaluation of step {step} ran"
        if result_key is not None:
            result = next(i for i, r in enumerate(records) if r["step"] == step and result_key in r)
            ended = steps[-1] if steps else step  # the last step whose record saw the child alive
            assert at[ended] < result and (ended + 2 > last or result < at[ended + 2]), (step, ended)
    return during


def test_periodic_evaluation_records_results_without_stalling(small_corpus, tmp_path):
    task = _quick_task(tmp_path)
    run = tmp_path / "run"
    train(load_config(None, TINY + [
        "--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run),
        "--training.steps", "160", "--eval.interval", "0", "--eval.task_interval", "40",
        "--eval.tasks", f"{task},{_text_task(tmp_path)}", "--checkpoint.interval", "80", "--checkpoint.keep", "5"]),
          echo=False)
    records = _records(run)
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
            assert r["eval/prose/bits_per_byte"] == pytest.approx(offline["prose"]["bits_per_byte"],
                                                                         rel=LAYOUTS["fp32"]["val_loss"])
    assert not list((run / "eval" / "snapshots").glob("step-*"))  # snapshots are cleaned up
    assert _launched(run) == steps  # each launched evaluation gave its result
    during = _trained_during_evaluations(records, steps, 160, "eval/quick/acc")
    print(f"periodic eval: steps trained while each evaluation ran { {s: len(v) for s, v in during.items()} }")


def test_periodic_evaluation_through_a_configured_endpoint(served, trained_checkpoint, small_corpus, tmp_path,
                                                           monkeypatch):
    """eval.endpoint: the child evaluates through `ultratron serve` (which serves a fixed checkpoint),
    and its results land in metrics.jsonl at the configured steps while training goes on."""
    url, key = served
    monkeypatch.setenv("ULTRATRON_PERIODIC_KEY", key)  # the child reads the key from this variable
    task = _quick_task(tmp_path)
    run = tmp_path / "run"
    train(load_config(None, TINY + [
        "--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run),
        "--training.steps", "160", "--eval.interval", "0", "--eval.task_interval", "40", "--eval.tasks", str(task),
        "--eval.endpoint", url + "/v1", "--eval.endpoint_model", "ultratron",
        "--eval.api_key_env", "ULTRATRON_PERIODIC_KEY", "--eval.price_per_request", "0.5"]), echo=False)
    records = _records(run)
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
    assert _launched(run) == steps
    during = _trained_during_evaluations(records, steps, 160, "eval/quick/acc")
    print(f"periodic eval via endpoint: steps trained while each evaluation ran "
          f"{ {s: len(v) for s, v in during.items()} }")


def test_an_unreachable_endpoint_neither_stops_nor_stalls_training(small_corpus, tmp_path):
    task = _quick_task(tmp_path)
    run = tmp_path / "run"
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    train(load_config(None, TINY + [
        "--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run),
        "--training.steps", "120", "--eval.interval", "0", "--eval.task_interval", "40", "--eval.tasks", str(task),
        "--eval.endpoint", dead, "--eval.max_retries", "1", "--eval.timeout", "5"]), echo=False)
    records = _records(run)
    assert not [r for r in records if any(k.startswith("eval/") for k in r)]
    log = (run / "train.log").read_text()
    failed = [int(m) for m in re.findall(r"evaluation of step (\d+) failed \(exit [1-9]\d*\); training goes on", log)]
    launched = _launched(run)
    assert failed == launched and launched[0] == 40 and launched[-1] == 120  # each failure logged, none stopped it
    during = _trained_during_evaluations(records, launched, 120)
    print(f"unreachable endpoint: {len(failed)} failed evaluations logged; steps trained while each ran "
          f"{ {s: len(v) for s, v in during.items()} }")


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
    trainer = Trainer(load_config(None, TINY + [
        "--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run), "--training.steps", "4",
        "--eval.interval", "0", "--eval.task_interval", "4", "--eval.tasks", str(task),
        "--eval.endpoint", f"http://127.0.0.1:{listener.getsockname()[1]}/v1", "--eval.endpoint_model", "m",
        "--eval.timeout", "120", "--eval.max_retries", "0", "--eval.final_wait", "3"]), echo=False)
    result = trainer.fit()
    log = (run / "train.log").read_text()
    pid = int(re.search(r"started task evaluation of step 4 on .* \(pid (\d+)\)", log).group(1))
    assert result.steps_done == 4 and trainer.periodic.launched == [4]
    # stopped by the final wait: neither a result nor a failure of its own (which the 120 s request
    # timeout would have been, had the end of training waited for it)
    assert trainer.periodic.stopped == [4] and trainer.periodic.failed == []
    assert "the evaluation of step 4 did not finish within 3 s; stopped it" in log and "failed (exit" not in log
    assert not [r for r in _records(run) if any(k.startswith("eval/") for k in r)]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped, not left running
    listener.close()
