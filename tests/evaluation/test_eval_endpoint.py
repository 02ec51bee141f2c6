"""`ultratron eval --endpoint` against our own server agrees with `--checkpoint`."""

import http.server
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

from conftest import run_cli
from ultratron.evaluation.backends import LocalBackend
from ultratron.evaluation.builtin import resolve_tasks
from ultratron.serving.server import chat_prompt


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


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Forwards to the real server, but answers the first `failures` completion requests with 503."""

    upstream = ""
    failures = 0
    seen: list[int] = []

    def _forward(self, body: bytes | None) -> None:
        if self.path.startswith("/v1/completions") and type(self).failures > 0:
            type(self).failures -= 1
            type(self).seen.append(503)  # what completion requests got, in order
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "overloaded, try again"}}')
            return
        request = urllib.request.Request(self.upstream + self.path, data=body, method=self.command,
                                         headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
        try:
            response = urllib.request.urlopen(request, timeout=60)
        except urllib.error.HTTPError as err:  # the server's own 4xx answers pass through as they are
            response = err
        with response:
            payload = response.read()
            if self.path.startswith("/v1/completions"):
                type(self).seen.append(response.status)
            self.send_response(response.status)
            self.send_header("Content-Type", response.headers.get("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._forward(None)

    def do_POST(self):  # noqa: N802
        self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def log_message(self, *args):
        pass


def test_endpoint_retries_a_failing_server_and_says_so_when_it_gives_up(served, tmp_path, monkeypatch):
    url, key = served
    monkeypatch.setenv("ULTRATRON_TEST_KEY", key)
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    _Flaky.upstream, flaky = url, f"http://127.0.0.1:{proxy.server_address[1]}/v1"
    args = ["eval", "--endpoint", flaky, "--model", "ultratron", "--api-key-env", "ULTRATRON_TEST_KEY",
            "--tasks", "builtin_next_line", "--max-examples", "5"]
    try:
        _Flaky.failures, _Flaky.seen = 2, []
        retried = run_cli(*args, "--max-retries", "3", "--json", str(tmp_path / "retried.json"))
        assert retried.returncode == 0, retried.stderr
        assert _Flaky.seen[:2] == [503, 503] and 200 in _Flaky.seen[2:]  # two refusals, then through
        direct = run_cli(*args[:2], url + "/v1", *args[3:], "--json", str(tmp_path / "direct.json"))
        assert direct.returncode == 0, direct.stderr
        results = [json.loads((tmp_path / f"{n}.json").read_text())["tasks"] for n in ("retried", "direct")]
        assert results[0]["builtin_next_line"]["acc"] == results[1]["builtin_next_line"]["acc"]
        _Flaky.failures = 10**6
        gave_up = run_cli(*args, "--max-retries", "1")
        assert gave_up.returncode == 2 and "Traceback" not in gave_up.stderr
        assert gave_up.stderr.strip().startswith(f"error: endpoint {flaky}: InternalServerError")
        assert gave_up.stderr.strip().endswith("(after up to 1 retries)")
    finally:
        proxy.shutdown()


def test_generation_through_completions_and_chat_equals_the_checkpoint(served, trained_checkpoint, tmp_path,
                                                                      monkeypatch):
    """The generation task (greedy, exact match): through /v1/completions the outputs and score equal a
    local evaluation of the checkpoint; through /v1/chat/completions they equal the checkpoint's greedy
    continuation of the same prompt in the server's chat template (a chat API always templates)."""
    url, key = served
    monkeypatch.setenv("ULTRATRON_TEST_KEY", key)
    common = ["--tasks", "builtin_arithmetic", "--max-examples", "12", "--details"]
    local = run_cli("eval", "--checkpoint", str(trained_checkpoint), *common, "--json", str(tmp_path / "local.json"),
                    "--threads", "1")
    assert local.returncode == 0, local.stderr
    got = {}
    for api in ("completions", "chat"):
        out = tmp_path / f"{api}.json"
        done = run_cli("eval", "--endpoint", url + "/v1", "--model", "ultratron", "--api-key-env", "ULTRATRON_TEST_KEY",
                       "--generation-api", api, *common, "--json", str(out))
        assert done.returncode == 0, done.stderr
        got[api] = json.loads(out.read_text())["tasks"]["builtin_arithmetic"]
    expected = json.loads((tmp_path / "local.json").read_text())["tasks"]["builtin_arithmetic"]
    assert len(expected["outputs"]) == 12 and any(o.strip() for o in expected["outputs"])  # it generated text
    assert got["completions"]["outputs"] == expected["outputs"]
    assert got["completions"]["exact_match"] == expected["exact_match"]
    examples = resolve_tasks("builtin_arithmetic")[0].examples[:12]
    templated = LocalBackend.from_checkpoint(trained_checkpoint).generate(
        [(chat_prompt([{"role": "user", "content": ex.prompt}]), ex.stop, ex.max_tokens) for ex in examples])
    assert got["chat"]["outputs"] == templated


def test_the_endpoint_client_runs_without_torch_or_the_training_config(served, monkeypatch):
    """`eval --endpoint` computes nothing itself: its process imports neither torch nor the training
    config (model presets, layout rules; ~45 ms of a start of ~0.2 s), and exits 0 through the
    command's own entry (`ultratron.cli.entry`, which freezes what is left before the exit)."""
    url, key = served
    monkeypatch.setenv("ULTRATRON_TEST_KEY", key)
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print(sorted(m for m in ('torch', 'ultratron.config.training') "
              "if m in sys.modules)))\n"
              "sys.argv[1:] = ['eval', '--endpoint', %r, '--model', 'ultratron', '--api-key-env', "
              "'ULTRATRON_TEST_KEY', '--tasks', 'builtin_next_line', '--max-examples', '2', '--quiet']\n"
              "from ultratron.cli import entry\n"
              "entry()\n") % (url + "/v1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
