import pytest
import torch

from ultratron.checkpoint.manager import CheckpointManager, load_checkpoint, resolve_checkpoint_dir
from ultratron.errors import CheckpointError


def save(manager, step):
    return manager.save(step, model_state={"w": torch.full((2,), float(step))}, optimizer_state={},
                        state={"step": step}, config_toml="", tokenizer_json="{}")


def test_latest_pointer_and_retention(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (10, 20, 30):
        save(manager, step)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000020", "step-0000030"]
    assert manager.latest().name == "step-0000030"
    assert load_checkpoint(tmp_path)["state"]["step"] == 30
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_half_written_checkpoint_is_never_picked(tmp_path):
    manager = CheckpointManager(tmp_path)
    save(manager, 10)
    # a crash in the middle of saving step 20 leaves its temporary directory behind
    half = tmp_path / ".tmp-step-0000020-999"
    half.mkdir()
    (half / "model.pt").write_bytes(b"partial")
    # and a directory with the final name but no completion marker (e.g. copied by hand, cut short)
    (tmp_path / "step-0000030").mkdir()
    assert manager.latest().name == "step-0000010"
    assert resolve_checkpoint_dir(tmp_path).name == "step-0000010"


def test_latest_falls_back_when_its_target_is_gone(tmp_path):
    manager = CheckpointManager(tmp_path)
    save(manager, 10)
    save(manager, 20)
    import shutil

    shutil.rmtree(tmp_path / "step-0000020")
    assert manager.latest().name == "step-0000010"


def test_damaged_checkpoint_gives_a_clear_error(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = save(manager, 10)
    (path / "model.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="model.pt: cannot be read"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing")
