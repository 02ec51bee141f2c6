"""What a rank holds from `meta` to its first step: the terms `planning.memory` prices as
`MemoryBreakdown.start_*`.

Start (`MemoryBreakdown.start_*`): from `meta` to the first step a rank never holds the whole model.
The trainer builds it on the `meta` device, applies every axis, then materializes only the rank's
own shards (`to_empty`) and initializes or loads them. Until the first step it holds
  its shards (`start_shards`): its parameters at rest in fp32 as the static `parameters` term counts
  them — after tp, pp and ep, then 4/N under FSDP2 (ZeRO-2 and 3, and wherever dp meets tp, pp or ep),
  4 whole under DDP (ZeRO-0 and 1), FSDP2's replicate and one process (ZeRO-2's gathered copy exists
  only from the first forward); split experts whole; under LoRA the frozen base's shards and the
  adapters'; `fp32_grad_accum` its bf16 weights and master weights —
  and its buffers (`start_buffers`): the rope tables, cos and sin of max_seq_len × head_dim/2 in fp32
  on every rank (a few MiB; the router's bias, E floats, is left out);
and one of two transients:
  initialization (`start_init_transient`): a parameter is drawn in blocks of whole rows
  (`models/init_blocks.py`, at most INIT_BLOCK_ELEMENTS = 4 Mi elements, 16 MiB in fp32), and at most
  two blocks are alive beside the shards, the drawn one and the copy of its rows the shard takes:
  2 × 4 bytes × the largest block of the tensors the rank holds a part of;
  a load from a checkpoint (`start_load_transient`): torch.distributed.checkpoint's reader reads
  each stored chunk the shard overlaps whole, then narrows it, so the transient is the largest
  stored chunk the rank reads, in fp32. A checkpoint saved by one process stores each tensor as one
  chunk, so it is priced as the largest whole tensor the rank holds a part of (`stored_chunk_elements`
  says so in one place). A resume also loads the optimizer's state, which the step's static terms
  count.
Optimizer state and gradients come at the first step (the step's peak counts them). A layout fits
when the larger of the step's peak and the start's (`fit_bytes`) does.
"""

from __future__ import annotations

from math import prod

from ultratron.planning.experts import is_moe
from ultratron.planning.layout import Layout
from ultratron.planning.rules import expert_ffn_dim_of, field_of, head_dim_of


def layer_tensor_shapes(shape, moe: bool) -> list[tuple[int, ...]]:
    """The shapes of one block's parameters, whole (as the model defines them, before any sharding):
    a dense block's or (`moe`) a mixture-of-experts block's."""
    h, hd = shape.dim, head_dim_of(shape)
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    out = [(q, h), (kv, h), (kv, h), (h, q), (h,), (h,)]  # wq, wk, wv, wo; attention_norm, ffn_norm
    out += [(hd,), (hd,)] if field_of(shape, "qk_norm", False) else []
    out += [(q,), (kv,), (kv,)] if field_of(shape, "qkv_bias", False) else []
    if not moe:
        return out + [(shape.ffn_dim, h), (shape.ffn_dim, h), (h, shape.ffn_dim)]  # w1, w3, w2
    e, f = shape.n_experts, expert_ffn_dim_of(shape)
    out += [(e, h), (e, f, h), (e, f, h), (e, h, f)]  # router gate; grouped experts w1, w3, w2
    shared = field_of(shape, "n_shared_experts") * f
    return out + ([(shared, h), (shared, h), (h, shared)] if shared else [])


def layer_kinds(shape, where) -> list[bool]:
    """Which kinds of block a pipeline rank holds, as `layer_tensor_shapes`'s `moe`: dense (False),
    mixture-of-experts (True), or both (a mixture's dense first layers)."""
    moe_layers = sum(where.layers) - where.dense_layers if is_moe(shape) else 0
    return ([False] if sum(where.layers) > moe_layers else []) + ([True] if moe_layers else [])


def held_tensor_shapes(shape, where) -> list[tuple[int, ...]]:
    """The whole shapes of the parameters a pipeline rank holds a part of (each kind once): its blocks'
    (dense, mixture-of-experts or both), the embedding on the first stage, the output head (its own
    copy when tied under pp, the same shape) and the final norm on the last."""
    out = [s for moe in layer_kinds(shape, where) for s in layer_tensor_shapes(shape, moe)]
    if where.first or where.last:
        out.append((shape.vocab_size, shape.dim))
    if where.last:
        out.append((shape.dim,))
    return out


def stored_chunk_elements(tensor_shape) -> int:
    """Elements of the largest chunk a checkpoint stores a tensor of this (whole) shape in — what
    torch.distributed.checkpoint's reader reads whole before narrowing it to the shard. Priced at the
    worst case, the whole tensor: a checkpoint saved by one process stores each tensor as one chunk
    (a sharded save or an import that writes row blocks stores smaller ones)."""
    return prod(tensor_shape)


def rope_table_bytes(shape, layout: Layout) -> float:
    """The rope tables every rank holds: cos and sin, max_seq_len × head_dim/2 each, fp32."""
    max_seq = field_of(shape, "max_seq_len") or layout.seq_len
    return 2 * max_seq * (head_dim_of(shape) // 2) * 4
