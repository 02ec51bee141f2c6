"""Chat fine-tuning under parallel layouts equals one process (fp32, 5 steps): document-masked chat
batches under tp2, cp2 (ring attention: each rank's queries see only their own document's keys on
the other rank; the all-gather mode's masking is checked in test_dist_context_parallel.py) and pp2
(every stage masks by the micro-batch's documents), and LoRA under dp2 with ZeRO-3 (FSDP2 shards
the frozen weights and the adapters; only the adapters have optimizer state).

Tolerances are the suite's fp32 ones (dist_common.py): losses and validation losses 1e-5
relative, gradient norms 1e-4 — only the summation order differs (under cp each rank's mean loss is
weighted by its share of the targets that count, so the cp ranks' average is the micro-batch's
mean). Measured here: losses ≤ 6e-7, gradient norms ≤ 5.1e-6 (tp2; cp2 2.0e-6, pp2 1.0e-7).
"""

import json

import pytest

from ultratron.checkpoint.store import resolve_checkpoint_dir
from ultratron.config import load_config
from ultratron.launch.local import run_local
from ultratron.training.trainer import train

pytest.importorskip("transformers")

STEPS = 5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An imported transformers model and a chat file for it (the end-to-end test's)."""
    from test_finetune_chat import _chat_file, _hf_model, _words
    from ultratron.checkpoint.hf_import import import_hf

    root = tmp_path_factory.mktemp("chat-dist")
    _hf_model(root / "hf")
    import_hf(root / "hf", root / "imported")
    _, words = _words()
    return root, _chat_file(root / "chat.jsonl", "upper", words[:600])


def _overrides(root, data, run_dir, *extra):
    return ["--data.path", str(data), "--data.format", "chat",
            "--data.cache_dir", str(root / "cache"), "--data.held_out_fraction", "0.05",
            "--training.seq_len", "128", "--training.micro_batch_size", "4", "--training.batch_tokens", "1024",
            "--training.steps", str(STEPS), "--optim.warmup_steps", "1", "--optim.lr", "1e-2",
            "--training.progress", "false", "--training.sample_tokens", "0", "--run.tensorboard", "false",
            "--eval.interval", str(STEPS), "--eval.batches", "2", "--health.check", "false",
            "--checkpoint.async_save", "false", "--run.dir", str(run_dir), *extra]


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r or "val_loss" in r}


LORA = ["--lora.rank", "8", "--lora.targets", "q,k,v,o,gate,up,down"]


def test_chat_under_tp2_cp2_pp2_and_lora_under_zero3_equal_one_process(base, tmp_path):
    root, data = base
    config = str(root / "imported" / "config.toml")
    init = ["--model.init_from", str(root / "imported")]
    # name → (layout, extra flags); one reference run per set of extra flags
    runs = {"tp2": (["--parallel.tp", "2"], []),
            "cp2": (["--parallel.cp", "2"], []),
            "pp2": (["--parallel.pp", "2"], []),
            "lora-dp2-zero3": (["--parallel.dp", "2", "--parallel.zero", "3"], LORA + init)}
    references = {}
    for _, extra in runs.values():
        if tuple(extra) not in references:
            references[tuple(extra)] = tmp_path / f"ref-{len(references)}"
            train(load_config(config, _overrides(root, data, references[tuple(extra)], *extra)), echo=False)
    run_local(2, train_configs, [(config, _overrides(root, data, tmp_path / name, *layout, *extra))
                                 for name, (layout, extra) in runs.items()])
    for name, (_, extra) in runs.items():
        got, want = _records(tmp_path / name), _records(references[tuple(extra)])
        assert sorted(got) == sorted(want) == list(range(STEPS + 1)), name
        for step, ref in want.items():
            for key, tol in (("loss", 1e-5), ("val_loss", 1e-5), ("grad_norm", 1e-4), ("loss_tokens", 0)):
                if key in ref:
                    assert abs(got[step][key] - ref[key]) <= tol * abs(ref[key]), (name, step, key, got[step], ref)
        assert want[STEPS]["loss"] < want[1]["loss"]  # it learns: agreement is not trivial
    saved = resolve_checkpoint_dir(tmp_path / "lora-dp2-zero3")
    assert json.loads((saved / "lora.json").read_text())["rank"] == 8


def train_configs(runs: list[tuple[str, list[str]]]) -> None:
    """On each spawned rank: the runs (a config file and overrides each), one after another."""
    for config, overrides in runs:
        train(load_config(config, overrides), echo=False)
