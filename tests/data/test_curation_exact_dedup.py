"""Exact dedup: every later copy of a text goes, across parts, whatever the documents' ids."""

from __future__ import annotations

import json

from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_stage


def test_later_copies_go_even_when_they_share_the_first_ones_id(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    # two JSONL files numbered from 0 each, as exports often are: ids repeat across them
    (src / "part-00000.jsonl").write_text("".join(json.dumps(d) + "\n" for d in [
        {"id": "0", "text": "alpha"}, {"id": "1", "text": "beta"}, {"id": "2", "text": "alpha"}]))
    (src / "part-00001.jsonl").write_text("".join(json.dumps(d) + "\n" for d in [
        {"id": "0", "text": "alpha"}, {"id": "1", "text": "gamma"}, {"id": "2", "text": "beta"}]))
    summary = run_stage("exact-dedup", from_dict({"pipeline": {"progress": False}}), src, tmp_path / "out")
    assert summary["removed"] == {"exact_duplicate": 3} and summary["distinct_documents"] == 3
    kept = {p.stem: [json.loads(line)["text"] for line in p.read_text().splitlines()]
            for p in sorted((tmp_path / "out").glob("part-*.jsonl"))}
    assert kept == {"part-00000": ["alpha", "beta"], "part-00001": ["gamma"]}
    clusters = [json.loads(line)["cluster"] for line in (tmp_path / "out" / "_decisions" / "part-00001.jsonl")
                .read_text().splitlines()]
    assert clusters == ["0", None, "1"]  # a removed copy names the survivor's id
