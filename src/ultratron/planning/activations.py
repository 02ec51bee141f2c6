"""Bytes of activations a training step keeps alive on one GPU, per layer and per stage.

Two estimators:

* "per-op" (default) — what ultratron's trainer keeps alive, tensor by tensor: `models.llama`
  under `parallel` (TP/SP through DTensor, recompute through `parallel/recompute.py`) and bf16 as
  the trainer runs it (`training/precision.py`: autocast over fp32 weights, except under FSDP2,
  whose mixed-precision policy gathers bf16 weights). Measured on CPU with torch's profiler
  (tests/planning/test_plan_measured.py, tests/distributed/test_dist_activation_memory.py). Below,
  T = tokens of the micro-batch on this rank (micro_batch_size·seq_len/cp), b·s its sequences and length, t = tp,
  g = t with sequence parallel (the norm regions are split) else 1, h, f, kv = width, FFN width,
  kv heads × head dim, a = heads, d = head dim; r, p, q = bytes of the residual stream, of matmul
  outputs and of attention's q, k, v (`Dtypes`).
    RMSNorm (`_norm`): the fp32 input 4·T·h/g (the residual itself, or its fp32 copy), the fp32
      normalised value 4·T·h/g, the fp32 rsqrt 4·T/g, an fp32 copy of a bf16 weight 4·h.
    Matmul inputs: under autocast over fp32 activations every matmul casts its input itself, so
      the three of wq/wk/wv and the two of w1/w3 each keep their own p·T·h copy; otherwise they
      share the norm's output r·T·h. Under sequence parallel the matmuls keep only the rank's
      sequence shard of the norm's output, 2·(p under autocast, else r)·T·h/t, cast before the
      all-gather, which backward runs again (`parallel.tensor.KeepSequenceShard`, as Megatron-LM
      does, Korthikanti et al. 2022 §4.2.2).
    Attention: q and k after RoPE and v, q·T·(h + 2kv)/t; the output q·T·h/t (+ its p copy for wo
      when q ≠ p); flash attention's fp32 log-sum-exp 4·b·s·a/t and no s×s scores; RoPE's two
      complex64 rotation tables 2·4·s·d. QK-norm adds a norm over q and k per head.
    SwiGLU: w1·x, w3·x, silu(w1·x) and the product, 4·p·T·f/t; a mixture of experts' layers the
      routed slots' instead (`planning.experts`, `_with_experts`).
    Autocast's bf16 copies of the fp32 weights, 2 bytes per matmul weight, kept for backward.
  Recompute, as `parallel/recompute.py` runs it: *full* keeps each block's input r·T·h/g;
  *selective* (torch's selective checkpoint, MUST_SAVE matmul and attention outputs) keeps the
  block input, the matmul outputs p·T·(h/t + 2kv/t + 2f/t + 2h) — wo and w2 give full-width
  partial sums under tp — and attention's output and log-sum-exp, under sp also their reduce-
  scatters' outputs 2·p·T·h/t; the rest (norms, RoPE, casts, weight copies, silu·mul, sp's
  all-gathers) is recomputed in backward.
  The last stage keeps the final norm, the head's input, the loss's fp32 log-probabilities
  4·T·v/t, the int64 targets (twice under tp: loss_parallel keeps its own) and under pipeline
  parallelism the logits p·T·v/t (torch's stage holds its output until its backward; without pp
  the step hands them to the loss and holds no reference, and autograd saves neither them nor
  their fp32 cast: `ultratron simulate` finds none alive at the loss's backward; with
  training.z_loss the log-sum-exp keeps the fp32 cast, not priced here); the first the
  token ids, and under tp the embedding's partial lookup and its reduced copy (under sp two
  sequence shards).
* "textbook" — Korthikanti et al. 2022 (arXiv 2205.05198), bf16, multi-head attention, 4h MLP:
  s·b·h·(34 + 5·a·s/h); TP without SP s·b·h·(10 + 24/t + 5·a·s/(h·t)); TP + SP
  s·b·h·(34 + 5·a·s/h)/t; selective recompute drops the 5·a·s/h term, full keeps 2·s·b·h (÷t with SP).

Backward transients (on top of what forward left alive, measured as above): the loss's backward
allocates two fp32 T×v/t gradients (three under loss_parallel); a recomputed block re-creates
its activations (a selective one reuses what it cached and drops wo's and w2's outputs) and, at
its MLP's backward, holds the residual's gradient r·T·h/g (+ its p cast under autocast) and two
p·T·f/t gradients (of the product and of one of its factors). Measured: the peak within one
block tensor of the step's own (torch frees a recomputed tensor once backward has used it, so the
real peak can fall an operator earlier or later), kernel scratch left out (it depends on the CPU:
`parallel.memory.AllocatedBytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ultratron.planning.experts import moe_layer_share, moe_mlp_activation_bytes
from ultratron.planning.rules import expert_ffn_dim_of, field_of, head_dim_of

RECOMPUTE = ("none", "selective", "full")
ACTIVATION_MODELS = ("per-op", "textbook")


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of what a layout keeps, as the trainer runs its precision."""

    residual: int  # the residual stream: the embedding's output, block inputs and outputs
    compute: int  # matmul outputs
    attention: int  # q, k, v and the output as attention computes them
    casts: bool  # autocast over fp32 activations: each matmul casts its input, and its fp32 weight, itself


def dtypes_of(layout) -> Dtypes:
    """fp32: everything 4 bytes. bf16: autocast over fp32 weights (one process, DDP, FSDP2's replicate)
    keeps an fp32 residual stream and casts per matmul; FSDP2 gathers bf16 weights, so the residual is
    bf16 and nothing is cast twice. `attention_fp32` (bf16 on CPU, models.llama._sdpa) runs attention in fp32.
    The Megatron-LM convention (`fp32_grad_accum`) keeps bf16 weights, as FSDP2 does."""
    if layout.precision == "fp32":
        return Dtypes(4, 4, 4, False)
    attention = 4 if layout.attention_fp32 else 2
    if layout.fp32_grad_accum or layout.wrapper == "fsdp":
        return Dtypes(2, 2, attention, False)
    return Dtypes(4, 2, attention, True)


def _tokens(layout) -> float:
    return layout.micro_batch_size * layout.seq_len / layout.cp


def _region(layout) -> int:
    return layout.tp if layout.sp and layout.tp > 1 else 1


def _head_dim(shape) -> int:
    return head_dim_of(shape)


def _norm(tokens: float, width: float, rows: float, dt: Dtypes) -> float:
    """An RMSNorm's fp32 input and normalised value, its rsqrt per row, an fp32 copy of a bf16 weight."""
    return 8 * tokens * width + 4 * rows + (4 * width if dt.residual == 2 else 0)


def _matmul_inputs(tokens: float, h: float, t: int, g: int, dt: Dtypes) -> float:
    """What the column-parallel matmuls (wq/wk/wv, w1/w3) keep of their input. Sequence parallel
    keeps the two norms' outputs as sequence shards, cast first under autocast (the backward
    all-gathers them again: `parallel.tensor.KeepSequenceShard`); otherwise the whole sequence, and
    under autocast each of the five matmuls its own cast."""
    if g > 1:
        return 2 * (dt.compute if dt.casts else dt.residual) * tokens * h / t
    return (5 * dt.compute if dt.casts else 2 * dt.residual) * tokens * h


def layer_matmul_params(shape, tp: int = 1) -> float:
    """Weights of one block's matmuls on a tensor-parallel rank (what autocast copies to bf16)."""
    kv = shape.n_kv_heads * _head_dim(shape)
    w = shape.n_heads * _head_dim(shape)
    return (2 * shape.dim * w + 2 * shape.dim * kv + 3 * shape.dim * shape.ffn_dim) / tp


def per_op_layer_items(shape, layout, recompute: str | None = None) -> dict[str, float]:
    """What one block keeps alive after forward, by tensor group (see the module docstring)."""
    recompute = recompute or layout.recompute
    dt = dtypes_of(layout)
    p, q, t, g = dt.compute, dt.attention, layout.tp, _region(layout)
    tokens, b, s = _tokens(layout), layout.micro_batch_size, layout.seq_len / layout.cp
    h, f, a, d = shape.dim, shape.ffn_dim, shape.n_heads, _head_dim(shape)
    kv = shape.n_kv_heads * d
    block_input = dt.residual * tokens * h / g
    if recompute == "full":
        return {"block input": block_input}
    w = a * d  # the query width (= h unless the head width is set apart, as in Qwen3)
    attention_out = {"attention output": q * tokens * w / t, "log-sum-exp": 4 * b * s * a / t}
    if recompute == "selective":
        items = {"block input": block_input,
                 "matmul outputs": p * tokens * (w / t + 2 * kv / t + 2 * f / t + 2 * h), **attention_out}
        if layout.sp and t > 1:  # wo's and w2's reduce-scatters, saved as the rank's shard
            items["reduce-scatter outputs"] = 2 * p * tokens * h / t
        return _with_experts(items, "matmul outputs", shape, layout, recompute)
    items = {
        "norms": 2 * _norm(tokens / g, h, tokens / g, dt),
        "matmul inputs": _matmul_inputs(tokens, h, t, g, dt),
        "q, k, v": q * tokens * (w + 2 * kv) / t,
        **attention_out,
        "rope tables": 2 * 4 * s * d,
        "swiglu": 4 * p * tokens * f / t,
    }
    if q != p:
        items["attention output"] += p * tokens * w / t  # its copy in the compute dtype for wo
    if getattr(shape, "qk_norm", False):  # one norm per head over q and one over k, each d wide
        items["qk norms"] = 8 * tokens * (w + kv) / t + 4 * tokens * (a + shape.n_kv_heads) / t + (
            2 * 4 * d if dt.residual == 2 else 0)
    if dt.casts and layout.precision != "fp8":  # fp8's linear layers keep the fp32 weight itself for backward
        items["bf16 weight copies"] = 2 * layer_matmul_params(shape, t)
    return _with_experts(items, "swiglu", shape, layout, recompute)


def _with_experts(items: dict[str, float], mlp: str, shape, layout, recompute: str) -> dict[str, float]:
    """A mixture of experts' average layer: its MoE layers' routed slots (`planning.experts`) in
    place of the dense SwiGLU's share `mlp` (w1·x and w3·x under selective recompute, all four else).
    Under autocast's casts each matmul also keeps its own bf16 input and weight copy: the router's,
    the k routed slots' once (cast once for the grouped matmuls of w1 and w3, `models/moe.py`) and
    the shared experts' twice (w1, w3) instead of the dense w1/w3's, and the rank's E/ep experts'
    weights instead of the dense MLP's. Under FSDP2 in bf16 the split
    experts (ep or tp > 1), which FSDP leaves alone, stay fp32: autocast copies them too."""
    share = moe_layer_share(shape)
    if not share:
        return items
    dt, t, tokens = dtypes_of(layout), layout.tp, _tokens(layout)
    p, h = dt.compute, shape.dim
    dense = (2 if recompute == "selective" else 4) * p * tokens * shape.ffn_dim / t
    items[mlp] -= share * dense
    items["experts"] = share * moe_mlp_activation_bytes(shape, tokens, p, t, recompute)
    if dt.casts and recompute == "none":
        k, shared = field_of(shape, "n_active_experts"), field_of(shape, "n_shared_experts")
        experts, he = shape.n_experts, expert_ffn_dim_of(shape)
        items["matmul inputs"] += share * p * tokens * h * (1 + k + 2 * shared - 2)
        weights = experts * h + 3 * h * he * (experts / layout.ep + shared) / t - 3 * h * shape.ffn_dim / t
        items["bf16 weight copies"] += share * 2 * weights
    elif recompute == "none" and layout.wrapper == "fsdp" and layout.precision == "bf16" and (layout.ep > 1 or t > 1):
        experts, he = shape.n_experts, expert_ffn_dim_of(shape)
        items["bf16 weight copies"] = share * 2 * 3 * h * he * experts / layout.ep / t
    return items


def textbook_layer_activation_bytes(shape, layout, recompute: str | None = None) -> float:
    """Korthikanti et al. per-layer bytes (bf16 basis, scaled ×2 for fp32)."""
    recompute = recompute or layout.recompute
    s, b, h, a, t = layout.seq_len / layout.cp, layout.micro_batch_size, shape.dim, shape.n_heads, layout.tp
    sbh = s * b * h
    scale = (2 if layout.precision == "bf16" else 4) / 2
    if recompute == "full":
        return scale * 2 * sbh / (t if layout.sp else 1)
    attention_scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if t == 1:
        per = 34 + attention_scores
    elif layout.sp:
        per = (34 + attention_scores) / t
    else:
        per = 10 + 24 / t + attention_scores / t
    return scale * sbh * per


def layer_activation_bytes(shape, layout, model: str = "per-op", recompute: str | None = None) -> float:
    if model == "textbook":
        return textbook_layer_activation_bytes(shape, layout, recompute)
    return sum(per_op_layer_items(shape, layout, recompute).values())


def first_stage_items(shape, layout) -> dict[str, float]:
    """The first stage's extras: the token ids; under tp the embedding's partial lookup and its
    reduced copy, or under sp two sequence shards: the reduce-scatter's output and its autograd
    wrapper's (the first block's input, its third, is the block's own)."""
    tokens, h = _tokens(layout), shape.dim
    items = {"token ids": 8 * tokens}
    if layout.tp > 1:
        items["embedding partial sums"] = 2 * dtypes_of(layout).residual * tokens * h / _region(layout)
    return items


def last_stage_items(shape, layout, model: str = "per-op") -> tuple[dict[str, float], dict[str, float]]:
    """(the final norm and the head's input, the loss's share: log-probabilities, targets, under pp logits)."""
    dt = dtypes_of(layout)
    tokens, h, v, t, g = _tokens(layout), shape.dim, shape.vocab_size, layout.tp, _region(layout)
    if model == "per-op":
        head = {"final norm": _norm(tokens / g, h, tokens / g, dt),
                "head input": (dt.compute if dt.casts else dt.residual) * tokens * h / g}
        if dt.casts and not layout.loss_chunk:  # (the chunked loss casts the weight in its backward)
            head["bf16 weight copies"] = 2 * v * h / t
    else:
        head = {"final norm": 2 * dt.compute * tokens * h / g}  # its input and output
    loss = {"log-probabilities": 4 * tokens * v / t, "targets": 8 * tokens * (2 if t > 1 else 1)}
    if layout.loss_chunk:  # chunked: forward keeps no logits, backward recomputes one chunk at a time
        del loss["log-probabilities"]
    if layout.pp > 1 and not layout.loss_chunk:  # the pipeline stage holds its output until its backward
        loss["logits"] = dt.compute * tokens * v / t  # (chunked: the hidden states, which the loss keeps anyway)
    return head, loss


def loss_backward_bytes(shape, layout) -> float:
    """The cross-entropy's backward: the fp32 gradients of the log-probabilities and of the logits
    (and one more under loss_parallel). Chunked (`loss_chunk`, `training.loss.linear_cross_entropy`):
    a slice of the vocabulary over every token at a time, `loss_chunk` tokens' worth of logits — in
    fp32, and the compute dtype's copy they come from or go to under bf16 —, the hidden states' fp32
    gradient that adds up over the slices, and the head's weight gradient, made at the loss's backward
    instead of after it, in the weight's dtype (under autocast also the weight and hidden states cast
    to bf16 for the matmuls)."""
    tokens, v, t, h = _tokens(layout), shape.vocab_size, layout.tp, shape.dim
    passes = (3 if t > 1 else 2) * 4
    if not layout.loss_chunk:
        return passes * tokens * v / t
    dt = dtypes_of(layout)
    chunk = min(layout.loss_chunk, tokens)
    per_logit = 4 + (dt.compute if dt.compute < 4 else 0)
    casts = dt.compute * (v * h / t + tokens * h) if dt.casts else 0.0
    return per_logit * chunk * v / t + 4 * tokens * h + dt.residual * v * h / t + casts


def block_backward_bytes(shape, layout, model: str = "per-op") -> float:
    """What a block's backward adds on top of forward's leftovers, at its MLP: the recomputed
    activations (none without recompute; the cached outputs stay) and the gradients in flight."""
    dt = dtypes_of(layout)
    tokens, h, f, t, g = _tokens(layout), shape.dim, shape.ffn_dim, layout.tp, _region(layout)
    recomputed = 0.0
    if layout.recompute != "none":
        recomputed = layer_activation_bytes(shape, layout, model, "none") - dt.residual * tokens * h / g
    if layout.recompute == "selective" and model == "per-op":
        # the recomputed block reuses what the checkpoint cached: w1·x, w3·x, attention's output
        # and log-sum-exp, and v when attention takes it as the matmul gave it
        kv = shape.n_kv_heads * _head_dim(shape)
        cached = per_op_layer_items(shape, layout, "selective")
        recomputed -= 2 * dt.compute * tokens * f / t + cached["attention output"] + cached["log-sum-exp"]
        recomputed -= dt.compute * tokens * kv / t if dt.attention == dt.compute else 0
        recomputed -= 2 * dt.compute * tokens * h  # wo's and w2's cached outputs, which no backward needs
    in_flight = dt.residual * tokens * h / g + (dt.compute * tokens * h if dt.casts else 0)
    return recomputed + in_flight + 2 * dt.compute * tokens * f / t
