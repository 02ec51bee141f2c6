"""Run tasks on a backend: metrics per task, a printed table, a JSON record."""

from __future__ import annotations

import math
import time
from pathlib import Path

from ultratron import atomic
from ultratron.evaluation.backends import bits_per_byte
from ultratron.evaluation.tasks import Task


def _choice_metrics(task: Task, backend, details: bool) -> dict:
    pairs, spans = [], []
    for ex in task.examples:
        spans.append((len(pairs), len(ex.choices)))
        pairs.extend((ex.context, choice + ex.suffix) for choice in ex.choices)
    scores = backend.loglikelihood(pairs)
    correct = correct_norm = 0
    per_example = []
    for ex, (start, n) in zip(task.examples, spans, strict=True):
        lls = [scores[start + k][0] for k in range(n)]
        # acc_norm: per character of what was scored (lm-eval divides by the choice's length)
        norm = [ll / max(len(ex.choices[k] + ex.suffix), 1) for k, ll in enumerate(lls)]
        correct += lls.index(max(lls)) == ex.answer
        correct_norm += norm.index(max(norm)) == ex.answer
        per_example.append(lls)
    n = len(task.examples)
    out = {"acc": correct / n, "acc_norm": correct_norm / n, "n": n}
    if details:
        out["loglikelihoods"] = per_example
    return out


def _text_metrics(task: Task, backend) -> dict:
    scored = backend.rolling_loglikelihood([ex.text for ex in task.examples])
    nll = -sum(s for s, _, _ in scored)
    tokens = sum(n for _, n, _ in scored)
    n_bytes = sum(b for _, _, b in scored)
    return {"loss": nll / max(tokens, 1), "bits_per_byte": bits_per_byte(nll, n_bytes), "tokens": tokens,
            "bytes": n_bytes, "n": len(task.examples)}


def _generation_metrics(task: Task, backend, details: bool) -> dict:
    outputs = backend.generate([(ex.prompt, ex.stop, ex.max_tokens) for ex in task.examples])
    hits = [out.strip() == ex.target.strip() for out, ex in zip(outputs, task.examples, strict=True)]
    result = {"exact_match": sum(hits) / len(hits), "n": len(hits)}
    if details:
        result["outputs"] = outputs
    return result


def evaluate(backend, tasks: list[Task], max_examples: int | None = None, details: bool = False) -> dict:
    """{task name: metrics} for every task, at most `max_examples` examples each."""
    results = {}
    for task in tasks:
        if max_examples:
            task = Task(task.name, task.kind, task.examples[:max_examples])
        start = time.perf_counter()
        if task.kind == "text":
            metrics = _text_metrics(task, backend)
        elif task.kind in ("multiple_choice", "cloze"):
            metrics = _choice_metrics(task, backend, details)
        else:
            metrics = _generation_metrics(task, backend, details)
        metrics["seconds"] = round(time.perf_counter() - start, 3)
        results[task.name] = metrics
    return results


PRIMARY = ("acc", "acc_norm", "bits_per_byte", "loss", "exact_match")


def format_table(results: dict) -> str:
    rows = [("task", "metric", "value", "n")]
    for name, metrics in results.items():
        for key in PRIMARY:
            if key in metrics:
                rows.append((name, key, f"{metrics[key]:.4f}", str(metrics["n"])))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                                   strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def flat_metrics(results: dict, prefix: str = "eval") -> dict[str, float]:
    """{'eval/TASK/METRIC': value} for the numbers that go into metrics.jsonl and TensorBoard."""
    return {f"{prefix}/{name}/{key}": float(m[key]) for name, m in results.items() for key in PRIMARY
            if key in m and isinstance(m[key], (int, float)) and math.isfinite(m[key])}


def write_json(path: str | Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, record, indent=1)
