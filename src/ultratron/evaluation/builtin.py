"""The built-in suite, made from the held-out split of the built-in corpus (standard-library
.py files that training never sees). Deterministic: fixed file order and seeds.

- builtin_bpb: bits per byte on the start of held-out files.
- builtin_next_line: which of four lines really follows the previous lines (distractors: code lines
  of about the same length from other files).
- builtin_identifier_cloze: which identifier fills a blank in a line (candidates from the same file).
- builtin_arithmetic: two-number sums and differences, few-shot, greedy generation, exact match.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import keyword
import random
import re
import sys
from pathlib import Path

from ultratron.atomic import cache_dir, write_text
from ultratron.data.sources import BUILTIN_EXCLUDED_DIRS, builtin_corpus_root, held_out, walk_files
from ultratron.errors import TaskError
from ultratron.evaluation.tasks import ChoiceExample, GenerationExample, Task, TextExample, load_task_file

BUILTIN_TASKS = ("builtin_bpb", "builtin_next_line", "builtin_identifier_cloze", "builtin_arithmetic")
# The trainer's default data.held_out_fraction: the suite's split when the run that is evaluated did not
# train on the built-in corpus (or is unknown: an endpoint), see `suite_fraction`.
HELD_OUT_FRACTION = 0.05
PER_TASK = 200
CONTEXT_LINES, CONTEXT_CHARS = 3, 100  # identifier cloze
# Next line: the context is the previous several lines; the real line is a short code line that
# reuses at least two names from them (so reading the context tells it apart); each distractor
# is a code line of about the same length from a different held-out file, sharing no name with
# the context. Short candidates keep the spread of their context-free likelihoods small, so
# plain accuracy (summed log-likelihood) measures whether the model reads the context.
NEXT_CONTEXT_LINES, NEXT_CONTEXT_CHARS = 6, 300
NEXT_PER_FILE, NEXT_SHARED_NAMES, NEXT_MAX_CHARS = 10, 2, 50
_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b")
_CODE_START = re.compile(r"^\s*(?:[A-Za-z_@]|[)\]}])")  # not a string, comment or literal table line


def held_out_documents(fraction: float = HELD_OUT_FRACTION) -> list[tuple[str, str]]:
    root = builtin_corpus_root()
    docs = []
    for path in walk_files(root, (".py",), BUILTIN_EXCLUDED_DIRS):
        doc_id = str(path.relative_to(root))
        if not held_out(doc_id, fraction):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append((doc_id, text))
    return sorted(docs)


def _good_line(line: str) -> bool:
    s = line.strip()
    return 12 <= len(s) <= 70 and not s.startswith("#")


def _names(text: str) -> set[str]:
    return {m.group() for m in _IDENT.finditer(text) if not keyword.iskeyword(m.group())}


def _context(lines: list[str], i: int) -> str:
    return ("\n".join(lines[max(0, i - CONTEXT_LINES): i]) + "\n")[-CONTEXT_CHARS:]


def _shares_names(names: set[str], context: str) -> bool:
    """Whether at least NEXT_SHARED_NAMES of `names` are names of `context`; a name missing from its
    text is missing from its names, so most lines are settled without finding the context's names."""
    if sum(name in context for name in names) < NEXT_SHARED_NAMES:
        return False
    return len(names & _names(context)) >= NEXT_SHARED_NAMES


def _code_line(line: str) -> bool:
    return 12 <= len(line.strip()) <= NEXT_MAX_CHARS and bool(_CODE_START.match(line))


def _next_context(lines: list[str], i: int) -> str:
    return ("\n".join(lines[max(0, i - NEXT_CONTEXT_LINES): i]) + "\n")[-NEXT_CONTEXT_CHARS:]


def next_line_task(docs, rng: random.Random) -> Task:
    pools = [[ln for ln in text.splitlines() if _code_line(ln)] for _, text in docs]
    line_names: dict[str, set[str]] = {}  # a pool line's names, found once (the search meets it again)

    def names_of(line: str) -> set[str]:
        if line not in line_names:
            line_names[line] = _names(line)
        return line_names[line]

    lengths = [sorted((len(ln), k) for k, ln in enumerate(pool)) for pool in pools]

    def by_length(j: int, lo: int, hi: int) -> list[str]:
        """Pool j's lines of lo..hi characters, in the pool's order."""
        sizes = lengths[j]
        found = sizes[bisect.bisect_left(sizes, (lo, -1)): bisect.bisect_right(sizes, (hi, len(sizes)))]
        return [pools[j][k] for k in sorted(k for _, k in found)]

    examples = []
    for d, (_, text) in enumerate(docs):
        lines = text.splitlines()
        spots = [i for i in range(NEXT_CONTEXT_LINES, len(lines)) if _code_line(lines[i])
                 and _shares_names(names_of(lines[i]), _next_context(lines, i))]
        for i in rng.sample(spots, min(NEXT_PER_FILE, len(spots))):
            real, context = lines[i], _next_context(lines, i)
            seen = _names(context)
            others = [j for j in range(len(docs)) if j != d]
            rng.shuffle(others)
            distractors: list[str] = []
            near = max(2, len(real) // 8)
            for j in others:  # one distractor per other file, so no single large file dominates
                close = [ln for ln in by_length(j, len(real) - near, len(real) + near)
                         if not names_of(ln) & seen and ln.strip() != real.strip() and ln not in distractors]
                if close:
                    distractors.append(rng.choice(close))
                if len(distractors) == 3:
                    break
            if len(distractors) < 3:
                continue
            choices = distractors + [real]
            rng.shuffle(choices)
            examples.append(ChoiceExample(context, choices, choices.index(real)))
    rng.shuffle(examples)
    return Task("builtin_next_line", "multiple_choice", examples[:PER_TASK])


def identifier_cloze_task(docs, rng: random.Random) -> Task:
    examples = []
    for _, text in docs:
        lines = text.splitlines()
        names = sorted({m.group() for m in _IDENT.finditer(text) if not keyword.iskeyword(m.group())})
        if len(names) < 4:
            continue
        spots = []
        for i in range(CONTEXT_LINES, len(lines)):
            if not _good_line(lines[i]):
                continue
            context = _context(lines, i)
            for m in _IDENT.finditer(lines[i]):
                if not keyword.iskeyword(m.group()) and m.group() in context:
                    spots.append((i, m))
                    break
        for i, m in rng.sample(spots, min(4, len(spots))):
            word = m.group()
            choices = rng.sample([n for n in names if n != word], 3) + [word]
            rng.shuffle(choices)
            context = _context(lines, i) + lines[i][: m.start()]
            examples.append(ChoiceExample(context, choices, choices.index(word), suffix=lines[i][m.end():]))
    rng.shuffle(examples)
    return Task("builtin_identifier_cloze", "cloze", examples[:PER_TASK])


def arithmetic_task(rng: random.Random) -> Task:
    def problem() -> tuple[str, str]:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-")
        return f"{a} {op} {b} =", str(a + b if op == "+" else a - b)

    examples = []
    for _ in range(PER_TASK):
        shots = "".join(f"{q} {ans}\n" for q, ans in (problem() for _ in range(3)))
        q, ans = problem()
        examples.append(GenerationExample(shots + q, ans, ("\n",), max_tokens=6))
    return Task("builtin_arithmetic", "generation", examples)


@functools.lru_cache(maxsize=2)
def _held_out(fraction: float) -> list[tuple[str, str]]:
    return held_out_documents(fraction)


def _cached(name: str, fraction: float, make) -> Task:
    """A multiple-choice task made by `make(docs)` from the held-out documents, or as it was made
    before: a search over every held-out line (~0.16 s for next_line, most of `eval --endpoint`'s
    fixed cost) is kept in `cache_dir("tasks")` under a hash of everything it depends on — this
    module's source, the documents' names and texts, the fraction, Python's version (its `random`)
    — so a change to any of them makes it anew. A cache that cannot be written is skipped."""
    docs = _held_out(fraction)
    key = hashlib.sha256(Path(__file__).read_bytes())
    key.update(f"{name}|{fraction!r}|{sys.version_info[:2]}".encode())
    for doc_id, text in docs:
        key.update(f"{len(doc_id)}:{doc_id}{len(text)}:".encode() + text.encode("utf-8", "surrogatepass"))
    path = cache_dir("tasks") / f"{name}-{key.hexdigest()[:24]}.json"
    try:
        kind, rows = json.loads(path.read_text(encoding="utf-8"))
        return Task(name, kind, [ChoiceExample(*row) for row in rows])
    except (OSError, ValueError, TypeError):  # not there (or not readable as one): made, then kept
        pass
    task = make(docs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps([task.kind, [[e.context, e.choices, e.answer, e.suffix] for e in task.examples]]))
    except OSError:
        pass
    return task


@functools.lru_cache(maxsize=8)
def builtin_task(name: str, fraction: float = HELD_OUT_FRACTION) -> Task:
    """One task of the suite, made alone: each has its own seeded generator, so it is the same task
    whether or not the others are made (an evaluation of one task skips the others' cost)."""
    if name == "builtin_bpb":
        return Task("builtin_bpb", "text", [TextExample(text[:1500]) for _, text in _held_out(fraction)[:PER_TASK]])
    if name == "builtin_next_line":
        return _cached(name, fraction, lambda docs: next_line_task(docs, random.Random(1)))
    if name == "builtin_identifier_cloze":
        return _cached(name, fraction, lambda docs: identifier_cloze_task(docs, random.Random(2)))
    if name == "builtin_arithmetic":
        return arithmetic_task(random.Random(3))
    raise TaskError(f"unknown built-in task {name!r}: one of {', '.join(BUILTIN_TASKS)}")


def builtin_suite(fraction: float = HELD_OUT_FRACTION) -> tuple[Task, ...]:
    return tuple(builtin_task(name, fraction) for name in BUILTIN_TASKS)


def suite_fraction(cfg=None) -> float:
    """The held-out fraction the built-in suite is built with for a run of config `cfg`: the run's own
    `data.held_out_fraction` when it trained on the built-in corpus, so the suite is always part of
    the split the run held out and never a file it trained on (a fixed 0.05 would evaluate a run
    holding out 0.01 on files it trained on); else (another corpus, or no config) `HELD_OUT_FRACTION`.
    A run on the built-in corpus that held out nothing has no file the suite may use: refused."""
    if getattr(cfg, "data", None) is None or not cfg.data.builtin_corpus:
        return HELD_OUT_FRACTION
    return checked_fraction(cfg.data.held_out_fraction)


def checked_fraction(fraction: float) -> float:
    """A run's held-out fraction of the built-in corpus, refused where it held out nothing."""
    if fraction <= 0:
        raise TaskError("the run trained on every file of the built-in corpus (data.held_out_fraction = 0), so the "
                        "built-in suite has no file it was not trained on; evaluate it on task files instead")
    return fraction


def example_texts(task: Task) -> list[str]:
    """What a model is shown and must produce for each example, as one text: the text; the context
    with the right choice (and the cloze's suffix); the prompt with its target. What decontamination
    looks for in training data."""
    texts = []
    for ex in task.examples:
        if isinstance(ex, TextExample):
            texts.append(ex.text)
        elif isinstance(ex, ChoiceExample):
            texts.append(ex.context + ex.choices[ex.answer] + ex.suffix)
        else:
            texts.append(f"{ex.prompt} {ex.target}")
    return texts


def task_texts(spec: str, held_out_fraction: float = HELD_OUT_FRACTION) -> dict[str, list[str]]:
    """Task name → its examples' texts (`example_texts`), for every task `spec` resolves to: the
    curation's decontaminate stage takes it (`run_stage(..., task_texts=task_texts)`)."""
    return {task.name: example_texts(task) for task in resolve_tasks(spec, held_out_fraction)}


def resolve_tasks(spec: str, held_out_fraction: float = HELD_OUT_FRACTION) -> list[Task]:
    """`builtin`, built-in task names and task files, comma-separated; the built-in suite made from the
    `held_out_fraction` split (`suite_fraction` of the run evaluated)."""
    tasks: list[Task] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item == "builtin":
            tasks.extend(builtin_suite(held_out_fraction))
        elif item in BUILTIN_TASKS:
            tasks.append(builtin_task(item, held_out_fraction))
        elif item.endswith((".json", ".jsonl")) or Path(item).exists():
            tasks.append(load_task_file(item))
        else:
            raise TaskError(f"unknown task {item!r}: use builtin, one of {', '.join(BUILTIN_TASKS)}, "
                            "or a .jsonl / .json task file")
    if not tasks:
        raise TaskError("no tasks given")
    return tasks
