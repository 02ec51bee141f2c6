"""The built-in suite's slow tasks are kept on disk (`builtin._cached`): what comes back is the task
made anew, example for example; a change to what a task depends on (its documents, the module's
source) makes it anew rather than reading a stale one; a broken or unwritable cache is no error."""

from __future__ import annotations

import random

import pytest

from ultratron.evaluation import builtin


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    builtin.builtin_task.cache_clear()
    yield tmp_path / "ultratron" / "tasks"
    builtin.builtin_task.cache_clear()


@pytest.mark.parametrize("name, seed, make", [("builtin_next_line", 1, builtin.next_line_task),
                                              ("builtin_identifier_cloze", 2, builtin.identifier_cloze_task)])
def test_a_kept_task_is_the_task_made_anew(cache, name, seed, make):
    fresh = make(builtin._held_out(builtin.HELD_OUT_FRACTION), random.Random(seed))
    first = builtin.builtin_task(name)
    (kept,) = cache.glob(f"{name}-*.json")
    builtin.builtin_task.cache_clear()
    again = builtin.builtin_task(name)  # read back from the file
    assert first == again == fresh and len(again.examples) >= 100
    assert kept.stat().st_mtime_ns == next(cache.glob(f"{name}-*.json")).stat().st_mtime_ns  # read, not rewritten


def test_other_documents_or_another_source_make_the_task_anew(cache, monkeypatch):
    builtin.builtin_task("builtin_next_line")
    docs = builtin._held_out(builtin.HELD_OUT_FRACTION)
    changed = [(doc_id, text + "\nvalue = other_value + extra_value\n") for doc_id, text in docs]
    made = []
    real = builtin.next_line_task
    monkeypatch.setattr(builtin, "next_line_task", lambda d, rng: made.append(d) or real(d, rng))
    monkeypatch.setattr(builtin, "_held_out", lambda fraction: changed)
    builtin.builtin_task.cache_clear()
    builtin.builtin_task("builtin_next_line")
    assert made == [changed] and len(list(cache.glob("builtin_next_line-*.json"))) == 2
    source = builtin.Path(builtin.__file__).read_bytes() + b"\n# an edit\n"
    monkeypatch.setattr(builtin.Path, "read_bytes", lambda self: source)
    builtin.builtin_task.cache_clear()
    builtin.builtin_task("builtin_next_line")
    assert len(made) == 2 and len(list(cache.glob("builtin_next_line-*.json"))) == 3


def test_a_broken_file_is_made_anew_and_an_unwritable_cache_is_skipped(cache, monkeypatch):
    expected = builtin.builtin_task("builtin_next_line")
    (kept,) = cache.glob("builtin_next_line-*.json")
    kept.write_text('["multiple_choice", [["half')
    builtin.builtin_task.cache_clear()
    assert builtin.builtin_task("builtin_next_line") == expected
    kept.unlink()

    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(builtin, "write_text", read_only)
    builtin.builtin_task.cache_clear()
    assert builtin.builtin_task("builtin_next_line") == expected
    assert not list(cache.glob("builtin_next_line-*.json"))
