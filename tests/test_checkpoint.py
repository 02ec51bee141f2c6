"""The checkpoint owner: atomic directories, the latest pointer, retention, clear errors."""

import shutil
from pathlib import Path

import pytest
import torch

from conftest import Counter
from ultratron.checkpoint.checkpointer import Checkpointer
from ultratron.checkpoint.manager import CheckpointWriter, ModelState, WriteOptions, read_checkpoint
from ultratron.checkpoint.store import CheckpointRoot, resolve_checkpoint_dir
from ultratron.errors import CheckpointError


def save(checkpointer, step):
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.fill_(float(step))
    files = {"config.toml": "", "tokenizer.json": "{}"}
    return checkpointer.save(step, ModelState(model), Counter(step), files).result()


def test_latest_pointer_retention_and_a_round_trip(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        save(checkpointer, step)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000020", "step-0000030"]
    assert checkpointer.latest().name == "step-0000030"
    model, counter = torch.nn.Linear(2, 2, bias=False), Counter()
    assert read_checkpoint(tmp_path, ModelState(model), counter).name == "step-0000030"
    assert counter.step == 30 and torch.equal(model.weight, torch.full((2, 2), 30.0))
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_half_written_checkpoint_is_never_picked(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    save(checkpointer, 10)
    # a crash in the middle of saving step 20 leaves its temporary directory behind
    half = tmp_path / ".tmp-step-0000020-999"
    half.mkdir()
    (half / "state.pt").write_bytes(b"partial")
    # and a directory with the final name but no completion marker (e.g. copied by hand, cut short)
    (tmp_path / "step-0000030").mkdir()
    assert checkpointer.latest().name == "step-0000010"
    assert resolve_checkpoint_dir(tmp_path).name == "step-0000010"


def test_latest_falls_back_when_its_target_is_gone(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    save(checkpointer, 10)
    save(checkpointer, 20)
    shutil.rmtree(tmp_path / "step-0000020")
    assert checkpointer.latest().name == "step-0000010"


def test_damaged_or_missing_checkpoint_gives_a_clear_error(tmp_path):
    path = save(Checkpointer(tmp_path), 10)
    model = torch.nn.Linear(2, 2, bias=False)
    (path / "state.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="failed verification: state.pt has 16 bytes, the manifest says"):
        read_checkpoint(path, ModelState(model), Counter())
    (path / "manifest.json").unlink()  # as written before checksums: read, and the damage still named
    with pytest.raises(CheckpointError, match="state.pt: cannot be read"):
        read_checkpoint(path, ModelState(model), Counter())
    with pytest.raises(CheckpointError, match="do not fit this model"):
        read_checkpoint(path, ModelState(torch.nn.Linear(3, 3, bias=False)))
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "missing", ModelState(model))


def test_a_snapshot_written_from_a_model_or_linked_from_a_checkpoint_loads_for_inference(tmp_path):
    """The periodic evaluator's weights-only snapshots go through the one writer: written from the
    live model, or hard-linked from a checkpoint of the same step (its tensor files shared, not
    copied), each verified and read back by the evaluator process."""
    from conftest import TINY
    from ultratron.checkpoint.inference import load_for_inference
    from ultratron.config import load_config, to_toml
    from ultratron.data.tokenizer import train_tokenizer
    from ultratron.models.registry import build_model

    cfg = load_config(None, TINY)
    model = build_model(cfg.model)
    tokenizer = train_tokenizer(["def f(x):\n    return x\n" * 10], vocab_size=300)
    files = {"config.toml": to_toml(cfg), "tokenizer.json": tokenizer.to_json()}
    written = CheckpointWriter(CheckpointRoot(tmp_path / "snap")).write(7, ModelState(model), files=files).result()
    linked = CheckpointWriter(CheckpointRoot(tmp_path / "linked")).write(
        7, ModelState(model), files=files, options=WriteOptions(link_from=written)).result()
    shards = sorted((written / "dcp").iterdir())
    assert [p.name for p in shards] == sorted(p.name for p in (linked / "dcp").iterdir())
    assert all(p.stat().st_nlink == 2 for p in shards)  # one file, two names: no bytes copied
    for dest in (written, linked):
        loaded = load_for_inference(dest)
        assert loaded.step == 7 and (dest / "manifest.json").is_file()
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.model.state_dict()[name], tensor), name
    assert not list(tmp_path.rglob(".tmp-*"))


def test_write_options_choose_one_way_to_write():
    with pytest.raises(ValueError, match="choose one"):
        WriteOptions(background=True, link_from=Path("step-0000001"))
