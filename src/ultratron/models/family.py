"""What a model family hands the rest of ultratron besides its model and parallel plan: how it maps onto
Hugging Face's format (`HFAdapter`, in models/FAMILY/hf_adapter.py) and its planning formulas
(`PlanningSpec`, in models/FAMILY/spec.py). Plain data and callables, no torch, so the torch-free
planner can hold a `PlanningSpec`; `models/registry.py` (torch) and `models/specs.py` (no torch) list
each family's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HFTensors:
    """One of our tensors and the Hugging Face tensors it is made of, both ways: `to_hf` turns ours
    into theirs (in the order of `hf`), `from_hf` theirs into ours. `hf` is empty for a tensor of
    ours Hugging Face does not hold (made by `from_hf([])`, never exported)."""

    hf: tuple[str, ...]
    to_hf: Callable  # tensor → list of tensors
    from_hf: Callable  # list of tensors → tensor


@dataclass(frozen=True)
class HFAdapter:
    """A family's map onto Hugging Face's format, both ways. The I/O around it (safetensors,
    tokenizer files, the streaming import) lives in `ultratron.checkpoint.hf` and `hf_import`."""

    # model_type in config.json → the transformers class, for every architecture the family can hold
    architectures: dict[str, str]
    # config.json (and an optional context limit) → (our ModelConfig fields, every reason it does not map)
    config_from_hf: Callable[[dict, int | None], tuple[dict, list[str]]]
    # the model's args → config.json's model fields (architecture, shape, routing)
    hf_config: Callable[[object], dict]
    # (the model's args, its state dict) → every reason Hugging Face's classes cannot hold it
    export_problems: Callable[[object, dict], list[str]]
    # the model's args → our tensor name → HFTensors (every tensor of our state dict)
    weight_map: Callable[[object], dict[str, HFTensors]]
    # the args of a model built from a (possibly unresolved) ModelConfig
    args_from_config: Callable[[object], object]
    # model_type of a class that looks like the family's but that it cannot hold → why (one line)
    refused: dict[str, str] = field(default_factory=dict)
    # HF tensors a checkpoint may hold that the family recomputes or ties (ignored on import)
    ignored: Callable[[object], set[str]] = lambda args: set()


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters by part, as a family's `PlanningSpec.count_params` counts them."""

    embedding: int
    output: int  # 0 when tied to the embedding
    per_layer: int  # a dense layer (attention, SwiGLU, norms)
    n_layers: int  # every layer, dense and mixture-of-experts
    final_norm: int
    moe_layer: int = 0  # a mixture-of-experts layer: attention, norms, router, routed and shared experts
    routed_experts: int = 0  # of which the routed experts (what expert parallelism shards)
    active_experts: int = 0  # of which one token's k routed experts
    n_moe_layers: int = 0

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    @property
    def layers(self) -> int:
        return self.per_layer * self.n_dense_layers + self.moe_layer * self.n_moe_layers

    @property
    def active_layers(self) -> int:
        """Layer parameters one token computes with (the k routed experts of each MoE layer)."""
        return self.layers - (self.routed_experts - self.active_experts) * self.n_moe_layers

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.layers + self.final_norm

    @property
    def active(self) -> int:
        return self.total - self.layers + self.active_layers

    @property
    def mean_layer(self) -> float:
        """Parameters of the average layer (a stage's share when dense and MoE layers mix)."""
        return self.layers / self.n_layers


@dataclass(frozen=True)
class PlanningSpec:
    """A family's planning formulas, torch-free, on anything with its model fields (a preset's
    ModelShape or a resolved ModelConfig)."""

    count_params: Callable[[object], ParamCounts]  # model fields → its parameters by part
    # (model fields, sequence length) → model FLOPs per trained token (forward + backward, no recompute)
    flops_per_token: Callable[[object, int], float]
    # (model fields, sequence length) → attention's share of flops_per_token (the planner's attention time)
    attention_flops_per_token: Callable[[object, int], float]
