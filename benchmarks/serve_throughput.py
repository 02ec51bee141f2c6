"""Generated tokens/s of `ultratron serve`, continuous batching against fixed groups, side by side (CPU).

  python benchmarks/serve_throughput.py [--checkpoint DIR] [--concurrency 8] [--requests 48] [--rounds 5]

Without --checkpoint it trains a tiny model for a few steps first. Starts two servers on free
loopback ports — `--batching continuous` and `--batching static` (the fixed-group policy: a
group runs until its longest request ends) — each with --max-batch equal to the concurrency,
and sends the same requests to each in alternating rounds, so both see the same machine load.
Requests ask for mixed lengths (16 to 128 tokens, ignore_eos so every one generates exactly
that many, as vLLM's serving benchmark does). Prints the median over rounds of generated
tokens/s and request latency for each policy, and their ratio.
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

LENGTHS = (16, 128, 32, 64, 16, 96, 24, 48)


def train_checkpoint(root: str, shape: list[str], steps: int) -> str:
    """A checkpoint of `steps` steps on the built-in corpus (300 kB of it), model `shape` overrides."""
    from ultratron.config import load_config
    from ultratron.training.trainer import train

    overrides = [*shape, "--training.micro_batch_size", "4", "--training.batch_tokens", "512",
                 "--training.steps", str(steps), "--training.progress", "false", "--training.sample_tokens", "0",
                 "--run.tensorboard", "false", "--eval.interval", "0", "--data.max_bytes", "300000",
                 "--run.dir", root + "/run"]
    train(load_config(None, overrides), echo=False)
    return root + "/run"


def tiny_checkpoint(root: str) -> str:
    return train_checkpoint(root, ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
                                   "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "512",
                                   "--training.seq_len", "64"], steps=20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """`ultratron serve` of `ckpt` with `flags` on a free port, once its /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ultratron", "serve", "--checkpoint", ckpt, "--port", str(port),
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server ({' '.join(flags)}) did not start")


def start(ckpt: str, batching: str, slots: int) -> tuple[subprocess.Popen, str]:
    return start_server(ckpt, "--batching", batching, "--max-batch", str(slots), "--threads", "1")


def one(url: str, i: int) -> tuple[float, int]:
    body = {"model": "ultratron", "prompt": f"def f{i}(", "max_tokens": LENGTHS[i % len(LENGTHS)],
            "temperature": 0.8, "seed": i, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    start_time = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        usage = json.loads(resp.read())["usage"]
    return time.perf_counter() - start_time, usage["completion_tokens"]


def measure(url: str, concurrency: int, requests: int) -> tuple[float, float]:
    """(generated tokens/s, median latency in s) of one round."""
    start_time = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: one(url, i), range(requests)))
    wall = time.perf_counter() - start_time
    return sum(n for _, n in results) / wall, statistics.median(t for t, _ in results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or tiny_checkpoint(tmp)
        servers = {mode: start(ckpt, mode, args.concurrency) for mode in ("static", "continuous")}
        try:
            for _, url in servers.values():
                measure(url, args.concurrency, args.concurrency)  # warm-up
            figures = {mode: [] for mode in servers}
            for _ in range(args.rounds):
                for mode, (_, url) in servers.items():
                    figures[mode].append(measure(url, args.concurrency, args.requests))
            medians = {mode: (statistics.median(t for t, _ in f), statistics.median(lat for _, lat in f))
                       for mode, f in figures.items()}
            for mode, (tps, latency) in medians.items():
                print(f"{mode:>10}: {tps:8.1f} generated tokens/s, median latency {latency * 1e3:6.0f} ms "
                      f"(concurrency {args.concurrency}, median of {args.rounds} rounds of {args.requests} requests)")
            print(f"continuous / static: {medians['continuous'][0] / medians['static'][0]:.2f}× tokens/s, "
                  f"{medians['static'][1] / medians['continuous'][1]:.2f}× lower median latency")
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=15)


if __name__ == "__main__":
    main()
