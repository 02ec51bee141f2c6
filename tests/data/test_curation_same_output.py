"""The pipeline's output is a function of its input and config alone: the same bytes in every
stage for 1, 2 or 3 workers, and after a SIGKILL at any moment followed by a rerun.

The corpus plants work for every stage across parts (parts of 8 documents): exact copies,
near copies, a boilerplate span shared by documents in different parts, and documents the
filters drop. Each kill comes from a driver script this file writes next to the output: it
wraps one function of the pipeline so that, at the chosen moment, the whole process group
(the driver and every worker) gets SIGKILL, then calls `ultratron.cli.main`.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ultratron.curation.config import from_dict
from ultratron.curation.report import format_table
from ultratron.curation.runner import run_pipeline

VOCAB_SEED = 7
STOP = "the of and to a in that is was with for it as on be at by have".split()
BOILERPLATE = ("This article is distributed under the terms of the community licence, version four; you may share "
               "and adapt it for any purpose, provided that you give appropriate credit and indicate changes.")


def _prose(rng: random.Random, vocab: list[str], lines: int) -> list[str]:
    """Lines of one or two sentences of stop words and invented words: they pass every filter group."""
    out = []
    for _ in range(lines):
        sentences = []
        for _ in range(rng.randint(1, 2)):
            words = [rng.choice(STOP) if rng.random() < 0.4 else rng.choice(vocab) for _ in range(rng.randint(8, 16))]
            sentences.append(" ".join(words).capitalize() + ".")
        out.append(" ".join(sentences))
    return out


def make_corpus(path: Path) -> dict[str, set[str]]:
    """A JSONL corpus (85 documents) with planted duplicates; returns the planted ids by kind."""
    rng = random.Random(VOCAB_SEED)
    vocab = ["".join(rng.choice("abcdefghiklmnoprstuvwy") for _ in range(rng.randint(3, 9))) for _ in range(3000)]
    docs = [{"id": f"u{k:02d}", "text": "\n".join(_prose(rng, vocab, rng.randint(10, 16)))} for k in range(74)]
    planted: dict[str, set[str]] = {"exact": set(), "near": set(), "near_survivors": set(), "boilerplate": set()}
    inserts = []
    for k, source in enumerate((3, 10, 21)):  # exact copies, several parts later
        inserts.append((source + 20 + 9 * k, {"id": f"exact{k}", "text": docs[source]["text"]}))
        planted["exact"].add(f"exact{k}")
    for k, source in enumerate((1, 12, 30, 44, 58, 60)):  # near copies: 2 % of the words replaced
        words = docs[source]["text"].split(" ")
        for i in rng.sample(range(len(words)), len(words) // 50):
            words[i] = rng.choice(vocab)
        inserts.append((source + 8 + 5 * k, {"id": f"near{k}", "text": " ".join(words)}))
        planted["near"].add(f"near{k}")
        planted["near_survivors"].add(docs[source]["id"])
    for k in range(5):  # one boilerplate paragraph in documents of five different parts
        doc = docs[2 + 15 * k]
        doc["text"] += "\n\n" + BOILERPLATE
        planted["boilerplate"].add(doc["id"])
    # documents the filters drop: too few words (Gopher quality), placeholder text (C4)
    inserts.append((35, {"id": "short0", "text": _prose(rng, vocab, 1)[0]}))
    inserts.append((65, {"id": "lorem0", "text": "\n".join(_prose(rng, vocab, 8) + ["Lorem ipsum dolor sit amet."])}))
    planted["filtered"] = {"short0", "lorem0"}
    for at, doc in sorted(inserts, key=lambda item: item[0], reverse=True):
        docs.insert(at, doc)
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return planted


def config(src: Path, out: Path, workers: int) -> dict:
    return {"pipeline": {"input": str(src), "output": str(out), "workers": workers, "docs_per_part": 8,
                         "progress": False},
            "tokenize": {"vocab_size": 320, "train_bytes": 60_000},
            "shard": {"held_out_fraction": 0.2, "tokens_per_shard": 4000}}


def write_toml(cfg: dict, path: Path) -> Path:
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# Bookkeeping that may differ between equal runs: timings, process ids, the run's own paths
# and worker count. Everything else is compared byte for byte.
VOLATILE = {"seconds", "pid", "wall_seconds", "part_seconds", "workers", "train_cpu_seconds"}


def _scrub(obj, out: str):
    if isinstance(obj, dict):
        return {k: _scrub(v, out) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_scrub(v, out) for v in obj]
    return obj.replace(out, "OUT") if isinstance(obj, str) else obj


def is_temp(path: Path) -> bool:
    return ".tmp" in path.name


def snapshot(out: Path) -> dict[str, bytes]:
    """Every finished file under `out` (temporary files left by a kill excluded): bytes, with the
    bookkeeping JSON (stats, _DONE, config, report) scrubbed of VOLATILE fields."""
    files = {}
    for path in sorted(out.rglob("*")):
        if not path.is_file() or is_temp(path):
            continue
        rel = str(path.relative_to(out))
        data = path.read_bytes()
        if path.suffix == ".json" and (path.parent.name == "_stats" or path.name in
                                       ("_DONE.json", "config.json", "report.json")):
            data = json.dumps(_scrub(json.loads(data), str(out)), sort_keys=True).encode()
        files[rel] = data
    return files


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The corpus, its planted ids and an uninterrupted one-worker run's snapshot."""
    root = tmp_path_factory.mktemp("same-output")
    planted = make_corpus(root / "corpus.jsonl")
    run_pipeline(from_dict(config(root / "corpus.jsonl", root / "ref", 1)), log=lambda _: None)
    return root, planted, snapshot(root / "ref")


def _decisions(snap: dict[str, bytes], stage_dir: str) -> list[dict]:
    return [json.loads(line) for rel, data in sorted(snap.items())
            if rel.startswith(f"{stage_dir}/_decisions/") for line in data.decode().splitlines()]


def test_every_planted_duplicate_goes_and_nothing_else(reference):
    """What the worker and kill comparisons compare is not vacuous: each dedup stage removes
    exactly what was planted for it, across parts."""
    _, planted, snap = reference
    removed = {stage: {d["id"] for d in _decisions(snap, stage) if d["decision"] == "removed"}
               for stage in ("02-exact-dedup", "03-near-dedup", "05-filter")}
    assert removed["02-exact-dedup"] == planted["exact"]
    assert removed["03-near-dedup"] == planted["near"]
    near = [d for d in _decisions(snap, "03-near-dedup") if d["decision"] == "removed"]
    assert {d["cluster"] for d in near} == planted["near_survivors"]  # the earlier document survives
    assert removed["05-filter"] == planted["filtered"]
    modified = {d["id"] for d in _decisions(snap, "04-substring-dedup") if d["decision"] == "modified"}
    assert modified == planted["boilerplate"]
    final = "".join(data.decode() for rel, data in snap.items() if rel.startswith("07-shard/part-"))
    assert BOILERPLATE[20:80] not in final
    part_of = {json.loads(line)["id"]: rel for rel, data in snap.items() if rel.startswith("00-read/part-")
               for line in data.decode().splitlines()}
    assert len(set(part_of.values())) == 11  # 85 documents, 8 a part
    # every duplicate is in another part than its survivor; the boilerplate is in five parts
    dups = [d for stage in ("02-exact-dedup", "03-near-dedup") for d in _decisions(snap, stage) if d["cluster"]
            and d["decision"] == "removed"]
    assert len(dups) == 9 and all(part_of[d["id"]] != part_of[d["cluster"]] for d in dups)
    assert len({part_of[i] for i in planted["boilerplate"]}) == 5
    assert len([rel for rel in snap if rel.startswith("07-shard/train/shard_") and rel.endswith(".bin")]) >= 3


@pytest.mark.parametrize("workers", [2, 3])
def test_output_of_every_stage_is_the_same_for_any_worker_count(reference, workers):
    root, _, ref = reference
    out = root / f"workers{workers}"
    run_pipeline(from_dict(config(root / "corpus.jsonl", out, workers)), log=lambda _: None)
    got = snapshot(out)
    assert sorted(got) == sorted(ref)
    assert [rel for rel in ref if got[rel] != ref[rel]] == []



def test_report_table_lists_tied_reasons_the_same_whether_a_stage_ran_or_was_resumed():
    """A resumed run reads finished stages' summaries back from _DONE.json, whose keys are
    sorted; a fresh run's are in the order first met. report.md must not tell them apart."""
    fresh = {"stage": "filter", "docs_in": 9, "docs_out": 7, "bytes_in": 0, "bytes_out": 0, "tokens_out": 0,
             "removed": {"gopher_quality:min_words": 1, "c4:lorem_ipsum": 1}, "modified": {}}
    resumed = json.loads(json.dumps(fresh, sort_keys=True))
    assert list(resumed["removed"]) != list(fresh["removed"])
    assert format_table([resumed]) == format_table([fresh])
    assert "| c4:lorem_ipsum 1, gopher_quality:min_words 1 |" in format_table([fresh])


# ---- SIGKILL at any moment, then a rerun ---------------------------------------------------------

# `python kill_driver.py MOMENT ultratron-args...`: wraps the function where MOMENT happens so
# that the process group (the driver and its workers, as when a machine dies) gets SIGKILL
# there; "worker-alone" kills only the worker process, as the kernel's OOM killer would.
KILL_DRIVER = '''
import os
import signal
import sys

from ultratron.cli import main
from ultratron.curation import frame
from ultratron.curation.stages import exact_dedup, near_dedup
from ultratron.data import shards, tokenizer

moment = sys.argv[1]


def die(alone=False):
    os.kill(os.getpid(), signal.SIGKILL) if alone else os.killpg(os.getpgid(0), signal.SIGKILL)


def in_part(stage_dir, part, after, alone=False):
    """Die after `after` documents of one part are written: the part is half on disk."""
    kept, count = frame.PartWriter.kept, 0

    def wrapper(self, *args, **kwargs):
        nonlocal count
        kept(self, *args, **kwargs)
        if self.out_dir.name == stage_dir and self.name == part:
            count += 1
            if count == after:
                die(alone)
    frame.PartWriter.kept = wrapper


def after_call(module, name, when=lambda *args: True):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if when(*args):
            die()
        return result
    setattr(module, name, wrapper)


def before_call(module, name):
    def wrapper(*args, **kwargs):
        die()
    setattr(module, name, wrapper)


def training_killed_after(n_texts):
    train = tokenizer.train_tokenizer

    def texts_then_die(texts, *args, **kwargs):
        def stream():
            for i, text in enumerate(texts):
                if i == n_texts:
                    die()
                yield text
        return train(stream(), *args, **kwargs)
    tokenizer.train_tokenizer = texts_then_die


def nth_flush(n):
    flush, count = shards.ShardWriter._flush, 0

    def wrapper(self):
        nonlocal count
        flush(self)
        count += 1
        if count == n:
            die()
    shards.ShardWriter._flush = wrapper


if moment == "read-mid-part":
    in_part("00-read", "part-00004", 7)
elif moment == "normalize-mid-part":
    in_part("01-normalize", "part-00007", 7)
elif moment == "exact-index":
    after_call(exact_dedup, "write_json", lambda path, obj: path.name == "part-00005.json")
elif moment == "near-signatures":  # the ids are written, the signature matrix is not
    after_call(near_dedup, "write_json", lambda path, obj: path.name == "part-00006.ids.json")
elif moment == "near-clustering":
    before_call(near_dedup, "band_keys")
elif moment == "suffix-array":  # the suffix array is built, its LCP array is not
    import pydivsufsort
    before_call(pydivsufsort, "kasai")
elif moment == "tokenizer-training":
    training_killed_after(30)
elif moment == "tokenizer-saved":
    after_call(tokenizer.Tokenizer, "save")
elif moment == "tokenize-mid-part":
    in_part("06-tokenize", "part-00003", 3)
elif moment == "shard-files":  # two token shards written, the shard set's meta.json not yet
    nth_flush(2)
elif moment == "worker-alone":
    in_part("05-filter", "part-00002", 7, alone=True)
else:
    raise SystemExit(f"unknown moment {moment}")
sys.exit(main(sys.argv[2:]))
'''


def _exists(*patterns):
    return lambda out: all(any(out.glob(p)) for p in patterns)


def _absent(*patterns):
    return lambda out: not any(any(out.glob(p)) for p in patterns)


def _half_written(pattern):
    return lambda out: any(p.stat().st_size > 0 for p in out.glob(pattern))


# moment → what the output directory must show right after the kill (proof it came when meant)
EVIDENCE = {
    "read-mid-part": [_half_written("00-read/part-00004.jsonl.tmp*"), _absent("00-read/part-00004.jsonl")],
    "normalize-mid-part": [_half_written("01-normalize/part-00007.jsonl.tmp*")],
    "exact-index": [_exists("02-exact-dedup/_index/part-00005.json"), _absent("02-exact-dedup/part-*.jsonl")],
    "near-signatures": [_exists("03-near-dedup/_index/part-00006.ids.json"),
                        _absent("03-near-dedup/_index/part-00006.npy")],
    "near-clustering": [_exists("03-near-dedup/_index/part-00010.npy"), _absent("03-near-dedup/part-*.jsonl")],
    "suffix-array": [_exists("03-near-dedup/_DONE.json"), _absent("04-substring-dedup/part-*.jsonl")],
    "tokenizer-training": [_exists("05-filter/_DONE.json"), _absent("06-tokenize/tokenizer.json")],
    "tokenizer-saved": [_exists("06-tokenize/tokenizer.json"), _absent("06-tokenize/part-*.jsonl")],
    "tokenize-mid-part": [_half_written("06-tokenize/part-00003.jsonl.tmp*")],
    "shard-files": [_exists("07-shard/train/shard_00001.bin"), _absent("07-shard/train/meta.json")],
    "worker-alone": [_half_written("05-filter/part-00002.jsonl.tmp*"), _absent("05-filter/_DONE.json")],
}


@pytest.mark.parametrize("workers,moments", [
    (1, ["read-mid-part", "near-clustering", "suffix-array", "tokenizer-saved", "shard-files"]),
    (2, ["exact-index", "near-signatures", "tokenizer-training", "tokenize-mid-part"]),
    (3, ["normalize-mid-part", "worker-alone"]),
], ids=["1-worker", "2-workers", "3-workers"])
def test_rerun_after_sigkill_gives_the_uninterrupted_output(reference, tmp_path, workers, moments):
    """Kill, rerun (killed again at the next moment), …, rerun to the end: the same bytes as a
    run never killed. After each kill, every file under its final name is whole (equal to the
    uninterrupted run's) and a rerun redoes no part that was finished."""
    root, _, ref = reference
    out = tmp_path / "out"
    args = ["data", "run", "--config", str(write_toml(config(root / "corpus.jsonl", out, workers),
                                                     tmp_path / "data.toml"))]
    driver = tmp_path / "kill_driver.py"
    driver.write_text(KILL_DRIVER)
    finished: dict[Path, int] = {}
    for moment in moments:
        killed = subprocess.run([sys.executable, str(driver), moment, *args], capture_output=True, text=True,
                                start_new_session=True, timeout=300)  # its own process group, so killpg spares pytest
        if moment == "worker-alone":  # the driver lives on and says what happened, in one line
            assert killed.returncode == 2, (moment, killed.returncode, killed.stderr[-2000:])
            assert killed.stderr.splitlines()[-1].startswith("error: filter: a worker process died"), killed.stderr
            assert "rerun the same command to resume" in killed.stderr
        else:
            assert killed.returncode == -signal.SIGKILL, (moment, killed.returncode, killed.stderr[-2000:])
        got = snapshot(out)
        assert [rel for rel in got if got[rel] != ref.get(rel)] == [], f"not whole after the kill at {moment}"
        assert all(check(out) for check in EVIDENCE[moment]), f"the kill did not come at {moment}"
        assert {p: p.stat().st_mtime_ns for p in finished} == finished, f"finished parts redone before {moment}"
        finished = {p: p.stat().st_mtime_ns for p in out.glob("*/_stats/*.json")}
    resumed = subprocess.run([sys.executable, "-m", "ultratron", *args], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in finished} == finished, "finished parts redone by the last rerun"
    got = snapshot(out)
    assert sorted(got) == sorted(ref)
    assert [rel for rel in ref if got[rel] != ref[rel]] == []
