"""The rules a model shape and a parallel layout must obey, written once.

The trainer's config validation, `ParallelDims`, `plan memory` and `plan search` all ask these
functions, so a layout the planner proposes is one the trainer accepts. Torch-free.

Each problem names fields through `name`: the trainer passes config names (`parallel.tp`,
`model.n_heads`), the planner its flag names (`tp`, `n_heads`).
"""

from __future__ import annotations

from collections.abc import Callable

Namer = Callable[[str], str]


def config_name(field: str) -> str:
    """`parallel.tp` → `parallel.tp` (the trainer's config names)."""
    return field


def short_name(field: str) -> str:
    """`parallel.tp` → `tp` (the planner's names)."""
    return field.split(".", 1)[1]


def shape_problems(shape, name: Namer = config_name) -> list[str]:
    """Heads must divide the width, with an even head dimension; kv heads must divide heads."""
    p: list[str] = []
    if shape.dim % shape.n_heads:
        p.append(f"{name('model.n_heads')}={shape.n_heads} does not divide {name('model.dim')}={shape.dim}")
    elif (shape.dim // shape.n_heads) % 2:
        p.append(f"head dimension {shape.dim // shape.n_heads} ({name('model.dim')}/{name('model.n_heads')}) "
                 "must be even for rotary embeddings")
    if shape.n_heads % shape.n_kv_heads:
        p.append(f"{name('model.n_kv_heads')}={shape.n_kv_heads} does not divide "
                 f"{name('model.n_heads')}={shape.n_heads} (grouped-query attention shares each kv head "
                 "among n_heads/n_kv_heads query heads)")
    return p


def layout_problems(shape, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, seq: int | None = None,
                    name: Namer = config_name) -> list[str]:
    """What a layout needs of the model: tp divides heads, kv heads, FFN width and vocabulary
    (each rank keeps an equal slice of each); pp at most one stage per layer; cp divides the
    sequence; ep needs experts."""
    p: list[str] = []
    heads = ("n_heads", "n_kv_heads") if shape.n_heads % tp or shape.n_kv_heads % tp else ()
    undivided = [*heads, *(f for f in ("ffn_dim", "vocab_size") if getattr(shape, f) % tp)]
    if undivided:
        listed = [f"{name('model.' + f)}={getattr(shape, f)}" for f in undivided]
        joined = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " and " + listed[-1]
        p.append(f"{name('parallel.tp')}={tp} does not divide {joined}")
    if pp > shape.n_layers:
        p.append(f"{name('parallel.pp')}={pp} exceeds {name('model.n_layers')}={shape.n_layers}")
    if seq is not None and seq % cp:
        p.append(f"{name('parallel.cp')}={cp} does not divide the sequence length {seq}")
    if ep > 1 and getattr(shape, "n_experts", 0) <= 1:
        p.append(f"{name('parallel.ep')}={ep} needs a mixture-of-experts model; this model is dense "
                 f"(use {name('parallel.ep')}=1)")
    return p
