"""What a data mixture is, parsed from `[data]` and checked: named prepared datasets, their
weights, and an optional schedule of weights over training tokens. Plain Python, no torch or
numpy, so the config can validate a mixture before anything starts.

    [data]
    sources = ["web=runs/web", "code=runs/code", "math=runs/math"]   # NAME=PREPARED_DIR
    weights = { web = 0.6, code = 0.3, math = 0.1 }                   # normalised to sum to 1
    schedule = ["0 web=0.6 code=0.3 math=0.1", "900000 web=0.3 code=0.3 math=0.4"]

A schedule is a list of points "TOKENS NAME=W NAME=W ...", each naming every source; between
points the weights move linearly with the tokens trained on, after the last they stay, and
before the first the `weights` hold (an annealing phase: raise the high-quality share at the end).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class MixtureSpec:
    names: tuple[str, ...]
    paths: tuple[str, ...]
    weights: tuple[float, ...]  # normalised
    schedule: tuple[tuple[int, tuple[float, ...]], ...] = ()  # (tokens, normalised weights), increasing

    def weights_at(self, tokens: int) -> tuple[float, ...]:
        """The mixture weights after `tokens` training tokens."""
        points = self.schedule
        if not points or tokens < points[0][0]:
            return self.weights
        i = bisect_right([t for t, _ in points], tokens) - 1
        if i == len(points) - 1:
            return points[-1][1]
        (t0, w0), (t1, w1) = points[i], points[i + 1]
        f = (tokens - t0) / (t1 - t0)
        return tuple(a + f * (b - a) for a, b in zip(w0, w1, strict=True))


def _normalised(table: dict[str, float], names: list[str], where: str, problems: list[str]) -> tuple[float, ...]:
    missing = [n for n in names if n not in table]
    unknown = [n for n in table if n not in names]
    problems += [f"{where}: no weight for source {n!r}" for n in missing]
    problems += [f"{where}: {n!r} is not one of the sources ({', '.join(names)})" for n in unknown]
    problems += [f"{where}: the weight of {n!r} must be ≥ 0, got {w}" for n, w in table.items() if w < 0]
    total = sum(max(0.0, table.get(n, 0.0)) for n in names)
    if not missing and not unknown and total <= 0:
        problems.append(f"{where}: the weights must not all be zero")
    return tuple(max(0.0, table.get(n, 0.0)) / total for n in names) if total > 0 else ()


def _schedule_point(text: str, names: list[str], problems: list[str]) -> tuple[int, tuple[float, ...]] | None:
    where = f"data.schedule entry {text!r}"
    head, *pairs = text.split()
    try:
        tokens = int(float(head.replace("_", "")))
    except ValueError:
        problems.append(f"{where}: expected 'TOKENS NAME=WEIGHT ...', and {head!r} is not a token count")
        return None
    table = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        try:
            table[key] = float(value)
        except ValueError:
            eq = ""
        if not eq:
            problems.append(f"{where}: {pair!r} is not NAME=WEIGHT")
            return None
    if tokens < 0:
        problems.append(f"{where}: the token count must be ≥ 0")
    weights = _normalised(table, names, where, problems)
    return (tokens, weights) if weights else None


def parse_mixture(sources: list[str], weights: dict[str, float],
                  schedule: list[str]) -> tuple[MixtureSpec | None, list[str]]:
    """(the mixture, problems); (None, []) when no sources are given (a single dataset)."""
    problems: list[str] = []
    if not sources:
        if weights or schedule:
            problems.append("data.weights and data.schedule need data.sources (NAME=PREPARED_DIR entries)")
        return None, problems
    names, paths = [], []
    for entry in sources:
        name, eq, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not eq or not name or not path:
            problems.append(f"data.sources entry {entry!r}: expected NAME=PREPARED_DIR")
        elif not NAME.match(name):
            problems.append(f"data.sources entry {entry!r}: a name is letters, digits, '_', '-' or '.'")
        elif name in names:
            problems.append(f"data.sources: the name {name!r} is used twice")
        else:
            names.append(name)
            paths.append(path)
    if problems:
        return None, problems
    table = weights if weights else {n: 1.0 for n in names}  # no weights: equal shares
    base = _normalised(table, names, "data.weights", problems)
    points = [p for p in (_schedule_point(text, names, problems) for text in schedule if text.strip()) if p]
    if any(b[0] <= a[0] for a, b in zip(points, points[1:], strict=False)):
        problems.append("data.schedule: the token counts must increase from one point to the next")
    if problems:
        return None, problems
    return MixtureSpec(tuple(names), tuple(paths), base, tuple(points)), []
