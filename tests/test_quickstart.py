"""The quickstart's whole road, shortened: corpus → tokenizer → shards → train → validate → sample → PNG."""

from conftest import TINY, run_cli


def test_quickstart_runs_the_whole_road_and_starts_over_when_rerun(tmp_path):
    run = tmp_path / "qs"
    args = ["quickstart", "--run-dir", str(run), *TINY, "--data.max_bytes", "400000", "--data.held_out_fraction", "0.3",
            "--training.steps", "6",
            "--eval.interval", "3", "--checkpoint.interval", "3", "--training.sample_tokens", "10"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "quickstart finished" in out and "validation loss:" in out
    assert first.stderr.count("sample:\ndef") == 1
    sample_line = first.stderr.split("sample:\n")[1].splitlines()[0]
    assert sample_line not in out  # the sample is shown once, not repeated in the summary
    for name in ("config.toml", "metrics.jsonl", "report.png", "data/tokenizer.json", "data/train/meta.json",
                 "checkpoints/step-0000006/complete"):
        assert (run / name).exists(), name
    second = run_cli(*args)
    assert second.returncode == 0, second.stderr
    assert "starting over" in second.stdout and "reusing tokenizer and shards" in second.stderr
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 6
