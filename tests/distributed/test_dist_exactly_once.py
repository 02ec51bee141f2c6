"""Resume on another number of ranks with every training sequence read exactly once: the data
position is global (sequences consumed, per mixture source too), so a run stopped at step 3 under
dp2 and resumed under dp4 or in one process reads, step by step, the sequences of the run that never
stopped. Each rank records the ids each step read (dist_jobs.record_sequence_ids)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

from dist_common import STEPS, dist_base_fixture  # noqa: F401 (fixture)
from dist_jobs import record_sequence_ids, train_runs_recording_ids

from ultratron.config import load_config
from ultratron.launch.local import run_local
from ultratron.training.trainer import train

STOP = 3


def steps_read(run: Path) -> dict[int, Counter]:
    """{step: the multiset of sequence ids every rank read in it}, from all attempts' records."""
    out: dict[int, Counter] = {}
    for path in run.glob("ids-rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(record["step"], Counter()).update(
                tuple(i) if isinstance(i, list) else i for i in record["ids"])
    return out


def test_stopped_at_dp2_and_resumed_at_dp4_or_dp1_reads_each_sequence_once(dist_base, tmp_path):
    cache = Path(load_config(None, dist_base).data.cache_dir)
    mixture = ["--data.path", "", "--data.sources", f"web={cache},code={cache}", "--data.weights", "web=0.7,code=0.3"]
    common = ["--eval.interval", "0", "--training.sample_tokens", "0"]
    kinds = {"one": dist_base + common, "mix": dist_base + mixture + common}
    run = lambda name, *more: [*kinds[name.split("-")[0]], *more, "--run.dir", str(tmp_path / name)]
    dp = lambda n: ["--parallel.dp", str(n)]
    # never stopped (dp2), and stopped after step 3 (dp2); both kinds of data
    stop = ["--training.stop_after", str(STOP)]
    run_local(2, train_runs_recording_ids, [run("one-straight", *dp(2)), run("one-split", *dp(2), *stop),
                                            run("mix-straight", *dp(2)), run("mix-split", *dp(2), *stop)])
    for name in ("one", "mix"):
        shutil.copytree(tmp_path / f"{name}-split", tmp_path / f"{name}-dp1")
    run_local(4, train_runs_recording_ids, [run(f"{name}-split", *dp(4), "--checkpoint.resume", "auto")
                                            for name in ("one", "mix")])
    undo = record_sequence_ids(0)
    try:
        for name in ("one", "mix"):
            train(load_config(None, run(f"{name}-dp1", "--checkpoint.resume", "auto")), echo=False)
    finally:
        undo()

    for name in ("one", "mix"):
        straight = steps_read(tmp_path / f"{name}-straight")
        assert sorted(straight) == list(range(1, STEPS + 1))
        everything = sum(straight.values(), Counter())
        assert max(everything.values()) == 1 and sum(everything.values()) == STEPS * 16  # 16 sequences a step
        for resumed in ("split", "dp1"):
            got = steps_read(tmp_path / f"{name}-{resumed}")
            assert got == straight, (name, resumed)  # the same sequences in every step: none repeated or skipped
        log = (tmp_path / f"{name}-split" / "train.log").read_text()
        assert f"saved under dp2, resumed under dp4: the data position is global ({STOP * 16} sequences" in log
    # a mixture: per source too (ids are (source, index)); the weights hold over the whole run
    per_source = Counter(source for source, _ in sum(steps_read(tmp_path / "mix-dp1").values(), Counter()))
    assert per_source == Counter(source for source, _ in sum(steps_read(tmp_path / "mix-straight").values(), Counter()))
    assert abs(per_source[0] / (STEPS * 16) - 0.7) <= 1 / 16


def test_a_different_global_batch_on_resume_warns_and_reads_on_without_a_repeat(dist_base, tmp_path):
    common = dist_base + ["--eval.interval", "0", "--training.sample_tokens", "0", "--run.dir", str(tmp_path / "run")]
    undo = record_sequence_ids(0)
    try:
        train(load_config(None, common + ["--training.stop_after", str(STOP)]), echo=False)
        train(load_config(None, common + ["--training.batch_tokens", "2048", "--checkpoint.resume", "auto"]),
              echo=False)
    finally:
        undo()
    got = steps_read(tmp_path / "run")
    sizes = [sum(got[s].values()) for s in sorted(got)]
    assert sizes == [16] * STOP + [32] * (STEPS - STOP)
    assert max(sum(got.values(), Counter()).values()) == 1  # nothing read twice across the change
    log = (tmp_path / "run" / "train.log").read_text()
    assert "warning: training.batch_tokens was 1,024 when this checkpoint was saved, now 2,048: the data goes on " \
           f"from sequence {STOP * 16}" in log
