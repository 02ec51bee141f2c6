"""Curation in eight languages on the check corpus the tests write (tests/data/multilingual_corpus.py):
per language, what `configs/data-multilingual.toml` keeps of the prose and removes of the junk and
planted duplicates, language identification accuracy, the language stage's speed, and the
tokenizer's bytes per token on held-out text, trained plain and on a language-balanced mix.

    python benchmarks/multilingual_curation.py [--seeds 3] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "data"))

from multilingual_corpus import LANGS, build  # noqa: E402
from test_curation_multilingual import _curate, _scores, _write  # noqa: E402

from ultratron.curation import languages  # noqa: E402
from ultratron.curation.config import load_config  # noqa: E402
from ultratron.curation.frame import pack_tokens  # noqa: E402
from ultratron.curation.runner import run_stage  # noqa: E402
from ultratron.curation.stages.tokenize import language_table  # noqa: E402
from ultratron.data.tokenizer import Tokenizer  # noqa: E402

CONFIG = Path(__file__).parents[1] / "configs" / "data-multilingual.toml"


def curation(seeds: int, root: Path) -> None:
    rows = {lang: [] for lang in LANGS}
    for seed in range(seeds):
        docs = build(seed=seed)
        kept, _ = _curate(docs, root / f"main-{seed}", "read,normalize,language,exact-dedup,near-dedup,filter")
        for lang, s in _scores(docs, kept).items():
            rows[lang].append(s)
    print(f"## configs/data-multilingual.toml on the check corpus (seeds 0–{seeds - 1}; worst seed shown)")
    print("| language | prose kept | junk removed | near dups caught | exact dups caught | unique lost |")
    print("|---|---:|---:|---:|---:|---:|")
    for lang, scores in rows.items():
        print(f"| {lang} | {min(s['prose_kept'] for s in scores):.2f} | {min(s['junk_removed'] for s in scores):.2f} "
              f"| {min(s['near_recall'] for s in scores):.2f} | {min(s['exact_recall'] for s in scores):.2f} "
              f"| {max(s['unique_lost'] for s in scores)} |")


def identification(seeds: int) -> None:
    texts = [(d["lang"], d["text"]) for seed in range(seeds) for held in (False, True)
             for d in build(seed=seed, held_out=held, near_per_language=0, exact_per_language=0, junk_per_language=0)]
    languages.identify("warm up")
    started = time.perf_counter()
    right = {lang: [] for lang in LANGS}
    for lang, text in texts:
        right[lang].append(languages.identify(text)[0] == lang)
    seconds = time.perf_counter() - started
    mb = sum(len(t.encode()) for _, t in texts) / 1e6
    print(f"\nlanguage identification: {len(texts)} documents, {mb:.2f} MB in {seconds:.2f} s "
          f"({mb / seconds:.2f} MB/s, one thread); accuracy " +
          ", ".join(f"{lang} {statistics.mean(r):.3f}" for lang, r in right.items()))


def tokenizer(vocab: int, root: Path) -> None:
    docs = [d for seed in range(4) for d in build(seed=seed, near_per_language=0, exact_per_language=0,
                                                  junk_per_language=0, docs_per_language=24)
            if d["lang"] == "en" or seed == 0]
    for i, d in enumerate(docs):
        d["id"] = f"{i}-{d['id']}"
    path = _write(docs, root / "tok-in.jsonl", language=True)
    held = build(seed=9, held_out=True, near_per_language=0, exact_per_language=0, junk_per_language=0)
    tables = {}
    for alpha in ("1.0", "0.3"):
        cfg = load_config(CONFIG, ["--pipeline.workers", "1", "--pipeline.progress", "false", "--tokenize.vocab_size",
                                   str(vocab), "--tokenize.language_alpha", alpha])
        run_stage("tokenize", cfg, path, root / f"tok-{alpha}")
        tok = Tokenizer.load(root / f"tok-{alpha}" / "tokenizer.json")
        tables[alpha] = language_table(tok, [{"text": d["text"], "language": d["lang"],
                                              "tokens": pack_tokens(tok.encode(d["text"]), "uint32")} for d in held])
    print(f"\n## tokenizer, vocabulary {vocab}, on held-out text (English has 4× the training documents)")
    print("| language | bytes/token (plain) | bytes/token (alpha 0.3) | ÷ English (alpha 0.3) "
          "| tokens/word | round trip |")
    print("|---|---:|---:|---:|---:|---|")
    english = tables["0.3"]["en"]["bytes_per_token"]
    for lang in LANGS:
        plain, balanced = tables["1.0"][lang], tables["0.3"][lang]
        print(f"| {lang} | {plain['bytes_per_token']} | {balanced['bytes_per_token']} | "
              f"{balanced['bytes_per_token'] / english:.2f} | {balanced['tokens_per_word']} | "
              f"{'yes' if balanced['round_trip'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curation(args.seeds, Path(tmp))
        identification(args.seeds)
        tokenizer(args.vocab, Path(tmp))


if __name__ == "__main__":
    main()
