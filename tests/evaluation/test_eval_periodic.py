"""Task evaluation during training runs in a child process and does not stall the loop."""

import json
import statistics
import time

from ultratron.config import load_config
from ultratron.training import trainer as trainer_module
from ultratron.training.trainer import train

from .conftest import TINY


def test_periodic_evaluation_records_results_without_stalling(small_corpus, tmp_path, monkeypatch):
    task = tmp_path / "quick.jsonl"
    task.write_text("\n".join(json.dumps({"type": "multiple_choice", "context": f"x{i} = ",
                                          "choices": [str(i), "~~"], "answer": 0}) for i in range(4)) + "\n")
    stamps = []  # (time, record) for every metrics record, in write order
    original = trainer_module.MetricsWriter.write
    monkeypatch.setattr(trainer_module.MetricsWriter, "write",
                        lambda self, record: (stamps.append((time.monotonic(), record)), original(self, record)))
    run = tmp_path / "run"
    cfg = load_config(None, TINY + ["--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir",
                                    str(run), "--training.steps", "160", "--eval.interval", "0",
                                    "--eval.task_interval", "40", "--eval.tasks", str(task)])
    train(cfg, echo=False)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/quick/acc" in r]
    steps = [r["step"] for r in evals]
    assert steps and all(s % 40 == 0 for s in steps) and 160 in steps  # the end waits for its evaluation
    assert all(0 <= r["eval/quick/acc"] <= 1 for r in evals)
    assert not list((run / "eval" / "snapshots").glob("step-*"))  # snapshots are cleaned up
    # training went on while evaluations ran: steps were logged between launch and result
    train_times = {rec["step"]: t for t, rec in stamps if "loss" in rec}
    gaps_during, gaps_outside = [], []
    for step in range(2, 161):
        gap = train_times[step] - train_times[step - 1]
        running = any(s < step and t_done > train_times[step] for s in steps
                      for t_done, rec in stamps if rec.get("step") == s and "eval/quick/acc" in rec)
        (gaps_during if running else gaps_outside).append(gap)
    assert len(gaps_during) >= 10
    print(f"periodic eval: median step gap {statistics.median(gaps_during) * 1e3:.1f} ms while evaluating, "
          f"{statistics.median(gaps_outside) * 1e3:.1f} ms otherwise")
    assert statistics.median(gaps_during) < 4 * statistics.median(gaps_outside) + 0.05
    assert max(gaps_during) < 2.0  # no step waits for an evaluation
