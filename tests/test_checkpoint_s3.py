"""Checkpoints in an object store: a real S3-compatible server (moto's server mode) on loopback,
reached through s3fs exactly as a cluster reaches S3 or MinIO — not a mock of the client."""

from __future__ import annotations

import torch

from conftest import S3_BUCKET, losses
from ultratron.checkpoint.checkpointer import Checkpointer
from ultratron.checkpoint.manager import ModelState
from ultratron.config import load_config
from ultratron.training.trainer import train

BUCKET = S3_BUCKET


def test_save_list_verify_resume_and_retention_through_s3(s3, tiny_overrides, tmp_path):
    server, fs = s3
    url = f"s3://{BUCKET}/runs/one"
    common = tiny_overrides + ["--eval.interval", "0", "--checkpoint.dir", url, "--checkpoint.endpoint",
                               server.endpoint, "--checkpoint.interval", "2", "--checkpoint.keep", "2"]
    train(load_config(None, common + ["--training.steps", "6"]), echo=False)
    first = losses(tmp_path / "run")
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/runs/one")) == ["latest", "step-0000004",
                                                                                 "step-0000006"]
    assert fs.cat_file(f"{BUCKET}/runs/one/latest") == b"step-0000006\n"
    step6 = f"{BUCKET}/runs/one/step-0000006"
    assert {"complete", "manifest.json", "state.pt", "config.toml", "tokenizer.json"} <= {
        p.rsplit("/", 1)[1] for p in fs.ls(step6)}
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing went to local disk

    shard = f"{step6}/dcp/__0_0.distcp"  # flip 4 KB in the object store itself
    data = bytearray(fs.cat_file(shard))
    data[1000:5096] = bytes(b ^ 0x5A for b in data[1000:5096])
    fs.pipe_file(shard, bytes(data))
    train(load_config(None, common + ["--training.steps", "8", "--checkpoint.resume", "auto"]), echo=False)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step-0000006 failed verification, skipped; its marker removed" in log
    assert f"resumed from s3://{BUCKET}/runs/one/step-0000004 at step 4" in log
    again = losses(tmp_path / "run")
    assert again[5] == first[5] and again[6] == first[6]
    fs.invalidate_cache()
    assert fs.cat_file(f"{BUCKET}/runs/one/latest") == b"step-0000008\n"


def test_the_store_going_down_during_a_save_costs_that_save_only(s3, tiny_overrides, tmp_path, monkeypatch):
    server, fs = s3
    import ultratron.checkpoint.manager as manager

    real = manager.write_manifest

    def outage(storage, ckpt, step):  # the injected fault: the server stops in the middle of step 4's save
        if step != 4:
            return real(storage, ckpt, step)
        server.stop()
        try:
            return real(storage, ckpt, step)
        finally:
            server.start()  # and is back before the next interval

    monkeypatch.setattr(manager, "write_manifest", outage)
    url = f"s3://{BUCKET}/runs/two"
    common = tiny_overrides + ["--eval.interval", "0", "--checkpoint.dir", url, "--checkpoint.endpoint",
                               server.endpoint, "--checkpoint.interval", "2", "--training.steps", "6"]
    result = train(load_config(None, common), echo=False)
    assert result.steps_done == 6  # training went on
    log = (tmp_path / "run" / "train.log").read_text()
    assert "checkpoint: saving step 4 failed, training goes on and the next interval tries again (last good " \
           f"checkpoint: {url}/step-0000002)" in log
    assert f"Cannot connect to host 127.0.0.1:{server.port}" in log
    assert "checkpoint: saved step 6" in log

    monkeypatch.setattr(manager, "write_manifest", real)
    checkpointer = Checkpointer(url, endpoint=server.endpoint)
    assert [str(c).rsplit("/", 1)[1] for c in checkpointer.root.complete()] == ["step-0000002", "step-0000006"]
    from ultratron.models.registry import build_model

    model = build_model(load_config(None, common).model)  # the previous checkpoint is whole: verifies and loads
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert checkpointer.newest_verified(before_step=4) == f"{url}/step-0000002"
    checkpointer.load(f"{url}/step-0000002", ModelState(model))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
