"""The one place the rest of ultratron asks about a model: build one from a model config, the args of a
built one (through any wrapper), its parallel plan, the Hugging Face adapter of an architecture, the
planning spec. No code outside `models/` names a family's modules.

A family is one folder, `models/FAMILY/`: `model.py` (plain PyTorch), `parallel_plan.py` (how the
parallel axes cut it), `hf_adapter.py` (config and tensor names to and from Hugging Face's format),
`spec.py` (torch-free planning formulas, listed in `models/specs.py` for the planner); one
`Family` entry below ties them together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ultratron.models import specs
from ultratron.models.family import HFAdapter, PlanningSpec
from ultratron.models.llama import hf_adapter as llama_hf
from ultratron.models.llama import model as llama
from ultratron.models.llama import parallel_plan as llama_plan
from ultratron.models.plan import ParallelPlan


@dataclass(frozen=True)
class Family:
    name: str
    classes: tuple[type, ...]  # its modules that hold args: the whole model and what a pipeline stage runs
    build: Callable  # (resolved ModelConfig, device) → the model
    args: Callable[[nn.Module], object]  # a (plain) model → its args (shape and options)
    plan: ParallelPlan
    hf: HFAdapter
    spec: PlanningSpec
    init_rule: Callable  # (parameter name in the whole model, its shape, args) → how initialization draws it
    init_buffers: Callable[[nn.Module], None]  # a materialized model's (or stage's) buffers made again


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", (llama.Llama, llama_plan.LlamaStage), llama.build_model, lambda model: model.args,
                    llama_plan.PLAN, llama_hf.ADAPTER, specs.SPECS["llama"],
                    llama.init_rule, llama.init_buffers),
}


def family(name: str | None) -> Family:
    """A family by name (a ModelConfig's `family`; None: llama, the default)."""
    key = specs.family_name(name)
    if key not in FAMILIES:
        raise ValueError(f"unknown model family {key!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[key]


def unwrap(model):
    """The plain model inside DDP (`module`) and torch.compile (`_orig_mod`) wrappers. (FSDP2 and the
    tensor-parallel plans keep the model's own class.)"""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


# Prefixes that wrappers leave in parameter names (activation checkpointing, torch.compile, DDP); the
# checkpoint wrapper's first, since it ends with DDP's
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def plain_name(name: str) -> str:
    """A parameter's name as the plain model knows it, without wrapper prefixes."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def family_of(model) -> Family | None:
    inner = unwrap(model)
    return next((fam for fam in FAMILIES.values() if isinstance(inner, fam.classes)), None)


def build_model(model_cfg, device="cpu") -> nn.Module:
    """The model a (resolved) ModelConfig describes, by its family. `device="meta"`: shapes, no memory."""
    return family(getattr(model_cfg, "family", None)).build(model_cfg, device)


def materialize(model: nn.Module, device: torch.device | str, also: list[nn.Module] = ()) -> None:
    """Storage on `device` for every parameter and buffer of `model` (each parameter's local shard)
    and for the buffers of `also` (modules that share the model's parameters, e.g. pipeline stages);
    the buffers are made again by the model's family. The parameters hold no values yet."""
    def empty(tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) in (torch.Tensor, nn.Parameter):  # from its shape: no fake copy of the meta tensor
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
        return torch.empty_like(tensor, device=device)  # a DTensor: storage for its local shard

    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # a parameter → every module attribute holding it
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    model._apply(empty)
    for module in also:
        module._apply(empty, recurse=False)
    for (first, first_name), *others in holders.values():  # a tied weight stays one tensor
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    family = family_of(model)
    for module in (model, *also):
        (family_of(module) or family).init_buffers(module)


def build_empty(model_cfg, device="cpu") -> nn.Module:
    """The model a ModelConfig describes with storage on `device` but no values: built on the meta
    device and materialized, for a checkpoint load that fills every parameter (one process)."""
    model = build_model(model_cfg, "meta")
    materialize(model, device)
    return model


def model_args(model):
    """The args (shape and options: max_seq_len, vocab_size, n_kv_heads, head_dim, ...) of a built model,
    through DDP and torch.compile. A stand-in that is no module (the pipeline's sampling model) carries
    its model's as `args`."""
    fam = family_of(model)
    if fam is not None:
        return fam.args(unwrap(model))
    if hasattr(model, "args") and not isinstance(model, nn.Module):
        return model.args
    raise TypeError(f"{type(unwrap(model)).__name__} is no model of a family in models/registry.py")


def plan_of(model: nn.Module) -> ParallelPlan:
    """The parallel plan of a model, by its family."""
    fam = family_of(model)
    if fam is None:
        raise TypeError(f"no parallel plan for {type(model).__name__}: add one beside the model "
                        "(models/FAMILY/parallel_plan.py) and list it in models/registry.py")
    return fam.plan


def hf_adapter_of(model) -> HFAdapter:
    """How a built model maps onto Hugging Face's format (for export)."""
    fam = family_of(model)
    if fam is None:
        raise TypeError(f"{type(unwrap(model)).__name__} is no model of a family in models/registry.py")
    return fam.hf


def hf_family(model_type: str | None) -> Family | None:
    """The family whose adapter holds (or knowingly refuses) a Hugging Face config.json's `model_type`;
    None when no family knows it."""
    return next((fam for fam in FAMILIES.values()
                 if model_type in fam.hf.architectures or model_type in fam.hf.refused), None)


def hf_architectures() -> dict[str, str]:
    """Every Hugging Face model_type some family can import → its transformers class."""
    return {kind: cls for fam in FAMILIES.values() for kind, cls in fam.hf.architectures.items()}
