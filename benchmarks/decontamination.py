"""Decontamination speed: input MB per CPU-second of matching a corpus against the evaluation tasks'
13-grams, the matching alone (`Index.matches`, this process) and the whole `decontaminate` stage
(reading and writing the JSONL parts, the decision log; the worker processes' CPU time included).

    python benchmarks/decontamination.py [--synthetic-mb 20] [--tasks builtin] [--workers 1] [--repeats 3]

The corpus is `data_throughput.synthetic_corpus` (Zipf-distributed English prose, so most of its
words are also words of the items: the index's vocabulary does not shortcut the work) and, with
--builtin, the built-in corpus's training files (code). Prints the median over --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data_throughput import cpu_now, synthetic_corpus  # noqa: E402

from ultratron.curation.config import from_dict  # noqa: E402
from ultratron.curation.contamination import build_index  # noqa: E402
from ultratron.curation.runner import run_stage  # noqa: E402
from ultratron.data.sources import held_out, iter_builtin  # noqa: E402
from ultratron.evaluation.builtin import HELD_OUT_FRACTION, task_texts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic-mb", type=float, default=20)
    ap.add_argument("--builtin", action="store_true", help="also the built-in corpus's training files")
    ap.add_argument("--tasks", default="builtin")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    items = task_texts(args.tasks)
    index, counts = build_index(items, 13)
    print(f"index: {len(index.hashes)} n-grams of {sum(c['items'] for c in counts.values())} items, "
          f"{len(index.vocab)} words ({', '.join(counts)})")
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {"synthetic": Path(tmp, "synthetic.jsonl")}
        synthetic_corpus(corpora["synthetic"], args.synthetic_mb)
        if args.builtin:
            corpora["builtin"] = Path(tmp, "builtin.jsonl")
            with open(corpora["builtin"], "w", encoding="utf-8") as fh:
                for doc in iter_builtin():
                    if not held_out(doc.id, HELD_OUT_FRACTION):
                        fh.write(json.dumps({"id": doc.id, "text": doc.text}) + "\n")
        for name, path in corpora.items():
            texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
            mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
            core, stage, found = [], [], 0
            for r in range(args.repeats):
                start = time.process_time()
                found = sum(bool(len(index.matches(t)[0])) for t in texts)
                core.append(mb / (time.process_time() - start))
                cfg = from_dict({"decontaminate": {"tasks": args.tasks},
                                 "pipeline": {"workers": args.workers, "progress": False}})
                start = cpu_now()
                run_stage("decontaminate", cfg, path, Path(tmp, f"out-{name}-{r}"), task_texts=task_texts)
                stage.append(mb / (cpu_now() - start))
                print(f"  {name} run {r}: matching {core[-1]:.1f}, stage {stage[-1]:.1f} MB per CPU-second", flush=True)
            print(f"{name}: {mb:.1f} MB, {len(texts)} documents, {found} contaminated; MB per CPU-second (median "
                  f"of {args.repeats}): matching {statistics.median(core):.1f}, "
                  f"whole stage {statistics.median(stage):.1f}")


if __name__ == "__main__":
    main()
