"""What `ultratron.parallel` needs to know about a model family.

Each family puts its `ParallelPlan` beside its model code (e.g. `models/llama/parallel_plan.py`)
and lists it in `models/registry.py`; the parallel axes ask `registry.plan_of(model)` and never
name a model's layers themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParallelPlan:
    blocks: Callable[[nn.Module], nn.ModuleDict]  # the repeated blocks (FSDP units, recompute, stages)
    # sequence parallel? → (root plan, block → that block's plan), for DTensor's parallelize_module
    tensor_parallel: Callable[[bool], tuple[dict, Callable[[nn.Module], dict]]]
    tie_weights: Callable[[nn.Module], None]  # restore tied parameters after TP replaced them
    # (model or pipeline part, block names, holds the first stage?, holds the last?) → a module with
    # those blocks (plus the embedding / the head) under the full model's parameter names; its
    # `tied_copies` maps a tied parameter's copy to the original, `sequence_shards` is set to how
    # many ranks sequence parallel splits the activations between stages over
    pipeline_stage: Callable[[nn.Module, list[str], bool, bool], nn.Module]
    # (model, attention function) → every block's attention calls it: (q, k, v, mask, kv groups) → output,
    # each (batch, heads, seq, head_dim) — context parallelism installs its own
    set_attention: Callable[[nn.Module, Callable], None]
    # the family's own attention function, of that signature (what context parallelism falls back to)
    attention: Callable
    # the mixture-of-experts layers (`models.moe.MoE`: router, 3-D expert weights, a swappable dispatch)
    moe_layers: Callable[[nn.Module], list[nn.Module]]
    # LoRA's target names (--lora.targets: q, k, v, o, gate, up, down) → the suffix of each block's
    # linear layer they name
    lora_targets: dict[str, str] = None

