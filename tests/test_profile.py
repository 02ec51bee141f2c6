"""training.profile_steps: a trace, an operator table and a memory view of the chosen steps."""

import json

import pytest

from ultratron.config import load_config
from ultratron.errors import ConfigError
from ultratron.training.trainer import train


def test_the_profiled_steps_leave_a_trace_and_tables(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides + ["--training.steps", "3", "--training.profile_steps", "2..3",
                                              "--eval.interval", "0"])
    train(cfg, echo=False)
    out = tmp_path / "run" / "profile"
    trace = json.loads((out / "rank0.pt.trace.json").read_text())
    ops = [e for e in trace["traceEvents"] if e.get("cat") in ("cpu_op", "user_annotation")]
    steps = [e for e in ops if e["name"] == "Optimizer.step#AdamW.step"]
    matmuls = ("aten::mm", "ultratron::linear")  # torch's, or training.cpu_linear's oneDNN op
    assert len(steps) == 2 and any(e["name"] in matmuls for e in ops)  # steps 2 and 3, not 1
    table = (out / "rank0-operators.txt").read_text()
    assert any(m in table for m in matmuls) and "CPU Mem" in table and ".py(" not in table
    assert "<html" in (out / "rank0-memory.html").read_text()[:2000].lower()


@pytest.mark.parametrize("steps, message", [("3..2", "needs 1 ≤ N ≤ M"), ("5", "expected N..M"),
                                            ("0..2", "needs 1 ≤ N ≤ M")])
def test_bad_step_ranges_are_refused(tiny_overrides, steps, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, tiny_overrides + ["--training.profile_steps", steps])
