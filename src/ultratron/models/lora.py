"""LoRA (Hu et al. 2021): low-rank adapters trained on a frozen model, applied from outside it.

Each target linear layer y = W x gets two matrices, A (rank × in) and B (out × rank), and computes
y = W x + (alpha / rank) · B A x; B starts at zero, so the adapted model starts as the model, and A
as PyTorch initialises a linear layer's weight (Kaiming-uniform, as peft does). Everything else
is frozen (requires_grad False): the optimizer, which takes only trainable parameters, keeps no
state for it.

The adapters are parameters of the linear layer itself (`lora_a`, `lora_b`) added by a forward hook,
so the model's own parameter names, its checkpoints and its Hugging Face map stay as they are and
the adapters are the names ending in `.lora_a` / `.lora_b`. The family says which layers the
target names (q, k, v, o, gate, up, down) are (its `ParallelPlan.lora_targets`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ultratron.models.init import InitRule, fill

ADAPTERS = ("lora_a", "lora_b")  # the adapters' names on their linear layer
ADAPTER_SUFFIXES = tuple("." + name for name in ADAPTERS)
LORA_FILE = "lora.json"  # in a checkpoint of adapters: their shape and the checkpoint of the model under them


def _add_adapter(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    x = inputs[0]
    return output + (x @ module.lora_a.t().to(x.dtype)) @ (module.lora_b.t().to(x.dtype) * module.lora_scale)


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: list[str], layer_names: dict[str, str]) -> list[str]:
    """Adapters of `rank` on every block linear layer named by `targets` (through `layer_names`, the
    family's map); freezes every other parameter. Returns the adapted layers' names."""
    suffixes = tuple("." + layer_names[t] for t in targets)
    adapted = []
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) and name.endswith(suffixes)):
            continue
        weight = module.weight
        module.lora_a = nn.Parameter(torch.empty(rank, module.in_features, device=weight.device, dtype=weight.dtype))
        module.lora_b = nn.Parameter(torch.zeros(module.out_features, rank, device=weight.device, dtype=weight.dtype))
        if not weight.is_meta:  # as the materializer draws it (`parallel/materialize.py`) on a meta model
            fill(module.lora_a, adapter_init_rule(f"{name}.lora_a", module.lora_a.shape), f"{name}.lora_a",
                 module.lora_a.shape, seed=torch.initial_seed())
        module.lora_scale = alpha / rank
        module.register_forward_hook(_add_adapter)
        adapted.append(name)
    if not adapted:
        raise ValueError(f"LoRA found no linear layer for targets {targets} in {type(model).__name__}")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return adapted


def adapter_init_rule(name: str, shape) -> InitRule:
    """How an adapter is drawn (`models/init.py`): A as `nn.init.kaiming_uniform_(a=√5)` draws a linear
    layer's weight, uniform within ±1/sqrt(in_features); B zero, so the adapted model starts as the model."""
    if name.endswith(".lora_b"):
        return InitRule.constant(0.0)
    return InitRule.uniform(1.0 / math.sqrt(shape[-1]))


def lora_reference(cfg) -> str:
    """lora.json: rank, alpha, targets and the base checkpoint (resolved) the adapters sit on."""
    import json
    from pathlib import Path

    base = str(Path(cfg.model.init_from).resolve()) if cfg.model.init_from else None
    return json.dumps({"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets),
                       "base": base}, indent=2) + "\n"


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_state(state: dict) -> dict:
    """The adapters of a model state dict."""
    return {k: v for k, v in state.items() if is_adapter(k)}


def merged_state(state: dict, scale: float) -> dict:
    """A state dict with each adapted weight replaced by W + scale · B A, the adapters dropped: the
    plain model that computes what the adapted one does."""
    out = {}
    for name, value in state.items():
        if is_adapter(name):
            continue
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{layer}.lora_a" in state:
            a, b = state[f"{layer}.lora_a"].float(), state[f"{layer}.lora_b"].float()
            value = (value.float() + scale * (b @ a)).to(value.dtype)
        out[name] = value
    return out


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters, each counted once (a tied weight once)."""
    seen, trainable, total = set(), 0, 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return trainable, total
