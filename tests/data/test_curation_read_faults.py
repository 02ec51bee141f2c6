"""`ultratron data read` on a hostile directory: dangling symlinks and symlink loops are counted
and logged, never fatal; what an interrupted run left under temporary names is removed."""

from __future__ import annotations

import json
import os

from ultratron.cli import main


def test_dangling_symlinks_and_loops_are_reported_not_fatal(tmp_path, capsys):
    src, other = tmp_path / "src", tmp_path / "other"
    src.mkdir()
    other.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (src / name).write_text(f"the document {name} with some words in it\n", encoding="utf-8")
    (other / "d.txt").write_text("a document in a linked directory\n", encoding="utf-8")
    os.symlink(src / "missing.txt", src / "gone.txt")  # dangling
    os.symlink(src, src / "back")  # a directory loop: back -> src
    os.symlink(src / "y.txt", src / "x.txt")  # two links that point at each other
    os.symlink(src / "x.txt", src / "y.txt")
    os.symlink(other, src / "linked")  # followed once
    os.symlink(src / "nowhere.bin", src / "ignored.bin")  # dangling, but not a file that would be read
    out = tmp_path / "out"
    (out / "_decisions").mkdir(parents=True)
    stale = [out / "part-00000.jsonl.tmp4242", out / "_decisions" / "part-00000.jsonl.tmp4242"]
    for path in stale:  # as a run killed in the middle of a part leaves them
        path.write_text("half a part\n")

    assert main(["data", "read", "--input", str(src), "--output", str(out), "--workers", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["docs_out"] == 4, summary  # a, b, c and linked/d
    assert summary["removed"] == {"dangling_symlink": 1, "symlink_loop": 3}, summary
    decisions = [json.loads(line) for line in (out / "_decisions" / "part-00000.jsonl").read_text().splitlines()]
    removed = {d["id"]: d["reason"] for d in decisions if d["decision"] == "removed"}
    assert removed == {"gone.txt": "dangling_symlink", "back": "symlink_loop", "x.txt": "symlink_loop",
                       "y.txt": "symlink_loop"}
    kept = sorted(json.loads(line)["id"] for line in (out / "part-00000.jsonl").read_text().splitlines())
    assert kept == ["a.txt", "b.txt", "c.txt", "linked/d.txt"]
    assert not any(p.exists() for p in stale)
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
