"""How fast a rank computes a layout's step: the efficiency (fraction of the dense peak) of its own
matmul and attention shapes. The FLOPs stay the model family's (`planning/flops.py`); the shapes
only say how fast those FLOPs run.

Matmuls. Each of a layer's per-rank products (tokens M of a micro-batch × K in × N out; tp splits
N of the column-parallel ones and K of the row-parallel ones) takes

    max(2·M·K·N / (MATMUL_EFFICIENCY · peak), 2·(M·K + K·N + M·N) bytes / HBM bandwidth) + MATMUL_OVERHEAD_S

in forward and twice that in backward (the input and the weight gradient: the same FLOPs, the same
operands). Measured on one H200 (bf16; `benchmarks/matmul_shapes.py`, 2026-12-04), the data in
docs/planning.md:
  - products alone, 294 shapes (M 256–16,384, K and N 256–16,384): the best ran at 742 TFLOP/s, 0.75
    of the 989 TFLOP/s dense peak; `max(flops / (0.70 · peak), bytes / HBM) + 30 µs` fits them all
    with an RMS error of 10 % (log). The memory term is what makes thin per-rank products (tp 8 and
    more, a micro-batch of a few hundred tokens) run far below the peak. Its 30 µs per product is a
    host synchronisation per timed product, which a training step, queuing products back to back,
    does not pay: 5 µs (a kernel launch) is kept.
  - whole models forward + backward (`--models`: ultratron's Llama, 8B at seq 8192 and at 4 × 2048,
    and one tp=8 rank of the 70B and of the 8B, emulated by their per-rank shapes): inside a model
    the same products run slower than alone, and the one constant 0.645 (the geometric-mean fit over
    these five runs, not per layout) predicts their tokens/s at 1.20, 1.16, 0.93, 0.89 and 0.92 × the
    measured. The whole 8B's 0.575 of peak stays over-predicted by a fifth (its large products run
    slower inside the model than alone; not explained yet).

Attention. Fused causal attention (PyTorch's `scaled_dot_product_attention`, forward + backward,
32 heads of 128) measured on the same H200, as the rate of the *model* FLOPs the planner counts
(12·s·h per token, the whole s×s square, though a causal kernel computes half of it) over the
dense peak, by the sequence a rank attends over (s/cp): `ATTENTION_EFFICIENCY`, interpolated in
log s. Short sequences run far below peak; long ones above 0.9. A profile that timed the model's own
attention (`ultratron bench comm`: `attention_flops`) gives its rate instead.
"""

from __future__ import annotations

import math

from ultratron.planning.experts import is_moe, moe_layer_share
from ultratron.planning.rules import expert_ffn_dim_of, field_of, head_dim_of

MATMUL_EFFICIENCY = 0.645
MATMUL_OVERHEAD_S = 5e-6
# (sequence a rank attends over, model-FLOP rate / dense peak): benchmarks/matmul_shapes.py on H200
ATTENTION_EFFICIENCY = ((512, 0.023), (1024, 0.192), (2048, 0.425), (4096, 0.631), (8192, 0.908),
                        (16384, 0.954), (32768, 0.999))


def attention_efficiency(seq: float) -> float:
    """The measured attention efficiency at a sequence length, interpolated in log s (clamped)."""
    points = ATTENTION_EFFICIENCY
    if seq <= points[0][0]:
        return points[0][1]
    for (s0, e0), (s1, e1) in zip(points, points[1:], strict=False):
        if seq <= s1:
            return e0 + (e1 - e0) * math.log(seq / s0) / math.log(s1 / s0)
    return points[-1][1]


def matmul_seconds(m: float, k: float, n: float, peak: float, hbm: float, p: int,
                   efficiency: float = MATMUL_EFFICIENCY) -> float:
    """One (m × k) @ (k × n) product's time (module docstring); `p` bytes per element."""
    return max(2 * m * k * n / (efficiency * peak), p * (m * k + k * n + m * n) / hbm) + MATMUL_OVERHEAD_S


def layer_matmuls(shape, tokens: float, tp: int, ep: int = 1) -> list[tuple[float, float, float, float]]:
    """(M, K, N, how many) of one average layer's forward products on a rank, for `tokens` tokens."""
    h, hd = shape.dim, head_dim_of(shape)
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    out = [(tokens, h, (q + 2 * kv) / tp, 1), (tokens, q / tp, h, 1)]  # qkv, output projection
    moe = moe_layer_share(shape) if is_moe(shape) else 0.0
    if moe < 1:
        f = shape.ffn_dim / tp
        out += [(tokens, h, 2 * f, 1 - moe), (tokens, f, h, 1 - moe)]  # gate+up, down (SwiGLU)
    if moe:
        experts, k = shape.n_experts, field_of(shape, "n_active_experts")
        fe = expert_ffn_dim_of(shape) / tp
        local = experts / ep  # the experts on this rank, each getting its share of ep ranks' routed slots
        per_expert = tokens * k * ep / experts
        out += [(per_expert, h, 2 * fe, local * moe), (per_expert, fe, h, local * moe)]
        shared = field_of(shape, "n_shared_experts")
        if shared:
            out += [(tokens, h, 2 * fe * shared, moe), (tokens, fe * shared, h, moe)]
    return out


def compute_efficiency(shape, layout, peak: float, hbm: float, efficiency: float = MATMUL_EFFICIENCY,
                       attention_table: bool = True, bf16_peak: float | None = None,
                       attention_flops: float = 0.0) -> float:
    """The fraction of the dense peak a rank's training compute of this layout runs at: FLOPs of
    its matmuls and attention over their modelled time (module docstring), for one micro-batch.
    `attention_table` False: attention at the large-matmul rate (a device the table is not from);
    `attention_flops`: attention at this measured rate instead (`ultratron bench comm`'s profile).
    Under fp8 `peak` is the fp8 one, which the blocks' matmuls run at (`parallel/float8.py`), while
    the head and attention stay bf16 and run at `bf16_peak`."""
    tokens = layout.micro_batch_size * layout.seq_len / layout.cp
    p = layout.compute_bytes
    other_peak = bf16_peak if layout.precision == "fp8" and bf16_peak else peak
    flops = seconds = 0.0
    products = [(m, k, n, c * shape.n_layers, peak)
                for m, k, n, c in layer_matmuls(shape, tokens, layout.tp, layout.ep)]
    products.append((tokens, shape.dim, shape.vocab_size / layout.tp, 1, other_peak))  # the head
    for m, k, n, count, rate_peak in products:
        flops += 3 * 2 * m * k * n * count
        seconds += 3 * matmul_seconds(m, k, n, rate_peak, hbm, p, efficiency) * count
    # attention: 12·s·h per token per layer (as flops.py counts it), split over tp's heads
    attention = 12 * shape.n_layers * shape.n_heads * head_dim_of(shape) * layout.seq_len * tokens / layout.tp
    flops += attention
    rate = attention_efficiency(layout.seq_len / layout.cp) / MATMUL_EFFICIENCY if attention_table else 1.0
    seconds += attention / attention_flops if attention_flops else attention / (rate * efficiency * other_peak)
    return flops / seconds / peak


# Elementwise work: the passes over memory that are not matmuls or attention. Counted per token and
# layer, in elements of the compute dtype, for PyTorch's eager kernels (each reads its inputs and
# writes its output once):
#   2 RMSNorms        read x, write y                     2 × 2·h'
#   2 residual adds   read two, write one                 2 × 3·h'
#   rotary on q and k read, write                         2·(q + kv)/t
#   SwiGLU            silu(gate): read f, write f; × up: read 2f, write f   5·f/t
# (h' = h/t under sequence parallelism, else h; a mixture of experts' layers run k routed slots of
# the expert width and the shared experts in place of f). Backward reads the saved inputs and the
# incoming gradient and writes the input gradients: twice the forward's traffic; full recompute runs
# the forward's again, selective its norms and SwiGLU. The loss on the rank holding the head: 6
# passes over the V/t fp32 logits per token (the upcast written, log-softmax read and written, its
# backward read and written, the gradient cast back). The optimizer step reads every byte of the
# rank's model states and writes all but the gradients (AdamW: master, two moments, the compute
# copy); each micro-batch after the first reads and writes the accumulated gradients.
#
# Each kind of work — "layer" (a block's, the list above), "loss", "optimizer" — takes
#     calls × latency + bytes / bandwidth
# with the kind's rate from `ultratron bench comm`'s profile where it measured one (the model's own
# block, its ends and its optimizer step timed on one rank, less the matmuls and attention the
# compute term prices: `planning.profile.fit_kernels`), else no latency at the memory bandwidth (a
# GPU's HBM datasheet figure). A call is one layer's forward + backward (recompute repeats the share
# of it that it runs again), one micro-batch's loss, one optimizer step.
LOSS_PASSES = 6
KERNEL_KINDS = ("layer", "loss", "optimizer")


def layer_elementwise_elements(shape, layout) -> dict[str, float]:
    """Elements one token moves through the forward's elementwise kernels of one average layer, by kind."""
    t = layout.tp
    h = shape.dim / t if layout.sp and t > 1 else shape.dim
    hd = head_dim_of(shape)
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    moe = moe_layer_share(shape) if is_moe(shape) else 0.0
    f = (1 - moe) * shape.ffn_dim
    if moe:
        f += moe * expert_ffn_dim_of(shape) * (field_of(shape, "n_active_experts")
                                               + (field_of(shape, "n_shared_experts") or 0))
    return {"norms": 4 * h, "residual": 6 * h, "rotary": 2 * (q + kv) / t, "swiglu": 5 * f / t}


def elementwise_parts(shape, layout, memory) -> dict[str, tuple[float, float]]:
    """{kind: (bytes, calls)} on the rank whose memory breakdown is `memory` (its layers, its head,
    its model states): "layer" and (on the rank holding the head) "loss" for one micro-batch,
    "optimizer" for the step. See the comment above."""
    per_layer = layer_elementwise_elements(shape, layout)
    forward = sum(per_layer.values())
    again = {"none": 0.0, "selective": per_layer["norms"] + per_layer["swiglu"], "full": forward}[layout.recompute]
    tokens = layout.micro_batch_size * layout.seq_len / layout.cp
    layers = memory.extra.get("layers_on_stage", shape.n_layers)
    parts = {"layer": (tokens * layers * (3 * forward + again) * layout.compute_bytes,
                       layers * (1 + again / (3 * forward)))}
    if memory.loss_logits:  # the rank holds the head
        parts["loss"] = (tokens * LOSS_PASSES * 4 * shape.vocab_size / layout.tp, 1.0)
    parts["optimizer"] = (2 * memory.static_bytes - memory.gradients + 2 * (layout.grad_accum - 1) * memory.gradients,
                          1.0)
    return parts


def elementwise_bytes(shape, layout, memory) -> tuple[float, float]:
    """(bytes of one micro-batch's elementwise work, bytes of the optimizer step): `elementwise_parts`'."""
    parts = elementwise_parts(shape, layout, memory)
    return parts["layer"][0] + parts.get("loss", (0.0, 0))[0], parts["optimizer"][0]


def kernel_seconds(parts: dict[str, tuple[float, float]], kinds, memory_bw: float,
                   kernels: dict[str, tuple[float, float]]) -> float:
    """Seconds of the `kinds` of `parts` ({kind: (bytes, calls)}): calls × latency + bytes / bandwidth
    at `kernels`' measured (bandwidth, latency) of the kind, else no latency at `memory_bw`."""
    seconds = 0.0
    for kind in kinds:
        if kind in parts:
            nbytes, calls = parts[kind]
            bandwidth, latency = kernels.get(kind, (memory_bw, 0.0))
            seconds += calls * latency + nbytes / bandwidth
    return seconds
