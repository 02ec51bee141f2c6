"""Built-in suite and task formats on the local backend, and `ultratron eval --checkpoint`."""

import json

import pytest
import torch

from conftest import run_cli
from ultratron.config import load_config
from ultratron.data.prepare import prepare_data
from ultratron.data.shards import ShardSet
from ultratron.data.tokenizer import train_tokenizer
from ultratron.errors import TaskError
from ultratron.evaluation.backends import LocalBackend
from ultratron.evaluation.builtin import (
    HELD_OUT_FRACTION,
    builtin_suite,
    builtin_task,
    held_out_documents,
    resolve_tasks,
)
from ultratron.evaluation.runner import evaluate
from ultratron.evaluation.tasks import load_task_file
from ultratron.models.llama import Llama


def test_builtin_suite_is_deterministic_and_a_task_made_alone_is_the_suites():
    a = builtin_suite()
    builtin_task.cache_clear()
    alone = builtin_task("builtin_identifier_cloze")  # made before, and without, the tasks in front of it
    b = builtin_suite()
    assert [e.__dict__ for e in alone.examples] == [e.__dict__ for e in a[2].examples]
    assert [t.name for t in a] == ["builtin_bpb", "builtin_next_line", "builtin_identifier_cloze",
                                   "builtin_arithmetic"]
    assert all(len(t.examples) >= 30 for t in a)
    assert [e.__dict__ for t in a for e in t.examples] == [e.__dict__ for t in b for e in t.examples]
    for ex in a[1].examples:
        assert len(ex.choices) == 4 and len(set(ex.choices)) == 4
    q = a[3].examples[0]
    x, op, y, _ = q.prompt.splitlines()[-1].split()
    assert int(q.target) == (int(x) + int(y) if op == "+" else int(x) - int(y))


def _shard_documents(root, tokenizer) -> list[str]:
    shards = ShardSet.open(root)
    texts = []
    for i, tokens in enumerate(shards.tokens):
        starts = [*shards.document_starts(i).tolist(), len(tokens)]
        ends = starts[1:]
        texts += [tokenizer.decode(tokens[a:b - 1].tolist()) for a, b in zip(starts, ends, strict=False)]  # no EOS
    return texts


def test_training_never_sees_a_document_of_the_suite(tmp_path):
    """What the trainer actually trains on — the training shards prepare_data writes for the built-in
    corpus, decoded back to text — shares no document with the suite; and the held-out split it
    validates on holds exactly the suite's documents."""
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=300)  # round-trips any text
    tokenizer.save(tmp_path / "tokenizer.json")
    cfg = load_config(None, ["--data.tokenizer", str(tmp_path / "tokenizer.json"),
                             "--data.held_out_fraction", str(HELD_OUT_FRACTION)])
    prepared = prepare_data(cfg.data, cfg.model.vocab_size, tmp_path / "data", log=lambda message: None)
    training = set(_shard_documents(prepared.train_dir, prepared.tokenizer))
    suite = {text for _, text in held_out_documents()}
    assert len(training) > 500 and len(suite) >= 20
    assert not training & suite
    assert set(_shard_documents(prepared.val_dir, prepared.tokenizer)) == suite


def test_trained_checkpoint_beats_an_untrained_model(trained_checkpoint):
    trained = LocalBackend.from_checkpoint(trained_checkpoint)
    torch.manual_seed(0)
    untrained = LocalBackend(Llama(trained.model.args).eval(), trained.tokenizer)
    tasks = [t for t in builtin_suite() if t.name in ("builtin_bpb", "builtin_next_line")]
    ours, base = evaluate(trained, tasks), evaluate(untrained, tasks)
    print(f"next-line MC accuracy: trained {ours['builtin_next_line']['acc']:.3f} "
          f"(acc_norm {ours['builtin_next_line']['acc_norm']:.3f}), untrained {base['builtin_next_line']['acc']:.3f} "
          f"(acc_norm {base['builtin_next_line']['acc_norm']:.3f}); bits/byte trained "
          f"{ours['builtin_bpb']['bits_per_byte']:.3f}, untrained {base['builtin_bpb']['bits_per_byte']:.3f}")
    assert ours["builtin_next_line"]["n"] == base["builtin_next_line"]["n"] >= 150
    # clearly ahead on plain accuracy (summed log-likelihood) and on the length-normalized score
    assert ours["builtin_next_line"]["acc"] >= base["builtin_next_line"]["acc"] + 0.05
    assert ours["builtin_next_line"]["acc_norm"] > base["builtin_next_line"]["acc_norm"]
    assert ours["builtin_bpb"]["bits_per_byte"] < base["builtin_bpb"]["bits_per_byte"] - 0.5
    # an untrained model's bits per byte: about log2(vocab) bits per token spread over the bytes
    assert base["builtin_bpb"]["loss"] == pytest.approx(torch.log(torch.tensor(512.0)).item(), abs=0.3)


def test_task_file_formats_and_metrics(tmp_path, trained_checkpoint):
    backend = LocalBackend.from_checkpoint(trained_checkpoint)
    native = tmp_path / "mc.jsonl"
    native.write_text("\n".join(json.dumps(r) for r in [
        {"type": "multiple_choice", "context": "import os\nimport ", "choices": ["sys", "zzqx~~"], "answer": 0},
        {"type": "multiple_choice", "context": "def f(self):\n    return ", "choices": ["@@@@@", "self"], "answer": 1},
    ]) + "\n")
    lmeval = tmp_path / "lm.jsonl"
    lmeval.write_text(json.dumps({"query": "x =", "choices": ["1", "~~"], "gold": 0}) + "\n")
    bigbench = tmp_path / "task.json"
    bigbench.write_text(json.dumps({"name": "bb", "examples": [
        {"input": "1 + 1", "target_scores": {"2": 1, "3": 0}},
        {"input": "2 + 2", "target_scores": {"5": 0, "4": 1}}]}))
    gen = tmp_path / "gen.jsonl"
    gen.write_text(json.dumps({"type": "generation", "prompt": "x = 1\ny = ", "target": "IMPOSSIBLE",
                               "stop": ["\n"]}) + "\n")
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"type": "text", "text": "def main():\n    pass\n"}) + "\n")
    tasks = resolve_tasks(",".join(str(p) for p in (native, lmeval, bigbench, gen, text)))
    assert [t.kind for t in tasks] == ["multiple_choice", "multiple_choice", "multiple_choice", "generation", "text"]
    assert tasks[1].examples[0].choices == [" 1", " ~~"]  # lm-eval's target delimiter
    assert tasks[2].name == "bb" and tasks[2].examples[1].answer == 1
    assert tasks[2].examples[0].context == "\nQ: 1 + 1\nA: "
    results = evaluate(backend, tasks, details=True)
    # accuracy is exactly the share of examples whose gold choice has the highest log-likelihood
    for name in ("mc", "lm", "bb"):
        r = results[name]
        golds = [ex.answer for t in tasks if t.name == name for ex in t.examples]
        hits = [lls.index(max(lls)) == g for lls, g in zip(r["loglikelihoods"], golds, strict=True)]
        assert r["acc"] == sum(hits) / len(hits)
    assert results["mc"]["acc"] == 1.0  # real Python beats line noise even for a tiny model
    assert results["gen"]["exact_match"] == 0.0 and isinstance(results["gen"]["outputs"][0], str)
    assert "\n" not in results["gen"]["outputs"][0]
    assert results["text"]["tokens"] == len(backend.tokenizer.encode("def main():\n    pass\n")) - 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"type": "multiple_choice", "context": "a", "choices": ["b", "c"], "answer": 5}))
    with pytest.raises(TaskError, match="answer"):
        load_task_file(bad)


def test_eval_command_prints_a_table_and_writes_json(trained_checkpoint, tmp_path):
    out = tmp_path / "results.json"
    result = run_cli("eval", "--checkpoint", str(trained_checkpoint), "--tasks", "builtin", "--max-examples", "20",
                     "--json", str(out), "--threads", "1")
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert set(record["tasks"]) == {"builtin_bpb", "builtin_next_line", "builtin_identifier_cloze",
                                    "builtin_arithmetic"}
    assert record["tasks"]["builtin_next_line"]["n"] == 20 and record["step"] is not None
    assert "builtin_next_line" in result.stdout and "acc_norm" in result.stdout
    bad = run_cli("eval", "--checkpoint", str(trained_checkpoint), "--tasks", "nonsense")
    assert bad.returncode == 2 and "unknown task 'nonsense'" in bad.stderr
