"""Fault injection on one process: damaged checkpoints, a real full disk, a real kill in the
middle of a save, loss spikes and NaN gradients. Each fault is real where this machine can make it
real (a tmpfs that fills up, SIGKILL); where it is injected, it is by the test itself, from
outside the code under test."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from conftest import Counter, losses
from ultratron.checkpoint import verify as verify_module
from ultratron.checkpoint.checkpointer import Checkpointer
from ultratron.checkpoint.manager import ModelState, read_checkpoint
from ultratron.checkpoint.verify import verify
from ultratron.config import load_config
from ultratron.errors import CheckpointError, TrainingError
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import Trainer, train

ROOT = Path(__file__).resolve().parents[1]



@pytest.fixture
def base(tiny_overrides, tmp_path) -> list[str]:
    return tiny_overrides + ["--eval.interval", "0", "--data.cache_dir", str(tmp_path / "data")]


# ---- 1. flipped bytes ------------------------------------------------------------------------------

def test_flipped_bytes_are_found_and_resume_falls_back_to_the_last_good_checkpoint(base, tmp_path):
    run = tmp_path / "run"
    common = base + ["--run.dir", str(run), "--checkpoint.interval", "2", "--checkpoint.keep", "3"]
    train(load_config(None, common + ["--training.steps", "6"]), echo=False)
    first = losses(run)
    shard = run / "checkpoints/step-0000006/dcp/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])  # XOR 4 KB
    shard.write_bytes(bytes(data))

    train(load_config(None, common + ["--training.steps", "8", "--checkpoint.resume", "auto"]), echo=False)
    log = (run / "train.log").read_text()
    assert "step-0000006 failed verification, skipped; moved to" in log
    assert "dcp/__0_0.distcp does not match its checksum" in log
    assert f"resumed from {run / 'checkpoints/step-0000004'} at step 4" in log
    again = losses(run)
    assert sorted(again) == list(range(1, 9))
    for step in (5, 6):  # steps 5 and 6 retrained from the good step 4 equal the first run's exactly
        assert again[step] == first[step], (step, again[step], first[step])
    assert (run / "checkpoints/corrupt-step-0000006").is_dir()  # kept for a person to inspect
    kept = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert kept == ["step-0000004", "step-0000006", "step-0000008"]  # the verified step 4 was not pruned


# ---- 3. truncated shard, overwritten state ----------------------------------------------------------

def test_truncated_or_overwritten_newest_checkpoints_are_skipped_with_a_reason(tmp_path):
    messages: list[str] = []
    checkpointer = Checkpointer(tmp_path, keep=5, log=messages.append)
    for step in (10, 20, 30):
        model = torch.nn.Linear(64, 64)
        with torch.no_grad():
            model.weight.fill_(float(step))
        checkpointer.save(step, ModelState(model), Counter(step), {"config.toml": ""}).result()
    shard = tmp_path / "step-0000030/dcp/__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    (tmp_path / "step-0000020/state.pt").write_bytes(b"overwritten by something else")

    with pytest.raises(CheckpointError, match=r"step-0000030 failed verification: dcp/__0_0.distcp has [\d,]+ bytes, "
                                              r"the manifest says [\d,]+ \(truncated or overwritten\)"):
        read_checkpoint(tmp_path / "step-0000030", ModelState(torch.nn.Linear(64, 64)))
    chosen = Checkpointer(tmp_path, log=messages.append).newest_verified()
    assert chosen == tmp_path / "step-0000010"
    assert any("step-0000030 failed verification" in m for m in messages)
    assert any("step-0000020 failed verification" in m and "state.pt has 29 bytes" in m for m in messages)
    model, counter = torch.nn.Linear(64, 64), Counter()
    read_checkpoint(chosen, ModelState(model), counter)
    assert counter.step == 10 and torch.equal(model.weight, torch.full((64, 64), 10.0))


def test_damage_past_the_first_hashing_chunk_is_found_and_named(tmp_path):
    """Files are hashed in CHUNK-sized reads: a shard over one chunk, damaged only after its first
    chunk (one byte just past it, or its very last byte) or cut short there, fails verification
    by name, and the resume takes the older intact checkpoint."""
    # 1024 × 2080 fp32 weights: 8.1 MiB, just over the real 8 MiB chunk (not a patched smaller one)
    messages: list[str] = []
    checkpointer = Checkpointer(tmp_path, keep=5, log=messages.append)
    for step in (10, 20, 30, 40):
        model = torch.nn.Linear(1024, 2080, bias=False)
        with torch.no_grad():
            model.weight.fill_(float(step))
        checkpointer.save(step, ModelState(model), Counter(step), {"config.toml": ""}).result()
    name = "dcp/__0_0.distcp"
    shards = {step: tmp_path / f"step-{step:07d}" / name for step in (10, 20, 30, 40)}
    size = shards[10].stat().st_size
    assert size > verify_module.CHUNK + 4096  # the damage below lies wholly past the first chunk
    manifest = json.loads((tmp_path / "step-0000010" / "manifest.json").read_text())
    assert manifest["files"][name] == {"size": size, "sha256": hashlib.sha256(shards[10].read_bytes()).hexdigest()}

    def flip(path, offset):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01  # one bit
        path.write_bytes(bytes(data))

    flip(shards[20], verify_module.CHUNK + 4096)
    flip(shards[30], size - 1)
    with open(shards[40], "r+b") as fh:
        fh.truncate(verify_module.CHUNK + 4096)
    storage = checkpointer.storage
    assert verify(storage, tmp_path / "step-0000010") == []
    for step in (20, 30):
        assert verify(storage, tmp_path / f"step-{step:07d}") == [
            f"{name} does not match its checksum (its bytes changed after it was written)"]
    assert verify(storage, tmp_path / "step-0000040") == [
        f"{name} has {verify_module.CHUNK + 4096:,} bytes, the manifest says {size:,} (truncated or overwritten)"]
    with pytest.raises(CheckpointError, match=f"step-0000030 failed verification: {name} does not match"):
        read_checkpoint(tmp_path / "step-0000030", ModelState(torch.nn.Linear(1024, 2080, bias=False)))

    chosen = Checkpointer(tmp_path, log=messages.append).newest_verified()
    assert chosen == tmp_path / "step-0000010"
    assert [m.split(" failed verification")[0].rsplit("/", 1)[-1] for m in messages] == [
        "step-0000040", "step-0000030", "step-0000020"]
    model, counter = torch.nn.Linear(1024, 2080, bias=False), Counter()
    read_checkpoint(chosen, ModelState(model), counter)
    assert counter.step == 10 and torch.equal(model.weight, torch.full((2080, 1024), 10.0))


# ---- 4. killed during a save ---------------------------------------------------------------------------

DRIVER = """
import sys, time
import ultratron.checkpoint.manager as manager
real = manager.write_manifest
def stalled(storage, tmp, step):  # the injected fault: the save of step 4 hangs after its tensors are written
    if step == 4:
        print("SAVING", flush=True)
        time.sleep(120)
    return real(storage, tmp, step)
manager.write_manifest = stalled
from ultratron.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_a_kill_during_a_save_leaves_nothing_behind_after_the_resume(base, tmp_path):
    run = tmp_path / "run"
    args = base + ["--run.dir", str(run), "--training.steps", "6", "--checkpoint.interval", "2",
                   "--checkpoint.async_save", "false"]
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(driver), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "SAVING"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    orphans = list((run / "checkpoints").glob(".tmp-step-0000004-*"))
    assert len(orphans) == 1 and (orphans[0] / "dcp" / ".metadata").is_file()  # killed mid-save, for real

    train(load_config(None, args + ["--checkpoint.resume", "auto"]), echo=False)
    log = (run / "train.log").read_text()
    assert f"removed {orphans[0]}, left by an interrupted save" in log
    assert "at step 2" in log.split("resumed from")[1].splitlines()[0]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-0000002", "step-0000004",
                                                                              "step-0000006"]


# ---- 2. disk full ----------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem that fills up: a tmpfs of a given size (needs root, as in CI)."""
    mounts = []

    def make(size_kb: int) -> Path:
        where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield make
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _train_cli(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ultratron", "train", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_a_full_disk_stops_training_with_one_clear_line_and_frees_what_it_wrote(base, tmp_path, small_disk):
    # The tiny model's checkpoint is about 1.6 MB; its tensors alone about 1.3 MB.
    # (a) room for one checkpoint: the second is refused before a byte is written
    disk = small_disk(2600)
    run = disk / "run"
    done = _train_cli(base + ["--run.dir", str(run), "--training.steps", "6", "--checkpoint.interval", "2"])
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: no space left on {disk} "), done.stderr[-2000:]
    assert "the checkpoint needs ~1.5 MB" in errors[0] and "training stopped at step 4" in errors[0]
    assert "Traceback" not in done.stderr
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-0000002"]
    # and the run resumes from what it saved (the disk is still too full for more, so it stops again, cleanly)
    again = _train_cli(base + ["--run.dir", str(run), "--training.steps", "6", "--checkpoint.interval", "2",
                               "--checkpoint.resume", "auto"])
    assert again.returncode == 2, again.stderr[-2000:]
    assert "at step 2" in (run / "train.log").read_text().split("resumed from")[1].splitlines()[0]
    assert "error: no space left on" in again.stderr and "Traceback" not in again.stderr

    # (b) room for the tensors' estimate but not for the files: the write itself hits ENOSPC
    disk = small_disk(1400)
    run = disk / "run"
    done = _train_cli(base + ["--run.dir", str(run), "--training.steps", "2"])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: no space left on " + str(disk) in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not list((run / "checkpoints").glob(".tmp-*")) and not list((run / "checkpoints").glob("step-*"))
    assert shutil.disk_usage(disk).free > 1_000_000  # the partial checkpoint was removed


# ---- 6. loss spikes and NaN gradients ------------------------------------------------------------------

def _injected(cfg, garbage_steps: set[int], nan_step: int | None):
    """A trainer whose loader serves random tokens for the batches of `garbage_steps` (by loader
    position, so data skipped by a rollback is never served again) and whose gradients turn NaN at
    `nan_step`: faults from outside, through the trainer's public parts."""
    trainer = Trainer(cfg, echo=False)
    loader, accum, mbs = trainer.train_loader, cfg.grad_accum_steps, cfg.training.micro_batch_size
    positions = {((k - 1) * accum + i) * mbs for k in garbage_steps for i in range(accum)}
    served, real = [], loader.next_batch

    def next_batch():
        position = loader.consumed  # the global position: sequences consumed so far
        inputs, targets = real()
        if loader.epoch == 0 and position in positions:
            served.append(position)
            seeded = torch.Generator().manual_seed(position)
            noise = torch.randint(0, cfg.model.vocab_size, inputs.shape, generator=seeded)
            return noise, torch.roll(noise, -1, 1)
        return inputs, targets

    loader.next_batch = next_batch
    if nan_step is not None:
        weight = dict(trainer.model.named_parameters())["layers.0.attention.wq.weight"]
        weight.register_hook(lambda g: g * float("nan") if trainer.step == nan_step - 1 else g)
    return trainer, served


def test_a_spike_rolls_back_past_its_data_and_a_nan_step_is_skipped(base, tmp_path):
    common = base + ["--training.steps", "40", "--checkpoint.interval", "5", "--eval.interval", "40",
                     "--eval.batches", "4"]
    clean = train(load_config(None, common + ["--run.dir", str(tmp_path / "clean")]), echo=False)
    run = tmp_path / "faulty"
    trainer, served = _injected(load_config(None, common + ["--run.dir", str(run)]), {28}, nan_step=12)
    faulty = trainer.fit()

    records = read_metrics(run)
    assert [r for r in records if r.get("skipped")] == [r for r in records if r["step"] == 12 and "loss" in r]
    assert [(r["step"], r["spike_step"]) for r in records if "rollback" in r] == [(25, 28)]
    assert sorted(r["step"] for r in records if "loss" in r) == list(range(1, 41))  # each step once
    assert len(served) == 2  # the garbage window (2 micro-batches) was served once, then skipped
    log = (run / "train.log").read_text()
    assert "step 12: loss" in log and "not finite, the update is skipped (1 skipped so far)" in log
    assert "step 28: spike (loss" in log and "rolled back to step 25 and skipped the data of steps 26–28" in log
    assert abs(faulty.final_val_loss - clean.final_val_loss) <= 0.02 * clean.final_val_loss, (
        faulty.final_val_loss, clean.final_val_loss)


def test_spikes_beyond_the_allowed_rollbacks_stop_with_a_report(base, tmp_path):
    cfg = load_config(None, base + ["--training.steps", "40", "--checkpoint.interval", "5", "--run.dir",
                                    str(tmp_path / "run"), "--stability.max_rollbacks", "1"])
    trainer, _ = _injected(cfg, {24, 33}, nan_step=None)
    with pytest.raises(TrainingError) as caught:
        trainer.fit()
    lines = caught.value.problems
    assert lines[0].startswith("training is unstable")
    assert any("step 24: spike" in line and "rolled back to step 20" in line for line in lines)
    # the window 21–24 was skipped, so the second garbage batch (step 33 of the stream) comes at step 29
    assert any("step 29: spike" in line and "one more than stability.max_rollbacks 1" in line for line in lines)


def test_resilience_settings_are_validated_before_anything_starts(tmp_path):
    done = _train_cli(["--checkpoint.dir", "nosuchproto://bucket/x", "--stability.window", "5",
                       "--health.straggler_factor", "1", "--run.dir", str(tmp_path / "run")])
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert errors == ["error: checkpoint.dir 'nosuchproto://bucket/x': unknown storage protocol 'nosuchproto'",
                      "error: stability.min_steps=20 exceeds stability.window=5",
                      "error: health.straggler_factor must exceed 1, got 1.0"]
    assert not (tmp_path / "run").exists()


def test_without_a_gpu_the_health_check_says_so_and_times_the_cpu(base, tmp_path):
    run = tmp_path / "run"
    train(load_config(None, base + ["--run.dir", str(run), "--training.steps", "1"]), echo=False)
    line = next(x for x in (run / "train.log").read_text().splitlines() if "health: step 0" in x)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "1 rank(s); no GPU: " in line and "matmul " in line and line.endswith("; ok")


def test_a_straggler_and_a_failing_gpu_are_named_by_host_and_rank():
    from ultratron.training.health import GpuHealth, RankHealth, judge, stragglers

    ok = GpuHealth(True, "1 GPU(s) checked")
    bad = GpuHealth(True, "1 GPU(s) checked", problems=["GPU 0: XID 79 (GPU fell off the bus)"])
    reports = [RankHealth(0, "node1", 0.010, 0.002, ok), RankHealth(1, "node1", 0.011, 0.002, ok),
               RankHealth(2, "node2", 0.035, 0.002, bad), RankHealth(3, "node2", 0.010, 0.009, ok)]
    problems, warnings, failing = judge(reports, factor=2.0)
    assert problems == ["node2 rank 2: GPU 0: XID 79 (GPU fell off the bus)"] and failing == ["node2"]
    assert warnings == ["node2 rank 2: straggler: matmul 35.00 ms, 3.5× the other ranks' median 10.00 ms",
                        "node2 rank 3: straggler: all-reduce 9.00 ms, 4.5× the other ranks' median 2.00 ms"]
    assert stragglers([1.0, 2.5], 2.0) == [1] and stragglers([1.0, 1.9], 2.0) == [] and stragglers([5.0], 2.0) == []
