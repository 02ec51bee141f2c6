"""Requests/s and generated tokens/s of `ultratron serve` under concurrent completions (CPU).

  python benchmarks/serve_throughput.py [--checkpoint DIR] [--concurrency 8] [--requests 32] [--max-tokens 32]

Without --checkpoint it trains a tiny model for a few steps first. Starts the server on a free
loopback port, sends requests from a thread pool with the openai client, prints the figures.
"""

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def tiny_checkpoint(root: str) -> str:
    from ultratron.config import load_config
    from ultratron.training.trainer import train

    overrides = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
                 "--model.ffn_dim", "128", "--model.vocab_size", "512", "--training.seq_len", "64",
                 "--training.micro_batch_size", "4", "--training.batch_tokens", "512", "--training.steps", "20",
                 "--training.progress", "false", "--training.sample_tokens", "0", "--run.tensorboard", "false",
                 "--eval.interval", "0", "--data.max_bytes", "300000", "--run.dir", root + "/run"]
    train(load_config(None, overrides), echo=False)
    return root + "/run"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    import openai

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or tiny_checkpoint(tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "ultratron", "serve", "--checkpoint", ckpt, "--port",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

            def one(i: int) -> tuple[float, int]:
                start = time.perf_counter()
                r = client.completions.create(model="ultratron", prompt=f"def f{i}(", max_tokens=args.max_tokens,
                                              temperature=0.8, seed=i)
                return time.perf_counter() - start, r.usage.completion_tokens

            one(0)  # warm-up
            for concurrency in sorted({1, args.concurrency}):
                start = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    results = list(pool.map(one, range(args.requests)))
                wall = time.perf_counter() - start
                tokens = sum(n for _, n in results)
                print(f"concurrency {concurrency:3d}: {args.requests / wall:7.2f} requests/s, "
                      f"{tokens / wall:8.1f} generated tokens/s, median latency "
                      f"{statistics.median(t for t, _ in results) * 1e3:.0f} ms")
        finally:
            proc.terminate()
            proc.wait(timeout=15)


if __name__ == "__main__":
    main()
