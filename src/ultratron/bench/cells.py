"""The cells of a sweep: which layouts, on which models, with which config.

A layout is written as space-separated assignments, short names for the layout fields
(`dp=2 tp=2 pp=1 zero=1 mbs=4 recompute=selective sp=true pp_schedule=zbv`, any layout field by its
name or `ultratron plan`'s shorter spelling) or any config field
in full (`training.precision=bf16`). A grid gives comma lists (`dp=1,2,4 tp=1,2`) and takes their
cartesian product; `--gpus N` keeps the cells with dp·tp·pp = N. The planner's top-K comes from
`planning.search` for the model, the GPU type and the batch of the base config.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, fields

from ultratron.errors import UserError
from ultratron.planning.layout import PARALLEL_FIELDS, STEP_FIELDS, Layout, section_of

# short name → the config field it sets: each layout field the config has, by its own name and by the
# shorter spellings of `ultratron plan` (mbs, virtual_stages, seq)
SHORT = {name: f"{section_of(name)}.{name}" for name in (*PARALLEL_FIELDS, *STEP_FIELDS)}
SHORT |= {flag[2:].replace("-", "_"): SHORT[f.name] for f in fields(Layout) if f.name in SHORT
          for flag in f.metadata["flags"]}
NAME_ORDER = ("dp", "tp", "pp", "zero", "sp", "mbs", "recompute", "pp_schedule", "virtual_stages", "precision")


@dataclass(frozen=True)
class Cell:
    """One run of the sweep: a model preset and the config assignments of its layout."""

    model: str
    assignments: tuple[tuple[str, str], ...]  # (config field, value), in the order given
    source: str = "explicit"  # explicit | grid | top-K rank
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def fields(self) -> dict[str, str]:
        return dict(self.assignments)

    def get(self, short: str, default: str = "") -> str:
        return self.fields.get(SHORT[short], default)

    @property
    def world(self) -> int:
        """Processes the cell runs on: dp·tp·pp·cp (expert parallelism reuses data-parallel ranks)."""
        degrees = [self.get(axis, "1") for axis in ("dp", "tp", "pp", "cp")]
        return math.prod(int(d) if d.isdigit() else 1 for d in degrees)  # (a bad value: the config says why)

    @property
    def name(self) -> str:
        short_of = {full: short for short, full in SHORT.items()}
        parts = [self.model]
        fields = self.fields
        for short in NAME_ORDER:
            if SHORT[short] in fields:
                parts.append(f"{short}{fields[SHORT[short]]}")
        parts += [f"{key.split('.')[-1]}-{value}" for key, value in self.assignments if key not in short_of]
        return re.sub(r"[^A-Za-z0-9_.=+-]", "-", "_".join(parts))

    @property
    def overrides(self) -> list[str]:
        """`ultratron train` flags for this cell's model and layout."""
        out = ["--model.preset", self.model]
        for key, value in self.assignments:
            out += [f"--{key}", value]
        return out

    def as_dict(self) -> dict:
        return {"name": self.name, "model": self.model, "assignments": [list(a) for a in self.assignments],
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> Cell:
        return cls(data["model"], tuple(tuple(a) for a in data["assignments"]), data.get("source", "explicit"))


def _assignments(text: str, where: str) -> list[tuple[str, list[str]]]:
    """`dp=1,2 tp=2 training.precision=bf16` → [(parallel.dp, [1, 2]), ...]; one problem per bad word."""
    out, problems = [], []
    for word in text.split():
        key, sep, value = word.partition("=")
        if not sep or not value:
            problems.append(f"{where}: {word!r} is not FIELD=VALUE (e.g. dp=2, or training.precision=bf16)")
            continue
        if key not in SHORT and "." not in key:
            problems.append(f"{where}: unknown layout field {key!r}; use {', '.join(SHORT)} or a config field "
                            "in full (section.field)")
            continue
        out.append((SHORT.get(key, key), [v for v in value.split(",") if v]))
    if problems:
        raise UserError(problems)
    return out


def layout_cells(models: list[str], layouts: list[str], grids: list[str], gpus: int | None) -> list[Cell]:
    """Cells from explicit layouts (each one cell) and grids (their cartesian product) × models."""
    cells: list[Cell] = []
    for i, text in enumerate(layouts):
        pairs = _assignments(text, f"--layout {i + 1}")
        multi = [key for key, values in pairs if len(values) != 1]
        if multi:
            raise UserError(f"--layout {text!r} gives several values for {', '.join(multi)}; use --grid for lists")
        cells += [Cell(m, tuple((k, v[0]) for k, v in pairs), "explicit") for m in models]
    if grids:
        pairs = [p for i, text in enumerate(grids) for p in _assignments(text, f"--grid {i + 1}")]
        keys = [key for key, _ in pairs]
        for combo in itertools.product(*(values for _, values in pairs)):
            for model in models:
                cell = Cell(model, tuple(zip(keys, combo, strict=True)), "grid")
                if gpus is None or cell.world == gpus:
                    cells.append(cell)
    return cells


def top_cells(models: list[str], base_cfg_of, accelerator, gpus: int, gpus_per_node: int, k: int) -> list[Cell]:
    """The planner's k fastest layouts for each model (`planning.search`, on the base config's batch)."""
    from ultratron.planning.search import SearchSpec, search

    cells = []
    for model in models:
        cfg = base_cfg_of(model)
        t = cfg.training
        spec = SearchSpec(cfg.model, accelerator, gpus, gpus_per_node, t.batch_tokens, t.seq_len, t.precision)
        result = search(spec, top=k)
        if not result.ranked:
            raise UserError([f"--top {k} for {model}: " + line for line in result.summary])
        for rank, est in enumerate(result.ranked, 1):
            lay = est.layout
            values = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "zero": lay.zero,
                      "sp": str(lay.sp).lower(), "mbs": lay.micro_batch_size, "recompute": lay.recompute}
            if lay.pp > 1:
                values |= {"pp_schedule": lay.pp_schedule, "virtual_stages": lay.stages_per_rank}
            cells.append(Cell(model, tuple((SHORT[k_], str(v)) for k_, v in values.items()), f"top-{rank}"))
    return cells


def unique(cells: list[Cell]) -> list[Cell]:
    seen, out = set(), []
    for cell in cells:
        if cell.name not in seen:
            seen.add(cell.name)
            out.append(cell)
    return out
