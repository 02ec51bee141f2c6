"""Chat fine-tuning under parallel layouts equals one process (fp32, 5 steps): document-masked chat
batches under cp2 and cp2 × dp2 (ring attention: each rank's queries see only their own document's
keys on the other rank; the all-gather mode's masking is checked in test_dist_context_parallel.py) and pp2
(every stage masks by the micro-batch's documents), and LoRA on the same chat data under dp2 with
ZeRO-3 (FSDP2 shards the frozen weights and the adapters; only the adapters have optimizer state),
under tp2 with and without sequence parallelism (the adapters split as their layer,
`parallel/tensor.py`; document masking under tp2 with them), and under pp2 and cp2.

Tolerances are the suite's fp32 ones (dist_common.py): losses and validation losses 1e-5
relative, gradient norms 1e-4, the trained adapters 3e-4 of their update over the run — only the
summation order differs (under cp each rank's mean loss is weighted by its share of the targets
that count, so the cp ranks' average is the micro-batch's mean). Measured here: losses ≤ 2.4e-7,
gradient norms ≤ 2.0e-6 (cp2; the LoRA runs ≤ 2.8e-7), adapters ≤ 2.2e-6; cp2 × dp2 (through the
attention backend's block masks): losses ≤ 6.6e-7, gradient norms ≤ 5.6e-6.
"""

import json

import pytest
from dist_common import weights_gap

from tolerances import LAYOUTS
from ultratron.checkpoint.store import resolve_checkpoint_dir
from ultratron.config import load_config
from ultratron.launch.local import run_local
from ultratron.training.trainer import train

pytest.importorskip("transformers")

STEPS = 5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An imported transformers model and a chat file for it."""
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


def _adapters(run_dir):
    """The adapters of a run's last checkpoint, read into one process's model: a layout must have
    saved them whole (global shapes), as it saves the rest of a model."""
    from ultratron.checkpoint.inference import read_lora
    from ultratron.models.lora import adapter_state
    from ultratron.models.registry import build_model

    ckpt = resolve_checkpoint_dir(run_dir)
    cfg = load_config(ckpt / "config.toml")
    return adapter_state(read_lora(cfg, ckpt, build_model(cfg.model)).state_dict())


LORA = ["--lora.rank", "8", "--lora.targets", "q,k,v,o,gate,up,down"]
TP2 = ["--parallel.tp", "2"]
# the one-process reference runs: name → their overrides (the base fixture's root and data filled in later)
REFERENCES = {"chat": [], "lora": LORA}
# the 2-process runs: name → (layout, the reference it must equal)
CP2, PP2 = ["--parallel.cp", "2"], ["--parallel.pp", "2"]
RUNS = {"cp2": (CP2, "chat"), "pp2": (PP2, "chat"),
        "lora-dp2-zero3": (["--parallel.dp", "2", "--parallel.zero", "3"], "lora"),
        "lora-tp2": (TP2, "lora"), "lora-tp2-sp": (TP2 + ["--parallel.sp", "true"], "lora"),
        "lora-pp2": (PP2, "lora"), "lora-cp2": (CP2, "lora")}
# the 4-process runs: document-masked chat under cp2 × dp2 (the attention backend's masks in the ring
# on each dp replica's micro-batches)
RUNS4 = {"cp2-dp2": (CP2 + ["--parallel.dp", "2"], "chat")}


def test_chat_and_lora_under_parallel_layouts_equal_one_process(base, tmp_path):
    root, chat = base
    config = str(root / "imported" / "config.toml")

    def overrides(run_dir, reference, *layout):
        extra = REFERENCES[reference]
        init = ["--model.init_from", str(root / "imported")] if extra else []
        return _overrides(root, chat, run_dir, *extra, *init, *layout)

    for reference in REFERENCES:
        train(load_config(config, overrides(tmp_path / f"ref-{reference}", reference)), echo=False)
    run_local(2, train_configs, [(config, overrides(tmp_path / name, reference, *layout))
                                 for name, (layout, reference) in RUNS.items()])
    run_local(4, train_configs, [(config, overrides(tmp_path / name, reference, *layout))
                                 for name, (layout, reference) in RUNS4.items()])
    for name, (_, reference) in {**RUNS, **RUNS4}.items():
        got, want = _records(tmp_path / name), _records(tmp_path / f"ref-{reference}")
        assert sorted(got) == sorted(want) == list(range(STEPS + 1)), name
        gaps = {}
        tolerances = {**{k: LAYOUTS["fp32"][k] for k in ("loss", "val_loss", "grad_norm")}, "loss_tokens": 0}
        for step, ref in want.items():
            for key, tol in tolerances.items():
                if key in ref:
                    gaps[key] = max(gaps.get(key, 0), abs(got[step][key] - ref[key]) / abs(ref[key]))
                    assert gaps[key] <= tol, (name, step, key, got[step], ref)
        assert want[STEPS]["loss"] < want[1]["loss"]  # it learns: agreement is not trivial
        if name.startswith("lora"):
            assert json.loads((resolve_checkpoint_dir(tmp_path / name) / "lora.json").read_text())["rank"] == 8
            gaps["adapters"] = weights_gap(tmp_path / name, tmp_path / f"ref-{reference}", _adapters)
            assert gaps["adapters"] <= LAYOUTS["fp32"]["weights"], (name, gaps)
        print(f"{name}: " + ", ".join(f"{k} within {v:.1e}" for k, v in gaps.items()))


def train_configs(runs: list[tuple[str, list[str]]]) -> None:
    """On each spawned rank: the runs (a config file and overrides each), one after another."""
    for config, overrides in runs:
        train(load_config(config, overrides), echo=False)
