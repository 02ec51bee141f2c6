"""Weights & Biases beside metrics.jsonl: an offline run (no account, no network) holds the config,
every step's metrics, validation and checkpoint events — read back from its run directory."""

import json
import struct

import pytest

from conftest import TINY
from ultratron.errors import ConfigError

wandb = pytest.importorskip("wandb")


def read_wandb_records(path, block=32 * 1024):
    """The records of a W&B transaction log (run-ID.wandb): the LevelDB log format — a 7-byte file
    header, 32 KiB blocks, each chunk a 7-byte header (CRC32C, length, type: 1 full, 2 first, 3
    middle, 4 last) — holding protobuf `Record`s. This is what `wandb sync` uploads."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            out.append(pending + chunk if kind == 4 else chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
    records = []
    for raw in out:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def test_offline_wandb_run_holds_config_and_every_step(tiny_overrides, tmp_path):
    from ultratron.config import load_config
    from ultratron.training.metrics import read_metrics
    from ultratron.training.trainer import train

    cfg = load_config(None, tiny_overrides + ["--training.steps", "4", "--eval.interval", "2",
                                              "--checkpoint.interval", "2", "--run.wandb", "true",
                                              "--run.wandb_tags", "tiny,test", "--run.wandb_name", "w1"])
    train(cfg, echo=False)
    run_dir = tmp_path / "run"
    logs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    records = read_wandb_records(logs[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "w1" and list(run.tags) == ["tiny", "test"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["dim"] == 64 and config["training"]["steps"] == 4
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    steps = {h["step"]: h for h in history if "train/loss" in h}
    metrics = [m for m in read_metrics(run_dir) if "loss" in m]
    assert sorted(steps) == [1, 2, 3, 4] == [m["step"] for m in metrics]
    for m in metrics:
        assert steps[m["step"]]["train/loss"] == pytest.approx(m["loss"], rel=1e-12)
        assert steps[m["step"]]["train/grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-12)
    assert {h["step"] for h in history if "val/val_loss" in h} >= {2, 4}
    assert sorted(h["step"] for h in history if "checkpoint/step" in h) == [2, 4]
    assert (run_dir / "wandb-run-id").read_text().strip() == run.run_id


def test_wandb_settings_are_checked_before_the_run():
    from ultratron.config import load_config

    with pytest.raises(ConfigError, match="run.wandb_mode: 'offlne' is not one of"):
        load_config(None, TINY + ["--run.wandb", "true", "--run.wandb_mode", "offlne"])
