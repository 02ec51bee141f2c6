"""Throughput of each curation stage: MB/s and documents/s, on the built-in corpus and on a
larger synthetic corpus (Zipf-distributed prose with planted exact duplicates, near-duplicates
and a shared boilerplate span, so every stage has work and most documents pass the filters).

    python benchmarks/data_throughput.py [--workers 2] [--synthetic-mb 20] [--builtin-mb 0] [--repeats 1]
                                         [--json FILE]

Runs the whole pipeline in a temporary directory, stage by stage, and prints per stage (the
median over --repeats runs): input MB and documents per wall second, and CPU seconds (the
driver with all its threads plus the worker processes) with input MB per CPU second. MB per
CPU second is the per-core figure: what one fully busy core gets through, whatever the number
of processes and threads, and far less disturbed than wall time by other jobs on shared cores.
Then the two steps the acceptance figures (≥ 5 MB/s per core) name, alone in this process:
MinHash signatures (one thread, ≤ 5 MB) and tokenizer encoding (`Tokenizer.encode_batch`, which
is tiktoken where it gives the same ids, `data/fast_bpe.py`; beside it `tokenizers` itself).
Process and thread counts: `--workers` worker processes do the per-part work; in each, tiktoken
encodes on a thread per core (up to 8, `FastBPE.threads`; `tokenizers`, where it encodes
instead, turns its thread pool off in a forked child once the parent has used it), and with one
worker the driver encodes on every core. With the defaults it takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ultratron.curation.config import from_dict
from ultratron.curation.executors import make_executor
from ultratron.curation.frame import iter_records, list_parts, stage_dirs
from ultratron.curation.runner import run_stage

STOP = ("the of and to a in that is was he for it with as his on be at by had not are but from or have an they "
        "which one you were all her she there would their we him been has when who will no more if out so").split()
BOILERPLATE = ("Subscribe to our newsletter for weekly updates on new articles, events and offers. "
               "You can unsubscribe at any time by following the link at the bottom of every message.")


def synthetic_corpus(path: Path, megabytes: float, seed: int = 0) -> dict[str, int]:
    """Write a JSONL corpus of about `megabytes` MB; returns how many documents of each kind."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    letter_p = 1 / np.arange(1, 27) ** 0.9
    invented = ["".join(rng.choice(letters, size=int(n), p=letter_p / letter_p.sum()))
                for n in rng.integers(3, 11, size=20_000)]
    vocab = np.array(STOP + invented)
    word_p = 1 / np.arange(1, len(vocab) + 1) ** 1.05  # Zipf-like: stop words are the most common
    word_p /= word_p.sum()

    def document() -> str:
        n_sent = int(rng.integers(15, 45))
        lengths = rng.integers(8, 21, size=n_sent)
        words = rng.choice(vocab, size=int(lengths.sum()), p=word_p)
        sentences, at = [], 0
        for n in lengths.tolist():
            sentences.append(" ".join(words[at:at + n]).capitalize() + ".")
            at += n
        breaks = np.cumsum(rng.integers(1, 4, size=n_sent))  # 1–3 sentences a line, 4 lines a paragraph
        lines = [" ".join(sentences[a:b]) for a, b in zip(np.r_[0, breaks[:-1]], breaks, strict=True) if a < n_sent]
        return "\n\n".join("\n".join(lines[i:i + 4]) for i in range(0, len(lines), 4))

    def edited(text: str, share: float) -> str:
        words = text.split(" ")
        for i in rng.choice(len(words), size=max(1, int(share * len(words))), replace=False).tolist():
            words[i] = str(rng.choice(vocab, p=word_p))
        return " ".join(words)

    kinds = {"unique": 0, "exact_copy": 0, "near_copy": 0, "boilerplate": 0}
    written, k, recent = 0, 0, []
    with open(path, "w", encoding="utf-8") as fh:
        while written < megabytes * 1e6:
            roll = rng.random()
            if roll < 0.05 and recent:
                text, kind = recent[int(rng.integers(len(recent)))], "exact_copy"
            elif roll < 0.10 and recent:
                text, kind = edited(recent[int(rng.integers(len(recent)))], 0.01), "near_copy"
            else:
                text, kind = document(), "unique"
                if roll > 0.95:
                    text, kind = text + "\n\n" + BOILERPLATE, "boilerplate"
                recent = (recent + [text])[-200:]
            fh.write(json.dumps({"id": f"s{k}", "text": text}) + "\n")
            written += len(text.encode("utf-8"))
            kinds[kind] += 1
            k += 1
    return kinds


def cpu_now() -> float:
    """CPU seconds of this process (all its threads) and of its reaped children (pool workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _sample(texts: list[str], max_mb: float) -> tuple[list[str], int]:
    sample, size = [], 0
    for text in texts:
        if size >= max_mb * 1e6:
            break
        sample.append(text)
        size += len(text.encode("utf-8"))
    return sample, size


def timed(fn, repeats: int = 3) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds) of `fn()` over `repeats` calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        cpu, start = cpu_now(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(cpu_now() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def bench_parts(texts: list[str], tokenize_dir: Path) -> dict:
    """The two steps the acceptance figures (≥ 5 MB/s per core) name, alone, in this process:
    MinHash signatures (≤ 5 MB) and tokenizer encoding (everything the tokenize stage encoded,
    `Tokenizer.encode_batch` over batches of BATCH_DOCS documents on the tokenizer's threads)."""
    from ultratron.curation.frame import BATCH_DOCS
    from ultratron.curation.stages.near_dedup import signatures
    from ultratron.data.tokenizer import Tokenizer

    sample, size = _sample(texts, 5.0)
    wall, cpu = timed(lambda: signatures(sample, 5, 112, 1))
    out = {"minhash": {"mb": size / 1e6, "wall": wall, "cpu": cpu}}
    tokenizer = Tokenizer.load(tokenize_dir / "tokenizer.json")
    docs = [r["text"] for p in list_parts(tokenize_dir) for _, r, _ in iter_records(p) if r]
    size = sum(len(t.encode("utf-8")) for t in docs)

    def encode(fn) -> None:
        for i in range(0, len(docs), BATCH_DOCS):
            fn(docs[i:i + BATCH_DOCS])
    assert tokenizer.fast is not None, tokenizer.fast_reason
    wall, cpu = timed(lambda: encode(tokenizer.encode_batch))
    out["encode"] = {"mb": size / 1e6, "wall": wall, "cpu": cpu}
    wall, cpu = timed(lambda: encode(lambda texts: tokenizer.hf.encode_batch_fast(texts, add_special_tokens=False)))
    out["encode_hf"] = {"mb": size / 1e6, "wall": wall, "cpu": cpu}
    return out


def run_once(cfg) -> list[dict]:
    """The pipeline, stage by stage as `run_pipeline` runs it, with each stage's CPU time."""
    executor = make_executor(cfg)
    previous, stages = cfg.pipeline.input, []
    try:
        for stage, stage_dir in stage_dirs(cfg):
            cpu = cpu_now()
            summary = run_stage(stage, cfg, previous, stage_dir, executor)
            stages.append(summary | {"cpu_seconds": cpu_now() - cpu})
            previous = stage_dir
    finally:
        executor.close()
    return stages


def run(name: str, source: str, workdir: Path, workers: int, max_bytes: int, repeats: int) -> dict:
    """Run the pipeline `repeats` times; print and return per-stage medians."""
    runs = []
    for r in range(repeats):
        out = workdir / f"{name}-{r}"
        cfg = from_dict({
            "pipeline": {"input": source, "output": str(out), "workers": workers, "progress": False,
                         # enough parts for every worker: the built-in corpus has ~650 large files
                         "docs_per_part": 100 if name == "builtin" else 500},
            "read": {"max_bytes": max_bytes},
            "filter": {"enabled": ["gopher_repetition", "punctuation"] if name == "builtin" else
                       ["gopher_repetition", "gopher_quality", "c4", "fineweb", "punctuation"]},
            "tokenize": {"vocab_size": 4096, "train_bytes": 10_000_000},
        })
        runs.append(run_once(cfg))
    first = runs[0]
    print(f"\n## {name} corpus ({first[0]['bytes_in'] / 1e6:.1f} MB, {first[0]['docs_in']} documents, "
          f"{workers} worker process(es), median of {repeats}; load average {os.getloadavg()[0]:.1f})")
    print(f"{'stage':<16} {'docs in':>8} {'docs out':>8} {'MB in':>7} {'seconds':>8} {'MB/s':>8} {'docs/s':>8} "
          f"{'CPU s':>7} {'MB/CPU-s':>9}")
    rows = []
    for i, s in enumerate(first):
        secs = max(statistics.median(run[i]["wall_seconds"] for run in runs), 1e-9)
        cpu = max(statistics.median(run[i]["cpu_seconds"] for run in runs), 1e-9)
        row = {"stage": s["stage"], "docs_in": s["docs_in"], "docs_out": s["docs_out"], "mb_in": s["bytes_in"] / 1e6,
               "seconds": secs, "mb_per_s": s["bytes_in"] / 1e6 / secs, "docs_per_s": s["docs_in"] / secs,
               "cpu_seconds": cpu, "mb_per_cpu_s": s["bytes_in"] / 1e6 / cpu}
        rows.append(row)
        print(f"{row['stage']:<16} {row['docs_in']:>8} {row['docs_out']:>8} {row['mb_in']:>7.1f} {secs:>8.2f} "
              f"{row['mb_per_s']:>8.2f} {row['docs_per_s']:>8.0f} {cpu:>7.2f} {row['mb_per_cpu_s']:>9.2f}")
    print(f"{'total':<16} {'':>8} {'':>8} {'':>7} {sum(r['seconds'] for r in rows):>8.1f} {'':>8} {'':>8} "
          f"{sum(r['cpu_seconds'] for r in rows):>7.1f}")
    tok = next(i for i, s in enumerate(first) if s["stage"] == "tokenize")
    train = statistics.median(run[tok]["train_cpu_seconds"] for run in runs)
    row = rows[tok]
    row["train_cpu_seconds"] = train
    row["mb_per_cpu_s_without_training"] = row["mb_in"] / max(row["cpu_seconds"] - train, 1e-9)
    print(f"tokenize: {first[tok]['encoder']}; training the tokenizer took {train:.2f} of its {row['cpu_seconds']:.2f} "
          f"CPU s (a fixed cost, ≤ tokenize.train_bytes); the rest: {row['mb_per_cpu_s_without_training']:.2f} "
          "MB per CPU-second")
    stage_dir = {s: workdir / f"{name}-0" / f"{i:02d}-{s}" for i, s in enumerate(r["stage"] for r in rows)}
    texts = [r["text"] for p in list_parts(stage_dir["normalize"]) for _, r, _ in iter_records(p) if r]
    parts = bench_parts(texts, stage_dir["tokenize"])
    for label, key, threads in (("MinHash signatures alone", "minhash", "1 thread"),
                                ("tokenizer encoding alone (tiktoken, same ids)", "encode",
                                 f"{min(8, os.cpu_count())} threads"),
                                ("... with tokenizers' encode_batch_fast instead", "encode_hf",
                                 f"{os.cpu_count()} tokenizer threads")):
        m = parts[key]
        print(f"{label} ({m['mb']:.1f} MB, this process, {threads}, median of 3): {m['mb'] / m['wall']:.1f} MB/s, "
              f"{m['mb'] / m['cpu']:.1f} MB per CPU-second")
    return {"stages": rows, "alone": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--synthetic-mb", type=float, default=20)
    parser.add_argument("--builtin-mb", type=float, default=0, help="cap on the built-in corpus; 0 = all")
    parser.add_argument("--repeats", type=int, default=1, help="pipeline runs per corpus; stage times are medians")
    parser.add_argument("--skip-builtin", action="store_true")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.1f} at the start")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.skip_builtin:
            results["builtin"] = run("builtin", "builtin", work, args.workers, int(args.builtin_mb * 1e6),
                                     args.repeats)
        t = time.perf_counter()
        kinds = synthetic_corpus(work / "synthetic.jsonl", args.synthetic_mb)
        print(f"\nsynthetic corpus written in {time.perf_counter() - t:.1f}s: {kinds}")
        results["synthetic"] = run("synthetic", str(work / "synthetic.jsonl"), work, args.workers, 0, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
