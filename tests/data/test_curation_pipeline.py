"""End to end: bad input counted not fatal, report and decision log, shards the trainer reads,
parallel == serial, single-stage CLI, and resume after a real kill."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_pipeline
from ultratron.data.shards import ShardSet

WORDS = ("the and of to with that river mountain garden window letter morning evening village teacher student "
         "market harbor winter summer bridge castle forest meadow captain doctor farmer painter singer").split()


def _prose(rng: random.Random, sentences: int = 12) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + "." for _ in range(sentences))


def make_corpus(root: Path) -> dict[str, int]:
    """A directory with good text, duplicates and every kind of bad input; returns expected bad counts."""
    rng = random.Random(0)
    root.mkdir(parents=True)
    texts = [_prose(rng) for _ in range(60)]
    for i, text in enumerate(texts):
        (root / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    (root / "copy.txt").write_text(texts[5], encoding="utf-8")  # an exact duplicate
    (root / "bad_utf8.txt").write_bytes(b"caf\xe9 au lait, not UTF-8 at all" * 3)
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "empty.txt").write_text("   \n\n", encoding="utf-8")
    (root / "huge.txt").write_text("x " * 60_000, encoding="utf-8")  # over read.max_doc_bytes below
    lines = [json.dumps({"id": f"j{i}", "text": _prose(rng), "lang": "en"}) for i in range(10)]
    lines.insert(3, '{"id": "broken", "text": "unterminated')
    lines.insert(5, '["not", "an", "object"]')
    (root / "more.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(5)], "text": [_prose(rng) for _ in range(5)]}),
                   root / "table.parquet")
    return {"invalid_utf8": 1, "binary": 1, "empty": 1, "too_large": 1, "malformed_jsonl": 1, "bad_record": 1}


def config(src: Path, out: Path, workers: int = 1, **extra) -> dict:
    return {"pipeline": {"input": str(src), "output": str(out), "workers": workers, "docs_per_part": 20,
                         "progress": False},
            "read": {"max_doc_bytes": 100_000, "extensions": ".txt,.jsonl,.parquet"},
            "filter": {"enabled": ["gopher_repetition", "punctuation"]},
            "tokenize": {"vocab_size": 300, "train_bytes": 200_000},
            "shard": {"held_out_fraction": 0.2}, **extra}


def final_outputs(out: Path) -> dict:
    shard_dir = out / "07-shard"
    result = {"parts": {p.name: p.read_text() for p in sorted(shard_dir.glob("*.jsonl"))}}
    for split in ("train", "val"):
        result[split] = {p.name: p.read_bytes() for p in sorted((shard_dir / split).glob("*.bin"))}
    result["decisions"] = sorted((out / "decisions.jsonl").read_text().splitlines())
    return result


def test_pipeline_end_to_end_with_bad_input(tmp_path):
    expected_bad = make_corpus(tmp_path / "src")
    report = run_pipeline(from_dict(config(tmp_path / "src", tmp_path / "out")), log=lambda _: None)
    read = report["stages"][0]
    for reason, count in expected_bad.items():
        assert read["removed"][reason] == count, reason
    assert read["docs_in"] == 61 + 4 + 12 + 5 and read["docs_out"] == 61 + 10 + 5
    exact = report["stages"][2]
    assert exact["removed"] == {"exact_duplicate": 1}
    # every input document is explained in the merged decision log
    decisions = [json.loads(line) for line in (tmp_path / "out" / "decisions.jsonl").read_text().splitlines()]
    by_id = {}
    for d in decisions:
        by_id.setdefault(d["id"], []).append(d)
    dup = [d for d in decisions if d["reason"] == "exact_duplicate"]
    assert len(dup) == 1 and dup[0]["cluster"] in {"doc005.txt", "copy.txt"} and dup[0]["id"] != dup[0]["cluster"]
    assert by_id["huge.txt"][0]["reason"] == "too_large"
    assert report["stages"][-1]["docs_out"] == sum(1 for d in decisions if d["decision"] == "kept")
    # the trainer's shards: tokens decode back to the cleaned text, split by held_out
    shard_dir = Path(report["trainer_data_path"])
    train, val = ShardSet.open(shard_dir / "train"), ShardSet.open(shard_dir / "val")
    shard = report["stages"][-1]["token_shards"]
    assert train.meta["n_documents"] + val.meta["n_documents"] == report["stages"][-1]["docs_out"]
    assert train.n_tokens == shard["train"]["n_tokens"] > 0 and val.n_tokens > 0
    assert report["stages"][-2]["tokens_out"] == train.n_tokens + val.n_tokens - train.meta["n_documents"] \
        - val.meta["n_documents"]  # shards add one EOS per document
    table = pq.read_table(shard_dir / "parquet").to_pydict()
    assert len(table["id"]) == report["stages"][-1]["docs_out"] and set(table["split"]) == {"train", "val"}
    audit = json.loads((tmp_path / "out" / "06-tokenize" / "audit.json").read_text())
    assert audit["all_round_trip"] and audit["unknown_tokens"] == 0
    assert set(audit["domains"]) >= {"chinese", "cyrillic", "arabic", "accented_latin", "code", "math"}
    # a tokenizer trained on English prose compresses CJK worse than its own corpus
    assert audit["domains"]["chinese"]["bytes_per_token"] < audit["corpus"]["bytes_per_token"]
    assert (tmp_path / "out" / "report.md").read_text().count("|") > 40


def test_parallel_run_matches_serial_run(tmp_path):
    make_corpus(tmp_path / "src")
    run_pipeline(from_dict(config(tmp_path / "src", tmp_path / "serial", workers=1)), log=lambda _: None)
    run_pipeline(from_dict(config(tmp_path / "src", tmp_path / "parallel", workers=2)), log=lambda _: None)
    assert final_outputs(tmp_path / "serial") == final_outputs(tmp_path / "parallel")


# The fault for the resume test: `ultratron data run` in a process whose part writer SIGKILLs
# it (a real kill: no cleanup, no exception handler runs) once N parts are finished.
KILLING_DRIVER = """
import os
import signal
import sys

from ultratron.cli import main
from ultratron.curation import frame

limit, finished = int(sys.argv[1]), 0
close = frame.PartWriter.close


def close_then_die_at_limit(self, extra=None):
    global finished
    stats = close(self, extra)
    finished += 1
    if finished >= limit:
        os.kill(os.getpid(), signal.SIGKILL)
    return stats


frame.PartWriter.close = close_then_die_at_limit
sys.exit(main(sys.argv[2:]))
"""


def test_resume_after_kill_gives_same_output_without_redoing_work(tmp_path):
    make_corpus(tmp_path / "src")
    cfg_path = tmp_path / "data.toml"
    lines = []
    for section, values in config(tmp_path / "src", tmp_path / "out").items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    cfg_path.write_text("\n".join(lines) + "\n")
    args = ["data", "run", "--config", str(cfg_path)]
    driver = tmp_path / "kill_after_parts.py"
    driver.write_text(KILLING_DRIVER)
    # 82 inputs in parts of 20 = 5 parts per stage: the 11th finished part is the first of exact-dedup
    killed = subprocess.run([sys.executable, str(driver), "11", *args], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    out = tmp_path / "out"
    assert (out / "01-normalize" / "_DONE.json").is_file() and not (out / "02-exact-dedup" / "_DONE.json").exists()
    # every file the killed run finished (parts, decision logs, stats, indexes) stays untouched
    before = {p: p.stat().st_mtime_ns for p in out.glob("0*/**/*") if p.is_file()}
    assert (out / "02-exact-dedup" / "_stats" / "part-00000.json") in before
    resumed = subprocess.run([sys.executable, "-m", "ultratron", *args], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("(done earlier)") == 2  # read and normalize
    assert {p: p.stat().st_mtime_ns for p in before} == before
    run_pipeline(from_dict(config(tmp_path / "src", tmp_path / "clean")), log=lambda _: None)
    assert final_outputs(out) == final_outputs(tmp_path / "clean")


def test_single_stage_cli_with_overrides_and_config_errors(tmp_path, capsys):
    from ultratron.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "text": "Caf\\u0065\\u0301\\u0007  au   lait"}\nnot json\n{"id": "b", "text": ""}\n')
    assert main(["data", "normalize", "--input", str(src), "--output", str(tmp_path / "norm")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["removed"] == {"malformed_jsonl": 1, "empty_after_normalize": 1} and shown["docs_out"] == 1
    record = json.loads((tmp_path / "norm" / "in.jsonl").read_text())
    assert record == {"id": "a", "text": "Caf\u00e9 au lait"}  # NFC: é is one code point
    # a --section.field override reaches the stage: NFD keeps e + combining acute, and the control character still goes
    assert main(["data", "normalize", "--input", str(src), "--output", str(tmp_path / "nfd"),
                 "--normalize.form", "NFD", "--workers", "1"]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "nfd" / "in.jsonl").read_text())["text"] == "Cafe\u0301 au lait"
    # unknown fields: reported before any value is checked, one line each, exit 2
    bad = tmp_path / "bad.toml"
    bad.write_text('[near_dedup]\nbandz = 3\n')
    assert main(["data", "run", "--config", str(bad), "--pipeline.wrokers", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {bad}: unknown config field 'near_dedup.bandz' (did you mean 'bands'?)",
        "error: unknown config field 'pipeline.wrokers' (did you mean 'workers'?)"]
    # values: an unknown stage (a choice) and an impossible one, together
    bad.write_text('[pipeline]\nstages = ["read", "dedup"]\nworkers = -1\n')
    assert main(["data", "run", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("error: pipeline.stages: 'dedup' is not one of read, normalize, ")
    assert err[0].endswith("(did you mean 'near-dedup'?)")
    assert err[1] == "error: pipeline.workers = -1 must be ≥ 0 (0: one per CPU core)"


def test_a_rerun_removes_every_temporary_file_a_kill_left(tmp_path):
    """A kill between writing `NAME.tmpPID` and renaming it leaves the part behind anywhere the
    pipeline writes: its own files at the top of the output and finished stages' directories too.
    The next run removes them all and changes nothing else."""
    make_corpus(tmp_path / "src")
    cfg = from_dict(config(tmp_path / "src", tmp_path / "out"))
    run_pipeline(cfg, log=lambda _: None)
    out = tmp_path / "out"
    before = final_outputs(out)
    planted = [out / "report.json.tmp4242", out / "decisions.jsonl.tmp4242", out / "config.json.tmp77",
               out / "02-exact-dedup" / "part-00000.jsonl.tmp4242", out / "07-shard" / "train" / "meta.json.tmp",
               out / "03-near-dedup" / "_index" / "part-00000.tmp.npy"]
    for path in planted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("half written\n")
    lines = []
    run_pipeline(cfg, log=lines.append)
    assert [p for p in planted if p.exists()] == []
    assert [p for p in out.rglob("*") if ".tmp" in p.name] == []
    assert any("removed 6 half-written file(s)" in line for line in lines), lines
    assert final_outputs(out) == before
