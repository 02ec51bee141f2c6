"""How fast a rank computes a layout's step: the efficiency (fraction of the dense peak) of its own
matmul and attention shapes. The FLOPs stay the model family's (`planning/flops.py`); the shapes
only say how fast those FLOPs run.

Matmuls. Each of a layer's per-rank products (tokens M of a micro-batch × K in × N out; tp splits
N of the column-parallel ones and K of the row-parallel ones) takes

    max(2·M·K·N / (MATMUL_EFFICIENCY · peak) + p·M·N / HBM, p·(M·K + K·N + M·N) / HBM) + MATMUL_OVERHEAD_S

in forward and twice that in backward (the input and the weight gradient: the same FLOPs, the same
operands), p bytes an element, HBM the bandwidth kernels reach (`Accelerator.hbm_bw`). The first
term is the main loop at a fraction of the peak and then the output written back, which the loop
does not hide: a product with a short K (the row-parallel ones under tp, a micro-batch of few
tokens) spends a larger share of its time storing its output. The second is a product that only
streams its operands. Measured on one H200 (bf16; `benchmarks/matmul_shapes.py`, 2026-12-04; the
data in `benchmarks/data/h200_matmul_shapes.json`, checked by `tests/planning/test_plan_h200_data.py`):
  - products alone, 294 shapes (M 256–16,384, K and N 256–16,384): the best ran at 742 TFLOP/s, 0.75
    of the 989 TFLOP/s dense peak. With 0.75 of the peak in the main loop and 30 µs a product the
    form above fits all 294 within 8.1 % RMS (log; 6.7 % over the 122 that ran longer than 80 µs,
    whose mean error by K stays within ±4.3 % from K = 256 to 16,384). Without the output term (the
    larger of the FLOP and byte times) the best fit, 0.70, leaves 10.4 % (11.7 % over the 122) and
    runs 35 % fast at K = 256, 18 % at K = 512. The 30 µs is a host synchronisation per timed
    product, which a training step, queuing products back to back, does not pay: 5 µs (a kernel
    launch) is kept.
  - whole models forward + backward (`--models`: ultratron's Llama, 8B at seq 8192 and at 4 × 2048,
    and one tp=8 rank of the 70B and of the 8B, emulated by their per-rank shapes): inside a model
    the same products run slower than alone. With each model's step priced as the planner prices it,
    products and attention plus the elementwise kernels (`elementwise_parts` at `hbm_bw`), the one
    constant 0.61 (the geometric-mean fit over these five runs, not per layout) predicts their
    tokens/s at 0.96, 0.92, 1.00, 1.02 and 1.13 × the measured, the products being the model's own
    linear layers (`layer_matmuls`: wq, wk, wv, wo, w1, w3, w2). (Before the output term and the
    0.92 of the datasheet bandwidth it was 0.575, the ratios 0.95, 0.90, 0.99, 1.03 and 1.17; before
    attention was counted over heads × head dim, 0.645.)

Attention. Fused causal attention (PyTorch's `scaled_dot_product_attention`, forward + backward,
32 heads of 128) measured on the same H200, as the rate of the *model* FLOPs the planner counts
(12·s·h per token, the whole s×s square, though a causal kernel computes half of it) over the
dense peak, by the sequence a rank attends over (s/cp): `ATTENTION_EFFICIENCY`, interpolated in
log s. Short sequences run far below peak; long ones above 0.9. A profile that timed the model's own
attention (`ultratron bench comm`: `attention_flops`) gives its rate instead.
"""

from __future__ import annotations

import math

from ultratron.models.specs import spec_of
from ultratron.planning.activations import dtypes_of, layer_matmul_params
from ultratron.planning.experts import is_moe, moe_layer_share
from ultratron.planning.flops import flops_per_token_of
from ultratron.planning.layout import Layout
from ultratron.planning.memory import estimate_memory
from ultratron.planning.rules import expert_ffn_dim_of, field_of, head_dim_of

MATMUL_EFFICIENCY = 0.61
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
    loop_and_store = 2 * m * k * n / (efficiency * peak) + p * m * n / hbm
    return max(loop_and_store, p * (m * k + k * n + m * n) / hbm) + MATMUL_OVERHEAD_S


def layer_matmuls(shape, tokens: float, tp: int, ep: int = 1) -> list[tuple[float, float, float, float]]:
    """(M, K, N, how many) of one average layer's forward products on a rank, for `tokens` tokens."""
    h, hd = shape.dim, head_dim_of(shape)
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    # the model's own linear layers (`models.llama`): wq, wk and wv, the output projection
    out = [(tokens, h, q / tp, 1), (tokens, h, kv / tp, 2), (tokens, q / tp, h, 1)]
    moe = moe_layer_share(shape) if is_moe(shape) else 0.0
    if moe < 1:
        f = shape.ffn_dim / tp
        out += [(tokens, h, f, 2 * (1 - moe)), (tokens, f, h, 1 - moe)]  # gate and up (w1, w3), down (SwiGLU)
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
    # attention: as the family's FLOPs formula counts it (sliding windows included), split over tp's heads
    attention = spec_of(shape).attention_flops_per_token(shape, layout.seq_len) * tokens / layout.tp
    flops += attention
    rate = attention_efficiency(layout.seq_len / layout.cp) / MATMUL_EFFICIENCY if attention_table else 1.0
    seconds += attention / attention_flops if attention_flops else attention / (rate * efficiency * other_peak)
    return flops / seconds / peak


# Elementwise work: the passes over memory that are not matmuls or attention. Counted as the
# eager kernels of `models/llama` run them, each reading its inputs and writing its output once, in
# bytes per token and layer, forward | backward (r, p: bytes of the residual stream and of matmul
# outputs, `planning.activations.dtypes_of`; h' = h/t under sequence parallelism, else h; q, kv, f
# the query, key-value and FFN widths split by t):
#   2 RMSNorms     fp32: x², its mean, x·rsqrt, ·weight: 28·h' | their gradients (g·weight, the
#                  weight's g·x̂ summed over tokens, the two of x·rsqrt, the square's, their sum;
#                  eight kernels): 92·h'; a bf16 stream
#                  adds the upcast and the downcast, 12·h' each way
#   2 residuals    (2r + p)·h' each | the residual gradient accumulated, 3r·h' each, and cast to
#                  the branch's dtype, (r + p)·h' each, when r ≠ p
#   rotary q, k    the complex product 8·(q + kv) | 10·(q + kv); + 12·(q + kv) each way for the
#                  upcast and downcast when p = 2
#   SwiGLU         silu(gate), × up: 5p·f | 9p·f
#   matmul inputs  under autocast over an fp32 stream each of the 5 column-parallel matmuls casts
#                  its input (6·h each way; under sequence parallel 2 casts of the shard, 6·h/t);
#                  backward sums the 3 + 2 input gradients, 3 adds of 3·(4 if cast else r)·h
#   attention      fp32 on a CPU under bf16 (`attention_fp32`): q, k, v and the output cast, 6·(2q + 2kv)
# Checked against the trainer's own kernels (every non-matmul aten op of a block, counted by
# `tests/planning/test_plan_compute.py`). Autocast also casts each matmul weight once per
# micro-batch (6 bytes a parameter forward and again backward). Backward's traffic follows; full
# recompute runs the forward's again, selective its norms, rotary, SwiGLU and casts. The loss on the
# rank holding the head: 6 passes over the V/t fp32 logits per token (the upcast written, log-softmax
# read and written, its backward read and written, the gradient cast back). The optimizer step reads
# every byte of the rank's model states and writes all but the gradients (AdamW: master, two moments,
# the compute copy); each micro-batch after the first reads and writes the accumulated gradients.
#
# Under compile (`parallel/compile.py`: Inductor fuses each block's elementwise work, forward and
# backward, into a few loops; the matmuls and attention stay library kernels) each fused loop reads
# its inputs and writes its outputs once, per token and layer: the two norms with the residual adds
# (the first norm reads x and writes its output; the second reads x and the attention's output,
# whose sum it does not keep; the last add reads x and both branches and writes the sum:
# (4r + 5p)·h' | backward, the norms' input and weight gradients with the residual gradient and the
# matmul input-gradient sums folded in: (9r + 10p)·h'), rotary 2p·(q + kv) each way, SwiGLU 3p·f |
# 5p·f. The casts fold into the norms. A CPU's fp32 attention under bf16 (`attention_fp32`) adds
# rotary's fp32 output, v's cast and fp32 copies of q, k and v in the kernel's layout, the output's
# cast back: (16q + 24kv) | (8q + 8kv). Counted against Inductor's own byte count of the kernels it
# generates for a block (`tests/planning/test_plan_compute.py`). The compiled loss (whole logits) makes
# 4 passes over the logits in their own dtype: the two forward reductions, backward's read and write.
#
# fp8 (`parallel/float8.py`: torchao's Float8Linear, tensorwise scales; the casting kernels as
# torchao's own roofline model, torchao/testing/training/roofline_utils.py, lists them): each
# linear layer of a block casts its input in forward and its output gradient in backward to fp8,
# both memory layouts its matmuls need: eager, the amax pass (p bytes an element), the cast (p
# read, 1 written) and the transposed copy (1 + 1), 2p + 3; compiled, the amax folds into the
# kernel that made the tensor and one kernel writes both layouts, p + 2. Inputs per token:
# 3h (q, k, v) + q (o) + 2h (gate, up) + f (down); output gradients q + 2kv + h + 2f + h. Each
# micro-batch also casts the fp32 weights: their amax and a forward and a backward cast, 14 bytes an
# element (`FP8_WEIGHT_CAST`); under ZeRO-3 with tensorwise scales on the shard before FSDP gathers
# it in fp8, and the gathered weight's transposed copy, 2 bytes an element (rowwise scales: on the
# gathered bf16 weight).
#
# Each kind of work — "layer" (a block's, the list above), "loss", "optimizer" — takes
#     calls × latency + bytes / bandwidth
# with the kind's rate from `ultratron bench comm`'s profile where it measured one (the model's own
# block, its ends and its optimizer step timed on one rank, less the matmuls and attention the
# compute term prices: `planning.profile.fit_kernels`), else no latency at the memory bandwidth (a
# GPU's HBM datasheet figure). A call is one layer's forward + backward (recompute repeats the share
# of it that it runs again), one micro-batch's loss, one optimizer step.
LOSS_PASSES = 6
FP8_WEIGHT_CAST = 14  # bytes per fp32 weight element: its amax (4), the forward and backward casts (4 + 1 each)
KERNEL_KINDS = ("layer", "loss", "optimizer")


def layer_elementwise_bytes(shape, layout) -> dict[str, tuple[float, float]]:
    """(forward, backward) bytes one token moves through the elementwise kernels of one average layer,
    by kind (comment above)."""
    dt = dtypes_of(layout)
    r, p, t = dt.residual, dt.compute, layout.tp
    sp = layout.sp and t > 1
    h = shape.dim
    hs = h / t if sp else h
    hd = head_dim_of(shape)
    q, kv = shape.n_heads * hd / t, shape.n_kv_heads * hd / t
    moe = moe_layer_share(shape) if is_moe(shape) else 0.0
    f = (1 - moe) * shape.ffn_dim
    if moe:
        f += moe * expert_ffn_dim_of(shape) * (field_of(shape, "n_active_experts")
                                               + (field_of(shape, "n_shared_experts") or 0))
    f /= t
    fp8 = _fp8_cast_bytes(layout, p, h, q, kv, f) if layout.precision == "fp8" else {}
    if layout.compile:
        return _compiled_layer_bytes(layout, dt, hs, q, kv, f) | fp8
    updown = 12 if r < 4 else 0
    rope_casts = 12 if p < 4 else 0
    cast_in = (2 * 6 * h / t if sp else 5 * 6 * h) if dt.casts else 0.0
    out = {"norms": (2 * hs * (28 + updown), 2 * hs * (92 + updown)),
           "residual": (2 * (2 * r + p) * hs, 2 * 3 * r * hs + (2 * (r + p) * hs if r != p else 0)),
           "rotary": ((q + kv) * (8 + rope_casts), (q + kv) * (10 + rope_casts)),
           "swiglu": (5 * p * f, 9 * p * f),
           "casts": (cast_in, cast_in + 3 * 3 * (4 if dt.casts else r) * h)}
    if layout.precision != "fp32" and layout.attention_fp32:
        out["attention"] = (6 * (2 * q + 2 * kv),) * 2
    return out | fp8


def _fp8_cast_bytes(layout, p: int, h: float, q: float, kv: float, f: float) -> dict[str, tuple[float, float]]:
    """Per token: the fp8 casts of the blocks' linear layers' activations (comment above, "fp8")."""
    per_element = p + 2 if layout.compile else 2 * p + 3
    inputs = 3 * h + q + 2 * h + f  # q, k, v; o; gate, up; down (q, kv, f already split by tp)
    grad_outputs = q + 2 * kv + h + 2 * f + h
    return {"fp8 casts": (per_element * inputs, per_element * grad_outputs)}


def _compiled_layer_bytes(layout, dt, hs: float, q: float, kv: float, f: float) -> dict[str, tuple[float, float]]:
    """`layer_elementwise_bytes` of a block that torch.compile fused (comment above, "Under compile")."""
    r, p = dt.residual, dt.compute
    out = {"norms": ((4 * r + 5 * p) * hs, (9 * r + 10 * p) * hs),
           "rotary": (2 * p * (q + kv),) * 2,
           "swiglu": (3 * p * f, 5 * p * f)}
    if layout.precision != "fp32" and layout.attention_fp32:  # rotary writes fp32, v cast, contiguous
        out["attention"] = (16 * q + 24 * kv, 8 * q + 8 * kv)     # copies for the kernel, the output cast
    return out


def elementwise_parts(shape, layout, memory) -> dict[str, tuple[float, float]]:
    """{kind: (bytes, calls)} on the rank whose memory breakdown is `memory` (its layers, its head,
    its model states): "layer" and (on the rank holding the head) "loss" for one micro-batch,
    "optimizer" for the step. See the comment above."""
    per_layer = layer_elementwise_bytes(shape, layout)
    again = {"none": (), "selective": ("norms", "rotary", "swiglu", "casts"),
             "full": tuple(per_layer)}[layout.recompute]
    once = sum(f + b for f, b in per_layer.values())
    per_token = once + sum(per_layer[kind][0] for kind in again if kind in per_layer)
    tokens = layout.micro_batch_size * layout.seq_len / layout.cp
    layers = memory.extra.get("layers_on_stage", shape.n_layers)
    layer_bytes = tokens * layers * per_token
    weights = layers * layer_matmul_params(shape, layout.tp)
    if layout.precision == "fp8":  # each micro-batch casts the fp32 weights to fp8 (comment above)
        on_shard = layout.zero == 3 and layout.gathered_bytes == 1  # tensorwise: cast before FSDP gathers
        layer_bytes += weights * (FP8_WEIGHT_CAST / layout.shard_group + 2 if on_shard else FP8_WEIGHT_CAST)
    elif dtypes_of(layout).casts:  # autocast's copy of each matmul weight: forward (again under recompute), backward
        layer_bytes += weights * 6 * (3 if layout.recompute != "none" else 2)
    parts = {"layer": (layer_bytes, layers * per_token / once)}
    if memory.loss_logits:  # the rank holds the head
        # compiled (whole logits only, `parallel/compile.compiled_loss`): 4 passes of the logits' own dtype
        passes = 4 * layout.compute_bytes if layout.compile and layout.tp == 1 else LOSS_PASSES * 4
        parts["loss"] = (tokens * passes * shape.vocab_size / layout.tp, 1.0)
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


def one_gpu_step_seconds(shape, micro_batch: int, seq: int, acc, efficiency: float = MATMUL_EFFICIENCY) -> float:
    """One micro-batch's forward + backward of `shape` on one GPU, bf16 weights and no optimizer (as
    `benchmarks/matmul_shapes.py --models` times it), priced as the planner prices a step: products and
    attention (`compute_efficiency`) plus the elementwise kernels (`kernel_seconds`, as `estimate_step`)."""
    peak = acc.flops["bf16"]
    tokens = micro_batch * seq
    layout = Layout(micro_batch_size=micro_batch, seq_len=seq)
    compute = tokens * flops_per_token_of(shape, seq) / (
        compute_efficiency(shape, layout, peak, acc.hbm_bw, efficiency, acc.attention_table) * peak)
    bf16 = Layout(dp=2, zero=3, micro_batch_size=micro_batch, seq_len=seq)  # FSDP2's bf16 weights and stream
    parts = elementwise_parts(shape, bf16, estimate_memory(shape, bf16))
    return compute + kernel_seconds(parts, ("layer", "loss"), acc.hbm_bw, acc.kernels)


def loss_recompute_flops(shape, layout) -> float:
    """FLOPs a token the chunked loss (`loss_chunk`) adds: the head's matmul again in backward."""
    return 2 * shape.dim * shape.vocab_size if layout.loss_chunk else 0.0


def offload_seconds(host_bytes: float, host_bw: float, per_micro: float, micro_batches: int) -> tuple[float, float]:
    """(seconds of offload copies over the host link, those compute does not hide): each micro-batch's
    moved activations go out during its forward (about a third of its compute) and come back during
    its backward (two thirds), on a side stream."""
    one_way = host_bytes / host_bw
    exposed = max(0.0, one_way - per_micro / 3) + max(0.0, one_way - 2 * per_micro / 3)
    return 2 * micro_batches * one_way, micro_batches * exposed
