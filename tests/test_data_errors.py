"""Bad data gives one clear error line, never a traceback."""

from conftest import TINY, run_cli


def run_train(data_path, tmp_path, *extra):
    return run_cli("train", *TINY, "--data.path", str(data_path), "--run.dir", str(tmp_path / "run"),
                   "--training.steps", "1", *extra)


def single_error(result) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_missing_path(tmp_path):
    line = single_error(run_train(tmp_path / "nowhere", tmp_path))
    assert "does not exist" in line and "nowhere" in line


def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("   \n")
    line = single_error(run_train(tmp_path / "empty", tmp_path))
    assert "no training documents found" in line


def test_non_utf8_file(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "good.txt").write_text("hello world\n" * 100)
    (tmp_path / "corpus" / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    line = single_error(run_train(tmp_path / "corpus", tmp_path))
    assert "latin1.txt" in line and "not valid UTF-8 at byte 3" in line


def test_malformed_jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"text": broken\n')
    line = single_error(run_train(path, tmp_path))
    assert "docs.jsonl:2: not valid JSON" in line


def test_corpus_too_small_for_one_step(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("just a few words\n")
    line = single_error(run_train(tmp_path / "corpus", tmp_path, "--data.held_out_fraction", "0"))
    assert "fewer than one step needs" in line
