"""Training from shards on an object store (the loopback S3 server of tests/conftest.py), curated
there from raw text there: dp2 over two epochs of a set of ≥ 40 shards through a local cache of
data.cache_limit = 4 shards (polled: never above the limit + the one being fetched; the bytes
fetched per epoch ≤ 1.1× the set), then the same run killed with SIGKILL, resumed under dp4 and
then in one process: step by step the same sequences as the run never killed (so the multiset of
ids read is the first N of the stream) and the same losses."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from dist_jobs import record_sequence_ids, train_runs_recording_ids

from conftest import S3_BUCKET, TINY
from tolerances import REPLAY
from ultratron.config import load_config
from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_pipeline
from ultratron.launch.local import run_local
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import train

WORDS = ("the and of to with that river mountain garden window letter morning evening village teacher student "
         "market harbor winter summer bridge castle forest meadow captain doctor farmer painter singer").split()
LIMIT, BATCH = 4, 64  # shards in the cache; sequences a step (4096 tokens of 64)


def curate(fs, endpoint: str, tmp_path: Path) -> str:
    """Raw JSONL on the store → read, tokenize, shard → token shards on the store; returns their URL."""
    rng = random.Random(0)
    lines = [json.dumps({"id": f"d{i}", "text": "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) + "."
                                                            for _ in range(12))}) for i in range(60)]
    fs.pipe_file(f"{S3_BUCKET}/raw/docs.jsonl", ("\n".join(lines) + "\n").encode())
    url = f"s3://{S3_BUCKET}/curated"
    run_pipeline(from_dict({"pipeline": {"input": f"s3://{S3_BUCKET}/raw", "output": url, "endpoint": endpoint,
                                         "staging": str(tmp_path / "staging"), "progress": False,
                                         "stages": ["read", "tokenize", "shard"]},
                            "tokenize": {"vocab_size": 300, "train_bytes": 200_000},
                            "shard": {"held_out_fraction": 0.05, "tokens_per_shard": 300}}), log=lambda m: None)
    return f"{url}/02-shard"


def attempt_ids(run: Path, tag: str) -> dict[int, Counter]:
    """{step: ids every rank read} of one attempt (its ids files then moved aside under `tag`)."""
    out: dict[int, Counter] = {}
    for path in sorted(run.glob("ids-rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(record["step"], Counter()).update(record["ids"])
        path.rename(path.with_name(f"{tag}-{path.name}"))
    return out


def resumed_at(run: Path) -> int:
    return int(re.findall(r"resumed from \S+ at step (\d+)", (run / "train.log").read_text())[-1])


def test_train_from_s3_through_a_bounded_cache_killed_and_resumed_on_other_layouts(s3, tmp_path):
    server, fs = s3
    url = curate(fs, server.endpoint, tmp_path)
    meta = json.loads(fs.cat_file(url.removeprefix("s3://") + "/train/meta.json"))
    assert len(meta["shards"]) >= 10 * LIMIT
    n_seq = sum((s["n_tokens"] - 1) // 64 for s in meta["shards"])
    steps = 2 * n_seq // BATCH  # two epochs
    base = TINY + ["--data.path", url, "--data.endpoint", server.endpoint, "--data.cache_limit", str(LIMIT),
                   "--training.batch_tokens", str(BATCH * 64), "--training.steps", str(steps),
                   "--eval.interval", "0", "--optim.warmup_steps", "2", "--checkpoint.interval", "3"]
    run = lambda name, *more: [*base, *more, "--run.dir", str(tmp_path / name)]

    largest, stop = max(s["bytes"] for s in meta["shards"]), threading.Event()
    most: dict[str, int] = {}

    def poll():  # every rank's cache directory, as often as it can
        while not stop.is_set():
            for rank_dir in (tmp_path / "straight" / "data" / "remote").glob("*/rank*"):
                try:
                    size = sum(p.stat().st_size for p in rank_dir.iterdir())
                except FileNotFoundError:  # a file evicted while being listed
                    continue
                most[str(rank_dir)] = max(most.get(str(rank_dir), 0), size)
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        run_local(2, train_runs_recording_ids, [run("straight", "--parallel.dp", "2")])
    finally:
        stop.set()
        poller.join()
    assert most and max(most.values()) <= (LIMIT + 1) * largest, (most, largest)
    straight_steps = [r for r in read_metrics(tmp_path / "straight") if "loss" in r]
    dataset = sum(s["bytes"] for s in meta["shards"])
    assert straight_steps[-1]["data/fetched_bytes"] <= 2 * 1.1 * dataset  # rank 0's, over two epochs
    straight = attempt_ids(tmp_path / "straight", "done")
    assert sorted(straight) == list(range(1, steps + 1))

    # the same run killed (SIGKILL, the whole group) once it has saved step 3 or later
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])]))
    script = ("import sys, json; from ultratron.launch.local import run_local; from dist_jobs import "
              "train_runs_recording_ids; run_local(2, train_runs_recording_ids, [json.loads(sys.argv[1])])")
    child = subprocess.Popen([sys.executable, "-c", script, json.dumps(run("split", "--parallel.dp", "2"))],
                             env=env, start_new_session=True)
    latest = tmp_path / "split" / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not (latest.is_file() and int(latest.read_text().strip().rsplit("-", 1)[-1] or 0) >= 3):
        assert child.poll() is None and time.monotonic() < deadline, "the run ended before it was killed"
        time.sleep(0.02)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    first = attempt_ids(tmp_path / "split", "a1")
    run_local(4, train_runs_recording_ids, [run("split", "--parallel.dp", "4", "--checkpoint.resume", "auto",
                                                "--training.stop_after", "3")])
    at_dp4 = resumed_at(tmp_path / "split")
    second = attempt_ids(tmp_path / "split", "a2")
    undo = record_sequence_ids(0)
    try:
        train(load_config(None, run("split", "--checkpoint.resume", "auto")), echo=False)
    finally:
        undo()
    at_dp1 = resumed_at(tmp_path / "split")
    third = attempt_ids(tmp_path / "split", "a3")
    timeline = {s: c for s, c in first.items() if s <= at_dp4} | {s: c for s, c in second.items() if s <= at_dp1} \
        | third
    assert at_dp4 >= 3 and at_dp1 == at_dp4 + 3
    assert timeline == straight  # the same sequences in every step: none repeated, none skipped
    epoch_one = sum((straight[s] for s in range(1, n_seq // BATCH + 1)), Counter())
    assert max(epoch_one.values()) == 1  # the stream itself repeats nothing within an epoch

    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "split") if "loss" in r}
    want = {r["step"]: r["loss"] for r in straight_steps}
    assert sorted(got) == sorted(want)
    gaps = {s: abs(got[s] - want[s]) / abs(want[s]) for s in want}
    print("relative loss gaps", {s: f"{g:.1e}" for s, g in gaps.items()})
    assert all(gaps[s] == 0 for s in want if s <= at_dp4)  # dp2 as the run never killed: bit for bit
    assert max(gaps.values()) <= REPLAY, gaps
