"""`ultratron eval --endpoint` against our own server agrees with `--checkpoint`."""

import json

from conftest import run_cli


def test_endpoint_and_checkpoint_agree(served, trained_checkpoint, tmp_path, monkeypatch):
    url, key = served
    local, remote = tmp_path / "local.json", tmp_path / "remote.json"
    tasks = "builtin_next_line,builtin_identifier_cloze,builtin_bpb"
    a = run_cli("eval", "--checkpoint", str(trained_checkpoint), "--tasks", tasks, "--max-examples", "25",
                "--json", str(local), "--details", "--threads", "1")
    assert a.returncode == 0, a.stderr
    monkeypatch.setenv("ULTRATRON_TEST_KEY", key)
    b = run_cli("eval", "--endpoint", url + "/v1", "--model", "ultratron", "--api-key-env", "ULTRATRON_TEST_KEY",
                "--tasks", tasks, "--max-examples", "25", "--json", str(remote), "--details",
                "--price-per-request", "0.01", "--price-per-1k-prompt-tokens", "0.5")
    assert b.returncode == 0, b.stderr
    ours, theirs = json.loads(local.read_text())["tasks"], json.loads(remote.read_text())
    worst = 0.0
    for name in ("builtin_next_line", "builtin_identifier_cloze"):
        assert ours[name]["acc"] == theirs["tasks"][name]["acc"]
        assert ours[name]["acc_norm"] == theirs["tasks"][name]["acc_norm"]
        for x, y in zip(ours[name]["loglikelihoods"], theirs["tasks"][name]["loglikelihoods"], strict=True):
            worst = max(worst, max(abs(p - q) for p, q in zip(x, y, strict=True)))
    assert abs(ours["builtin_bpb"]["bits_per_byte"] - theirs["tasks"]["builtin_bpb"]["bits_per_byte"]) < 1e-4
    print(f"endpoint vs checkpoint: max |log-likelihood difference| {worst:.2e}")
    assert worst < 1e-4
    usage = theirs["usage"]
    assert usage["requests"] >= (25 * 4 * 2) // 8 and usage["failed_requests"] == 0
    assert usage["cost"] == round(usage["requests"] * 0.01 + usage["prompt_tokens"] / 1000 * 0.5, 6)
