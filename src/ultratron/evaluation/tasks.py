"""Evaluation tasks and the task-file formats.

Kinds of task:
- `text`: held-out text; loss (nats/token) and bits per byte.
- `multiple_choice`: a context and choices scored by log-likelihood; accuracy and
  length-normalized accuracy (log-likelihood per character of the choice, as lm-eval's acc_norm).
- `cloze`: the same, but each choice fills a blank inside a line and the rest of the line
  (`suffix`) is scored with it, so a choice is judged by how well the whole line reads.
- `generation`: greedy generation up to a stop sequence; exact match after stripping whitespace.

Task files (one task per file; see docs/evaluation.md):
- ultratron JSONL: one object per line, `{"type": "multiple_choice", "context", "choices", "answer"}`,
  `{"type": "cloze", "context", "choices", "suffix", "answer"}`, `{"type": "generation", "prompt",
  "target", "stop"}` or `{"type": "text", "text"}`;
- lm-evaluation-harness-style multiple choice JSONL: `{"query" | "question", "choices", "gold" | "label"}`
  (choices are joined to the query with a space, lm-eval's default target delimiter);
- BIG-bench `task.json`: `examples` with `input` and `target_scores` (multiple choice, the
  highest-scoring target is right) or `target` (generation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ultratron.data.sources import iter_jsonl
from ultratron.errors import TaskError


@dataclass
class ChoiceExample:
    context: str
    choices: list[str]
    answer: int
    suffix: str = ""  # cloze: scored after every choice


@dataclass
class GenerationExample:
    prompt: str
    target: str
    stop: tuple[str, ...] = ("\n",)
    max_tokens: int = 32


@dataclass
class TextExample:
    text: str


@dataclass
class Task:
    name: str
    kind: str  # "text" | "multiple_choice" | "cloze" | "generation"
    examples: list = field(default_factory=list)


KINDS = ("text", "multiple_choice", "cloze", "generation")


def _choice_example(record: dict, where: str, context_key: str, answer_key: str, sep: str = "") -> ChoiceExample:
    choices = record.get("choices")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
        raise TaskError(f"{where}: 'choices' must be a list of at least two strings")
    answer = record.get(answer_key)
    if not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise TaskError(f"{where}: '{answer_key}' must be an index into choices (0..{len(choices) - 1})")
    context = record.get(context_key)
    if not isinstance(context, str):
        raise TaskError(f"{where}: '{context_key}' must be a string")
    return ChoiceExample(context, [sep + c for c in choices], answer, str(record.get("suffix", "")))


def _from_record(record: dict, where: str) -> tuple[str, object]:
    if not isinstance(record, dict):
        raise TaskError(f"{where}: each line must be a JSON object")
    kind = record.get("type")
    if kind is None:  # lm-evaluation-harness style multiple choice
        context_key = next((k for k in ("query", "question", "context") if k in record), None)
        answer_key = next((k for k in ("gold", "label", "answer") if k in record), None)
        if context_key is None or answer_key is None:
            raise TaskError(f"{where}: no 'type' field, and not lm-eval style multiple choice "
                            "(needs query/question, choices and gold/label)")
        return "multiple_choice", _choice_example(record, where, context_key, answer_key, sep=" ")
    if kind not in KINDS:
        raise TaskError(f"{where}: type {kind!r} is not one of {', '.join(KINDS)}")
    if kind in ("multiple_choice", "cloze"):
        return kind, _choice_example(record, where, "context", "answer")
    if kind == "generation":
        if not isinstance(record.get("prompt"), str) or not isinstance(record.get("target"), str):
            raise TaskError(f"{where}: generation needs string 'prompt' and 'target'")
        stop = record.get("stop", ["\n"])
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        return kind, GenerationExample(record["prompt"], record["target"], stop, int(record.get("max_tokens", 32)))
    if not isinstance(record.get("text"), str) or not record["text"]:
        raise TaskError(f"{where}: text needs a non-empty string 'text'")
    return kind, TextExample(record["text"])


def load_jsonl_task(path: Path) -> Task:
    kinds, examples = set(), []
    for line in iter_jsonl(path):
        if line.problem is not None:
            raise TaskError(f"{path}:{line.number}: not valid UTF-8 JSON ({line.detail})")
        kind, example = _from_record(line.value, f"{path}:{line.number}")
        kinds.add(kind)
        examples.append(example)
    if not examples:
        raise TaskError(f"{path}: holds no examples")
    if len(kinds) > 1:
        raise TaskError(f"{path}: mixes task types {sorted(kinds)}; use one file per type")
    return Task(path.stem, kinds.pop(), examples)


def load_bigbench_task(path: Path) -> Task:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TaskError(f"{path}: not valid JSON ({err.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("examples"), list) or not data["examples"]:
        raise TaskError(f"{path}: a BIG-bench task.json needs a non-empty 'examples' list")
    # BIG-bench's defaults for how an example becomes a prompt
    prefix = data.get("task_prefix", "")
    q = data.get("example_input_prefix", "\nQ: ")
    a = data.get("example_output_prefix", "\nA: ")
    name = data.get("name") or (path.parent.name if path.name == "task.json" else path.stem)
    choice_examples, gen_examples = [], []
    for i, ex in enumerate(data["examples"]):
        where = f"{path}: examples[{i}]"
        if not isinstance(ex, dict) or not isinstance(ex.get("input"), str):
            raise TaskError(f"{where}: needs a string 'input'")
        context = prefix + q + ex["input"] + a
        if isinstance(ex.get("target_scores"), dict) and ex["target_scores"]:
            choices = list(ex["target_scores"])
            scores = [float(ex["target_scores"][c]) for c in choices]
            choice_examples.append(ChoiceExample(context, choices, scores.index(max(scores))))
        elif "target" in ex:
            target = ex["target"][0] if isinstance(ex["target"], list) else ex["target"]
            gen_examples.append(GenerationExample(context, str(target), ("\n",)))
        else:
            raise TaskError(f"{where}: needs 'target_scores' or 'target'")
    if choice_examples and gen_examples:
        raise TaskError(f"{path}: mixes multiple-choice and generation examples")
    if choice_examples:
        return Task(name, "multiple_choice", choice_examples)
    return Task(name, "generation", gen_examples)


def load_task_file(path: str | Path) -> Task:
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"task file {str(path)!r} does not exist")
    if path.suffix == ".json":
        return load_bigbench_task(path)
    if path.suffix == ".jsonl":
        return load_jsonl_task(path)
    raise TaskError(f"{path}: task files are .jsonl (ultratron or lm-eval style) or .json (BIG-bench)")
