"""LoRA's parameters, for the planner (no torch): per block, r · (in + out) for each adapted linear
layer (`models/lora.py` adds A: r × in and B: out × r). The trainer's count of its adapted model
is checked against this formula (tests/planning/test_lora_memory.py).

Under tensor parallelism the adapters are split as their layer (`parallel/tensor.py`): a
column-parallel layer (q, k, v, gate, up) splits B over the tp ranks and keeps A whole on each, a
row-parallel one (o, down) splits A and keeps B whole."""

from __future__ import annotations

from ultratron.planning.rules import head_dim_of

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ROW_PARALLEL = ("o", "down")  # their input features split over tp; the other targets' outputs


def adapter_params_per_layer(shape, rank: int, targets, tp: int = 1) -> int:
    """Adapter parameters of one dense block for `targets` (names of TARGETS) at `rank`, on one of
    `tp` tensor-parallel ranks (which divides the heads and the FFN width: `planning.rules`)."""
    dim, hd = shape.dim, head_dim_of(shape)
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    sizes = {"q": (dim, q), "k": (dim, kv), "v": (dim, kv), "o": (q, dim),
             "gate": (dim, shape.ffn_dim), "up": (dim, shape.ffn_dim), "down": (shape.ffn_dim, dim)}
    unknown = [t for t in targets if t not in sizes]
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; known: {', '.join(TARGETS)}")
    split = {t: (tp, 1) if t in ROW_PARALLEL else (1, tp) for t in targets}  # (in, out) split over tp
    return sum(rank * (sizes[t][0] // split[t][0] + sizes[t][1] // split[t][1]) for t in targets)


def adapter_params(shape, rank: int, targets) -> int:
    """Adapter parameters of the whole model."""
    return shape.n_layers * adapter_params_per_layer(shape, rank, targets)
