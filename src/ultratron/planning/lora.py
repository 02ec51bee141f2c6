"""LoRA's parameters, for the planner (no torch): per block, r · (in + out) for each adapted linear
layer (`models/lora.py` adds A: r × in and B: out × r). The trainer's count of its adapted model
is checked against this formula (tests/test_lora.py)."""

from __future__ import annotations

from ultratron.planning.rules import head_dim_of

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def adapter_params_per_layer(shape, rank: int, targets) -> int:
    """Adapter parameters of one dense block for `targets` (names of TARGETS) at `rank`."""
    dim, hd = shape.dim, head_dim_of(shape)
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    sizes = {"q": (dim, q), "k": (dim, kv), "v": (dim, kv), "o": (q, dim),
             "gate": (dim, shape.ffn_dim), "up": (dim, shape.ffn_dim), "down": (shape.ffn_dim, dim)}
    unknown = [t for t in targets if t not in sizes]
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; known: {', '.join(TARGETS)}")
    return sum(rank * (sizes[t][0] + sizes[t][1]) for t in targets)


def adapter_params(shape, rank: int, targets) -> int:
    """Adapter parameters of the whole model."""
    return shape.n_layers * adapter_params_per_layer(shape, rank, targets)
