"""Each model family's planning spec (parameter count, FLOPs per token), without torch: the planner and
the config import this, never `models/registry.py`. A family lists its `models/FAMILY/spec.py` here
as well as its `Family` in the registry."""

from __future__ import annotations

from ultratron.models.family import PlanningSpec
from ultratron.models.llama.spec import SPEC as LLAMA_SPEC

DEFAULT = "llama"
SPECS: dict[str, PlanningSpec] = {"llama": LLAMA_SPEC}


def family_name(name: str | None) -> str:
    return name or DEFAULT


def spec_of(cfg) -> PlanningSpec:
    """The planning spec of anything with the model fields (a preset's ModelShape, a ModelConfig), by its
    `family` (absent or None: llama)."""
    name = family_name(getattr(cfg, "family", None))
    if name not in SPECS:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(SPECS)}")
    return SPECS[name]
