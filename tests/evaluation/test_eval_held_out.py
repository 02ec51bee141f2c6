"""The built-in suite of a run trained on the built-in corpus is built from that run's own held-out
split: never from a file the run trained on, whatever its `data.held_out_fraction`."""

import pytest

from ultratron.checkpoint.manager import CheckpointWriter
from ultratron.checkpoint.state import ModelState
from ultratron.checkpoint.store import CheckpointRoot
from ultratron.cli import main
from ultratron.config import load_config
from ultratron.config.loader import to_toml
from ultratron.data.sources import held_out
from ultratron.data.tokenizer import train_tokenizer
from ultratron.errors import TaskError
from ultratron.evaluation import runner
from ultratron.evaluation.builtin import builtin_suite, held_out_documents, resolve_tasks, suite_fraction
from ultratron.models.registry import build_model

TINY = ["--model.preset", "tiny", "--model.n_layers", "1", "--model.dim", "32", "--model.n_heads", "2",
        "--model.n_kv_heads", "1", "--model.ffn_dim", "64", "--model.vocab_size", "512"]


def _checkpoint(tmp_path, overrides):
    """A weights-only checkpoint of an untrained tiny model whose config.toml says how it trained."""
    cfg = load_config(None, TINY + overrides)
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=300)
    root = CheckpointRoot(tmp_path / "checkpoints")
    files = {"config.toml": to_toml(cfg), **tokenizer.files()}
    return CheckpointWriter(root).write(0, ModelState(build_model(cfg.model, "cpu")), files=files).result()


def _suite_texts(monkeypatch, args) -> list[str]:
    """The bits-per-byte texts `ultratron eval` evaluates on (the evaluation itself is skipped)."""
    seen = []

    def capture(backend, tasks, *a, **k):
        seen.extend(ex.text for t in tasks for ex in t.examples)
        return {}

    monkeypatch.setattr(runner, "evaluate", capture)
    assert main(["eval", *args, "--tasks", "builtin_bpb", "--quiet"]) == 0
    return seen


def test_a_run_holding_out_less_than_the_default_is_never_evaluated_on_its_training_files(tmp_path, monkeypatch):
    fraction = 0.01  # below the suite's former fixed 0.05: the files in between were trained on
    ckpt = _checkpoint(tmp_path, ["--data.held_out_fraction", str(fraction)])
    texts = _suite_texts(monkeypatch, ["--checkpoint", str(ckpt)])
    held = {text[:1500] for doc_id, text in held_out_documents(0.05) if held_out(doc_id, fraction)}
    assert texts and set(texts) <= held  # every text from a file the run held out


def test_the_suite_follows_the_run_and_a_run_that_held_out_nothing_is_refused(tmp_path):
    assert suite_fraction(load_config(None, ["--data.held_out_fraction", "0.2"])) == 0.2
    assert suite_fraction(load_config(None, ["--data.path", str(tmp_path)])) == 0.05  # not the built-in corpus
    assert suite_fraction(None) == 0.05  # an endpoint: its training data is unknown
    with pytest.raises(TaskError, match="held_out_fraction = 0"):
        suite_fraction(load_config(None, ["--data.held_out_fraction", "0"]))
    small, large = (builtin_suite(0.01)[0].examples, builtin_suite(0.2)[0].examples)
    assert 0 < len(small) < len(large)
    assert [t.name for t in resolve_tasks("builtin", 0.2)] == [t.name for t in resolve_tasks("builtin")]


def test_an_endpoint_evaluation_takes_the_runs_split_and_the_trainer_passes_it(tmp_path, monkeypatch):
    """Behind an endpoint the run's config is unknown: `--held-out-fraction` gives its split, and a run
    on the built-in corpus that evaluates through an endpoint passes its own (periodic evaluation)."""
    from ultratron.training import periodic_eval

    class FakeChild:
        pid = 0

    fraction = 0.01
    texts = _suite_texts(monkeypatch, ["--endpoint", "http://127.0.0.1:9/v1", "--model", "m",
                                       "--held-out-fraction", str(fraction)])
    held = {text[:1500] for doc_id, text in held_out_documents(0.05) if held_out(doc_id, fraction)}
    assert texts and set(texts) <= held
    assert main(["eval", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--held-out-fraction", "0",
                 "--tasks", "builtin_bpb", "--quiet"]) == 2  # a run that held out nothing: refused, as a checkpoint
    launched = []
    monkeypatch.setattr(periodic_eval.subprocess, "Popen", lambda cmd, **kw: launched.append(cmd) or FakeChild())
    for data, expected in (([], ["--held-out-fraction", str(fraction)]), (["--data.path", str(tmp_path)], None)):
        cfg = load_config(None, TINY + data + ["--data.held_out_fraction", str(fraction),
                                               "--eval.endpoint", "http://127.0.0.1:9/v1"])
        periodic_eval.PeriodicEvaluator(cfg, tmp_path / "run", print)._launch(10, None, {}, None)
        cmd = launched.pop()
        flag = cmd[cmd.index("--held-out-fraction"):][:2] if "--held-out-fraction" in cmd else None
        assert flag == expected  # only a run on the built-in corpus has a split of it to pass
