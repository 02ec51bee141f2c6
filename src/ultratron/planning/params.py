"""Parameter counts of a model by its family's formula (`models/FAMILY/spec.py`, through
`models.specs`): what the model holds (total) and what one token uses (active), by part."""

from __future__ import annotations

from ultratron.models.family import ParamCounts
from ultratron.models.specs import spec_of

__all__ = ["ParamCounts", "count_params_of"]


def count_params_of(cfg) -> ParamCounts:
    """Counts for anything with the model fields (a ModelShape or a resolved ModelConfig)."""
    return spec_of(cfg).count_params(cfg)
