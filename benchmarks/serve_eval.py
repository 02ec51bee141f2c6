"""What the prefix cache buys `ultratron serve`: evaluation scoring, shared-prompt chat, and what it
costs a workload with nothing to share (CPU).

  python benchmarks/serve_eval.py [--checkpoint DIR] [--rounds 5] [--threads 4] [--only scoring,eval,chat,plain]
        [--kv-cache-tokens N]

Without --checkpoint it trains a small model (4 layers, dim 256, a 2048-token context) for a few
steps: the figures are timings, the weights only have to be the same on both sides. Every round
starts two fresh servers, `--prefix-cache-tokens 0` (off) and the default (on), so no round finds
what an earlier round left in the cache, and runs each workload on both, off and on alternating;
printed are the medians over rounds and their ratio.

- scoring: lm-eval-style loglikelihood requests (token-id prompts, max_tokens 1, echo, logprobs 1,
  8 prompts a request, 4 requests in flight) for a 5-shot multiple-choice task (8 questions × 4
  choices, ~800-token prompts) and builtin_next_line (16 questions, a context and 4 short choices);
- eval: the wall time of `ultratron eval --endpoint` on builtin_next_line and the 5-shot task file;
- chat: streamed chat completions that share a ~200-token system prompt, 8 in flight, 32
  tokens each: the median time to the first streamed token;
- plain: completions with nothing shared (distinct prompts), 8 in flight, 64 tokens each: tokens/s.
The server reports its prompt tokens computed ÷ admitted (/stats) for each run; it is printed too,
and the paged KV cache's use: the most positions held, the most blocks in use and the rows preempted
against the pool (`--kv-cache-tokens`, passed to both servers; default: --max-batch × context).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serve_throughput import start_server, train_checkpoint  # (this folder: a script's own)

SHOT_SOURCE = Path(__file__).resolve().parents[1] / "src" / "ultratron" / "evaluation" / "tasks.py"


def small_checkpoint(root: str) -> str:
    return train_checkpoint(root, ["--model.n_layers", "4", "--model.dim", "256", "--model.n_heads", "4",
                                   "--model.n_kv_heads", "2", "--model.ffn_dim", "768", "--model.vocab_size", "512",
                                   "--model.max_seq_len", "2048", "--training.seq_len", "128"], steps=10)


def five_shot_file(path: Path) -> Path:
    """8 questions behind the same five 6-line examples (this repository's code), 4 choices each."""
    lines = SHOT_SOURCE.read_text().splitlines()
    shots = "\n\n".join("\n".join(lines[40 + 6 * k: 46 + 6 * k]) for k in range(5)) + "\n\n"
    with open(path, "w") as f:
        for i in range(8):
            choices = [f" return x{i} + {j}" for j in range(4)]
            record = {"query": f"{shots}def question_{i}(x{i}):\n", "choices": choices, "gold": i % 4}
            f.write(json.dumps(record) + "\n")
    return path


def start(ckpt: str, cache_tokens: int | None, threads: int, kv_tokens: int | None) -> tuple[subprocess.Popen, str]:
    extra = [] if cache_tokens is None else ["--prefix-cache-tokens", str(cache_tokens)]
    extra += [] if kv_tokens is None else ["--kv-cache-tokens", str(kv_tokens)]
    return start_server(ckpt, "--threads", str(threads), *extra)


def post(url: str, path: str, body: dict, stream: bool = False):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=600)
    return resp if stream else json.loads(resp.read())


def share(url: str, before: dict) -> tuple[float, dict]:
    with urllib.request.urlopen(url + "/stats", timeout=60) as resp:
        now = json.loads(resp.read())["engine"]
    done = now["prompt_tokens"] - before.get("prompt_tokens", 0)
    return (now["computed_tokens"] - before.get("computed_tokens", 0)) / max(done, 1), now


def scoring(url: str, prompts: list[list[int]]) -> float:
    """Seconds to score `prompts` as lm-eval's local-completions model does."""
    groups = [prompts[i:i + 8] for i in range(0, len(prompts), 8)]
    body = {"model": "ultratron", "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    start_time = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda g: post(url, "/v1/completions", {**body, "prompt": g}), groups))
    return time.perf_counter() - start_time


def eval_cli(url: str, tasks: str) -> float:
    start_time = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "ultratron", "eval", "--endpoint", url + "/v1", "--model", "ultratron",
                          "--tasks", tasks, "--max-examples", "16", "--quiet"], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return time.perf_counter() - start_time


def chat_ttft(url: str, system: str) -> float:
    def one(i):
        body = {"model": "ultratron", "stream": True, "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}?"}]}
        start_time = time.perf_counter()
        with post(url, "/v1/chat/completions", body, stream=True) as resp:
            for line in resp:
                if line.startswith(b"data: ") and b'"content": "' in line and b'"content": ""' not in line:
                    first = time.perf_counter() - start_time
                    break
            else:
                first = time.perf_counter() - start_time
            for _ in resp:
                pass
        return first

    with ThreadPoolExecutor(8) as pool:
        return statistics.median(pool.map(one, range(32)))


def plain_tps(url: str) -> float:
    def one(i):
        body = {"model": "ultratron", "prompt": f"class Thing{i * 7919}(Base{i}):", "max_tokens": 64,
                "temperature": 0, "ignore_eos": True}
        return post(url, "/v1/completions", body)["usage"]["completion_tokens"]

    start_time = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        tokens = sum(pool.map(one, range(32)))
    return tokens / (time.perf_counter() - start_time)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)  # more than the free cores: multi-threaded ops crawl
    parser.add_argument("--only", default="scoring,eval,chat,plain")
    parser.add_argument("--kv-cache-tokens", type=int)
    args = parser.parse_args()
    parts = args.only.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or small_checkpoint(tmp)
        from ultratron.checkpoint.inference import load_for_inference
        from ultratron.evaluation.builtin import resolve_tasks

        tokenizer = load_for_inference(ckpt, "cpu").tokenizer
        task_file = five_shot_file(Path(tmp) / "five_shot.jsonl")
        prompts = {}
        for name in ("five_shot", "builtin_next_line"):
            task = resolve_tasks(str(task_file) if name == "five_shot" else name)[0]
            prompts[name] = [tokenizer.encode(ex.context + " " + c)[-2000:] for ex in task.examples[:16]
                             for c in ex.choices]
        system = " ".join(SHOT_SOURCE.read_text().split()[:120])  # ~200 tokens
        figures: dict[tuple[str, str], list[float]] = {}
        shares: dict[tuple[str, str], list[float]] = {}
        memory = []
        for _ in range(args.rounds):
            servers = {mode: start(ckpt, tokens, args.threads, args.kv_cache_tokens)
                       for mode, tokens in (("off", 0), ("on", None))}
            try:
                runs = [(f"scoring {n}", lambda url, n=n: scoring(url, prompts[n])) for n in prompts
                        if "scoring" in parts]
                runs += [(f"eval {t}", lambda url, t=t: eval_cli(url, t)) for t in ("builtin_next_line", str(task_file))
                         if "eval" in parts]
                runs += [("chat ttft", lambda url: chat_ttft(url, system))] * ("chat" in parts)
                runs += [("plain tokens/s", plain_tps)] * ("plain" in parts)
                stats = {mode: {} for mode in servers}
                for name, run in runs:
                    for mode in ("off", "on"):  # alternated, each on its own fresh server
                        url = servers[mode][1]
                        figures.setdefault((name, mode), []).append(run(url))
                        s, stats[mode] = share(url, stats[mode])
                        shares.setdefault((name, mode), []).append(s)
                engine = stats["on"]
                memory.append((engine["kv_peak_tokens"], engine["kv_capacity"], engine["prefix_cache"]["bytes"],
                               engine["prefix_cache"]["tokens"],  # the paged cache's (absent before it)
                               engine.get("kv_peak_blocks", 0) * engine.get("kv_block", 0),
                               stats["off"].get("kv_peak_blocks", 0) * stats["off"].get("kv_block", 0),
                               engine.get("preempted", 0) + stats["off"].get("preempted", 0)))
            finally:
                for proc, _ in servers.values():
                    proc.terminate()
                    proc.wait(timeout=15)
        for name in dict.fromkeys(n for n, _ in figures):
            off, on = (statistics.median(figures[name, m]) for m in ("off", "on"))
            ratio = off / on if "tokens/s" not in name else on / off
            unit = "tokens/s" if "tokens/s" in name else "s"
            print(f"{name.split('/')[-1]:>28}: cache off {off:8.3f} {unit}, on {on:8.3f} {unit} ({ratio:.2f}× "
                  f"{'as fast' if unit == 's' else 'of off'}); prompt tokens computed / total: off "
                  f"{statistics.median(shares[name, 'off']):.3f}, on {statistics.median(shares[name, 'on']):.3f} "
                  f"(median of {args.rounds})")
        peak, capacity, cache_bytes, cache_tokens, blocks_on, blocks_off, preempted = memory[-1]
        print(f"KV cache (prefix cache on, last round): at most {peak} positions held of the {capacity} the KV "
              f"cache holds ({peak / capacity:.1%}); in blocks, at most {blocks_on} positions (prefix cache off: "
              f"{blocks_off}); rows preempted: {preempted}; prefix cache {cache_tokens} positions, "
              f"{cache_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
