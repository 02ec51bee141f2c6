"""Model families by name and class: how to build one, and its parallel plan."""

from __future__ import annotations

from torch import nn

from ultratron.models.llama.model import Llama
from ultratron.models.llama.parallel_plan import PLAN as LLAMA_PLAN
from ultratron.models.llama.parallel_plan import LlamaStage
from ultratron.models.plan import ParallelPlan

PLANS: dict[type, ParallelPlan] = {Llama: LLAMA_PLAN, LlamaStage: LLAMA_PLAN}


def plan_of(model: nn.Module) -> ParallelPlan:
    """The parallel plan of a (not yet wrapped) model, by its family."""
    for cls, plan in PLANS.items():
        if isinstance(model, cls):
            return plan
    raise TypeError(f"no parallel plan for {type(model).__name__}: add one beside the model "
                    "(models/FAMILY/parallel_plan.py) and list it in models/registry.py")
