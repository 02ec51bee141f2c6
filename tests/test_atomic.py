"""ultratron.atomic: a file (or directory) written through it is the old one or the new one, never
half of one, and nothing is left beside it."""

import json

import numpy as np
import pytest

from ultratron.atomic import atomic_open, atomic_path, is_temp, temp_path, write_bytes, write_json, write_text


def test_a_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    write_text(path, "new\n")
    assert path.read_text() == "new\n"
    write_bytes(path, b"\x00\x01", durable=True)
    assert path.read_bytes() == b"\x00\x01"
    write_json(path, {"b": 1, "a": [2]}, indent=1, sort_keys=True)
    assert json.loads(path.read_text()) == {"a": [2], "b": 1} and path.read_text().endswith("}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("whole\n")
    with pytest.raises(RuntimeError), atomic_open(path) as fh:
        fh.write("half of a ")
        assert temp_path(path).exists() and path.read_text() == "whole\n"  # written under the temporary name
        raise RuntimeError("the writer died")
    assert path.read_text() == "whole\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    with pytest.raises(TypeError):  # a value json cannot write: nothing is published
        write_json(path, {"x": object()})
    assert path.read_text() == "whole\n" and len(list(tmp_path.iterdir())) == 1


def test_nothing_is_visible_under_the_real_name_until_the_block_ends(tmp_path):
    path = tmp_path / "cache.json"
    with atomic_open(path) as fh:
        fh.write("{}")
        fh.flush()
        assert not path.exists() and temp_path(path).parent == tmp_path
    assert path.read_text() == "{}"


def test_a_library_writer_gets_a_name_with_its_extension(tmp_path):
    path = tmp_path / "shard_00000.idx.npy"
    with atomic_path(path, keep_suffix=True) as tmp:
        assert tmp.name.endswith(".npy")
        np.save(tmp, np.arange(5))  # np.save appends .npy to any other name
    assert np.load(path).tolist() == [0, 1, 2, 3, 4]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_directory_is_published_whole_or_removed(tmp_path):
    out = tmp_path / "export"
    out.mkdir()  # an empty directory may be there already
    with atomic_path(out, durable=True) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    assert (out / "config.json").read_text() == "{}"
    failed = tmp_path / "failed"
    with pytest.raises(OSError), atomic_path(failed) as tmp:
        tmp.mkdir()
        (tmp / "part").write_text("x")
        raise OSError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_temporaries_are_recognised_and_real_files_are_not(tmp_path):
    assert is_temp(temp_path(tmp_path / "part-00004.jsonl").name)
    assert is_temp(temp_path(tmp_path / "x.idx.npy", keep_suffix=True).name)
    assert is_temp("latest.tmp") and is_temp("meta.json.tmp")  # written by earlier versions
    for name in ("part-00004.jsonl", "step-0000004", "latest", "tmp.json", "x.tmpl"):
        assert not is_temp(name), name
