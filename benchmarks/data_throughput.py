"""Throughput of each curation stage: MB/s and documents/s, on the built-in corpus and on a
larger synthetic corpus (random-word prose with planted duplicates).

    python benchmarks/data_throughput.py [--workers 1] [--synthetic-mb 50] [--builtin-mb 0]

Runs the whole pipeline in a temporary directory and prints, per stage, input MB / wall seconds
and input documents / wall seconds, plus the MinHash signature step alone (one core, median of
3), which the acceptance figure (≥ 5 MB/s per core) refers to.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from ultratron.data.pipeline import run_pipeline
from ultratron.data.pipeline_config import from_dict


def synthetic_corpus(path: Path, megabytes: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 10))) for _ in range(20000)]
    written = 0
    with open(path, "w", encoding="utf-8") as fh:
        k = 0
        while written < megabytes * 1e6:
            lines = [" ".join(rng.choice(vocab) for _ in range(15)).capitalize() + "." for _ in range(30)]
            text = "\n".join(lines)
            for copy in range(2 if rng.random() < 0.1 else 1):  # 10% of documents duplicated
                fh.write(json.dumps({"id": f"s{k}-{copy}", "text": text}) + "\n")
                written += len(text)
            k += 1


def bench_signatures(texts: list[str]) -> float:
    from ultratron.data.dedup import signatures

    mb = sum(len(t.encode()) for t in texts) / 1e6
    times = []
    for _ in range(3):
        start = time.perf_counter()
        signatures(texts, 5, 112, 1)
        times.append(time.perf_counter() - start)
    return mb / statistics.median(times)


def run(name: str, source: str, workdir: Path, workers: int, max_bytes: int) -> None:
    cfg = from_dict({
        "pipeline": {"input": source, "output": str(workdir / name), "workers": workers, "progress": False,
                     "docs_per_part": 1000},
        "read": {"max_bytes": max_bytes},
        "filter": {"enabled": ["gopher_repetition", "punctuation"] if name == "builtin" else
                   ["gopher_repetition", "gopher_quality", "c4", "fineweb", "punctuation"]},
        "tokenize": {"vocab_size": 4096, "train_bytes": 10_000_000},
    })
    report = run_pipeline(cfg, log=lambda _: None)
    print(f"\n## {name} corpus ({report['stages'][0]['bytes_in'] / 1e6:.1f} MB, "
          f"{report['stages'][0]['docs_in']} documents, {workers} worker(s))")
    print(f"{'stage':<16} {'MB/s':>8} {'docs/s':>10} {'seconds':>8}")
    for s in report["stages"]:
        secs = max(s["wall_seconds"], 1e-9)
        print(f"{s['stage']:<16} {s['bytes_in'] / 1e6 / secs:>8.2f} {s['docs_in'] / secs:>10.0f} {secs:>8.2f}")
    from ultratron.data.pipeline import iter_records, list_parts

    texts = [r["text"] for p in list_parts(workdir / name / "01-normalize") for _, r, _ in iter_records(p) if r]
    print(f"MinHash signatures alone (1 core, median of 3): {bench_signatures(texts):.1f} MB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--synthetic-mb", type=float, default=50)
    parser.add_argument("--builtin-mb", type=float, default=0, help="cap on the built-in corpus; 0 = all")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run("builtin", "builtin", work, args.workers, int(args.builtin_mb * 1e6))
        synthetic_corpus(work / "synthetic.jsonl", args.synthetic_mb)
        run("synthetic", str(work / "synthetic.jsonl"), work, args.workers, 0)


if __name__ == "__main__":
    main()
