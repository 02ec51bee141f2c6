"""Curation from and to an object store (the loopback S3 server of tests/conftest.py): every input
format read from s3:// gives the same documents as the same files on disk, the output is published
with each shard set's meta.json last, and a kill -9 in the middle of publishing leaves nothing half
visible; the rerun finishes it."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from conftest import S3_BUCKET
from ultratron.curation.config import from_dict
from ultratron.curation.publish import publish_order
from ultratron.curation.runner import run_pipeline
from ultratron.data.shards import sha256_file

WORDS = ("the and of to with that river mountain garden window letter morning evening village teacher student "
         "market harbor winter summer bridge castle forest meadow captain doctor farmer painter singer").split()


def _prose(rng: random.Random) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + "." for _ in range(12))


def _warc(texts: list[str]) -> bytes:
    from warcio.warcwriter import WARCWriter

    out = io.BytesIO()
    writer = WARCWriter(out, gzip=False)
    for i, text in enumerate(texts):
        writer.write_record(writer.create_warc_record(f"http://example.com/{i}", "conversion",
                                                      payload=io.BytesIO(text.encode()),
                                                      warc_content_type="text/plain"))
    return out.getvalue()


def make_inputs(root: Path) -> int:
    """One file of every format, 8 documents each; returns the number of documents."""
    rng = random.Random(1)
    root.mkdir(parents=True)
    docs = lambda prefix: [{"id": f"{prefix}{i}", "text": _prose(rng)} for i in range(8)]
    jsonl = lambda rows: "".join(json.dumps(r) + "\n" for r in rows).encode()
    (root / "a.jsonl").write_bytes(jsonl(docs("a")))
    (root / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(docs("b"))))
    import zstandard

    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(docs("c"))))
    d = docs("d")
    pq.write_table(pa.table({"id": [r["id"] for r in d], "text": [r["text"] for r in d]}), root / "d.parquet")
    e = docs("e")
    with ipc.new_file(str(root / "e.arrow"), pa.schema([("id", pa.string()), ("text", pa.string())])) as writer:
        writer.write_table(pa.table({"id": [r["id"] for r in e], "text": [r["text"] for r in e]}))
    (root / "f.warc").write_bytes(_warc([r["text"] for r in docs("f")]))
    return 48


def config(src: str, out: str, endpoint: str, staging: Path) -> dict:
    return {"pipeline": {"input": src, "output": out, "docs_per_part": 20, "progress": False,
                         "endpoint": endpoint, "staging": str(staging)},
            "read": {"extensions": ".jsonl,.parquet,.arrow,.warc"},
            "filter": {"enabled": ["gopher_repetition"]},
            "tokenize": {"vocab_size": 300, "train_bytes": 200_000},
            "shard": {"held_out_fraction": 0.2, "tokens_per_shard": 2000}}


def test_curate_from_s3_to_s3_reads_every_format_like_local_disk(s3, tmp_path):
    server, fs = s3
    n_docs = make_inputs(tmp_path / "raw")
    fs.put(str(tmp_path / "raw") + "/", f"{S3_BUCKET}/raw/", recursive=True)
    url = f"s3://{S3_BUCKET}/curated"
    run_pipeline(from_dict(config(f"s3://{S3_BUCKET}/raw", url, server.endpoint, tmp_path / "stage")),
                 log=lambda m: None)
    run_pipeline(from_dict(config(str(tmp_path / "raw"), str(tmp_path / "local"), "", tmp_path / "unused")),
                 log=lambda m: None)
    report = json.loads(fs.cat_file(f"{S3_BUCKET}/curated/report.json"))
    assert report["stages"][0]["docs_in"] == n_docs and report["stages"][0]["docs_out"] == n_docs
    fs.invalidate_cache()
    meta = json.loads(fs.cat_file(f"{S3_BUCKET}/curated/07-shard/train/meta.json"))
    assert len(meta["shards"]) > 1
    for shard in meta["shards"]:  # every shard listed is there, whole, and equal to the one curated on disk
        local = tmp_path / "local" / "07-shard" / "train" / f"{shard['name']}.bin"
        remote = fs.cat_file(f"{S3_BUCKET}/curated/07-shard/train/{shard['name']}.bin")
        assert len(remote) == shard["bytes"] and sha256_file(local) == shard["sha256"]
        assert remote == local.read_bytes()
    assert not [p for p in fs.find(f"{S3_BUCKET}/curated") if ".tmp" in p.rsplit("/", 1)[-1]]


def test_reading_warc_without_warcio_names_the_package(tmp_path, monkeypatch):
    from ultratron.curation.stages import read
    from ultratron.errors import DataError

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "x.warc").write_bytes(b"WARC/1.0\r\n")
    monkeypatch.setitem(sys.modules, "warcio.archiveiterator", None)  # as if not installed
    cfg = from_dict(config(str(tmp_path / "raw"), str(tmp_path / "out"), "", tmp_path / "s"))
    with pytest.raises(DataError, match="needs the warcio package"):
        list(read.iter_source(str(tmp_path / "raw"), cfg))


def test_publish_order_puts_meta_and_done_and_report_last():
    names = ["report.md", "07-shard/_DONE.json", "07-shard/train/meta.json", "07-shard/train/shard_00000.bin",
             "report.json", "07-shard/val/shard_00000.bin", "00-read/part-00000.jsonl"]
    order = publish_order(names)
    assert order.index("07-shard/train/meta.json") > order.index("07-shard/val/shard_00000.bin")
    assert order.index("07-shard/_DONE.json") > order.index("07-shard/train/meta.json")
    assert order[-2:] == ["report.json", "report.md"]


KILLER = textwrap.dedent("""
    import os, signal, sys
    from ultratron.curation.config import from_dict
    from ultratron.curation.runner import run_pipeline
    from ultratron.data import objstore
    real, count = objstore.Remote.publish_file, [0]
    def publish_file(self, local, url):
        count[0] += 1
        if count[0] == int(sys.argv[2]):  # killed between writing the temporary object and copying it
            self.fs.put_file(str(local), objstore.key(self.fs, url + ".tmp999"))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, local, url)
    objstore.Remote.publish_file = publish_file
    import json
    run_pipeline(from_dict(json.loads(sys.argv[1])), log=lambda m: None)
""")


def test_a_kill_during_publishing_leaves_nothing_half_visible(s3, tmp_path):
    server, fs = s3
    make_inputs(tmp_path / "raw")
    url = f"s3://{S3_BUCKET}/killed"
    cfg = config(str(tmp_path / "raw"), url, server.endpoint, tmp_path / "stage")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "PATH": "/usr/bin:/bin"}
    staged = None
    for kill_at in (40, 3):  # the second run (resuming) is killed again early; the third finishes
        done = subprocess.run([sys.executable, "-c", KILLER, json.dumps(cfg), str(kill_at)], env=env, timeout=300)
        assert done.returncode == -9
        fs.invalidate_cache()
        visible = {p.split("/killed/", 1)[1]: p for p in fs.find(f"{S3_BUCKET}/killed")}
        staged = {p.relative_to(tmp_path / "stage").as_posix(): p for p in (tmp_path / "stage").rglob("*")
                  if p.is_file()}
        for name, path in visible.items():  # every object under its real name is whole
            if ".tmp" not in name:
                assert fs.cat_file(path) == staged[name].read_bytes(), name
        for split in ("train", "val"):  # a shard set's meta.json only once all its shards are there
            meta_name = f"07-shard/{split}/meta.json"
            if meta_name in visible:
                meta = json.loads(fs.cat_file(visible[meta_name]))
                assert all(f"07-shard/{split}/{s['name']}.bin" in visible for s in meta["shards"])
        assert "report.json" not in visible
    run_pipeline(from_dict(cfg), log=lambda m: None)
    fs.invalidate_cache()
    visible = {p.split("/killed/", 1)[1] for p in fs.find(f"{S3_BUCKET}/killed")}
    assert not [n for n in visible if ".tmp" in n]
    assert {n for n in staged if not n.endswith(".published.json")} <= visible
    assert "report.json" in visible and "07-shard/train/meta.json" in visible


@pytest.mark.slow
def test_ray_without_a_shared_file_system_matches_the_local_run(tmp_path):
    """Parts travel to and from the Ray workers (pipeline.shared_fs = false, as an object-store output
    sets it): each task runs on a private copy of the files it names; the output is the local run's."""
    pytest.importorskip("ray")
    from test_curation_pipeline import config as local_config
    from test_curation_pipeline import final_outputs, make_corpus

    make_corpus(tmp_path / "src")
    run_pipeline(from_dict(local_config(tmp_path / "src", tmp_path / "local")), log=lambda m: None)
    cfg = local_config(tmp_path / "src", tmp_path / "ray")
    cfg["pipeline"] |= {"executor": "ray", "shared_fs": False}
    run_pipeline(from_dict(cfg), log=lambda m: None)
    assert final_outputs(tmp_path / "ray") == final_outputs(tmp_path / "local")


def test_a_shipped_task_names_only_its_private_copy(tmp_path):
    from ultratron.curation.executors import _inputs, _rewrite
    from ultratron.curation.frame import PartTask

    root = str(tmp_path / "out")
    (tmp_path / "out" / "01-normalize").mkdir(parents=True)
    (tmp_path / "out" / "01-normalize" / "part-00000.jsonl").write_text("{}\n")
    cfg = from_dict(config("s3://b/raw", "s3://b/out", "", tmp_path / "s"))
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, output=root))
    task = PartTask(None, False, cfg, f"{root}/01-normalize/part-00000.jsonl", f"{root}/02-exact-dedup", "part-00000")
    # the part's bytes; the directories it reads from and writes into (02-exact-dedup is made in the root)
    assert _inputs(task, root) == {"01-normalize/part-00000.jsonl": b"{}\n", "01-normalize": None, ".": None}
    moved = _rewrite(task, root, "/w")
    assert (moved.in_path, moved.out_dir, moved.cfg.pipeline.output) == (
        "/w/01-normalize/part-00000.jsonl", "/w/02-exact-dedup", "/w")
    assert moved.cfg.pipeline.input == "s3://b/raw"


def test_a_single_stage_to_an_object_store_is_refused(tmp_path):
    from ultratron.curation.runner import run_stage
    from ultratron.errors import DataError

    with pytest.raises(DataError, match="a single stage writes to a local directory"):
        run_stage("normalize", from_dict({}), str(tmp_path), f"s3://{S3_BUCKET}/one-stage")
