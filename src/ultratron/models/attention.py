"""The attention backend: every attention of the model (and context parallel's per-block kernels) runs here.

`attend(q, k, v, spec, groups)` takes q (batch, heads, q_len, head_dim), k and v (batch, kv_heads,
k_len, head_dim) and a `MaskSpec` (`models/masks.py`; None: causal) and picks a kernel by
`spec.backend` (`model.attention`) and the device:

  plain causal       PyTorch's `scaled_dot_product_attention` with `is_causal` (its fused kernels,
                     grouped-query heads by `enable_gqa`), under every backend.
  flex               `flex_attention` (`models/flex.py`) with a `BlockMask` made block by block from
                     the spec (documents, window) and the soft cap as a score modification; compiled on
                     a GPU. `auto` takes it on CUDA for every masked or soft-capped attention of a
                     row (not a KV cache's decoding, whose shapes change every step). On a CPU it
                     runs only without gradients (eagerly: torch's FlexAttention has no CPU
                     backward), so `auto` does not take it there.
  sdpa with a mask   the queries in chunks of `QUERY_CHUNK`, each against the keys it can see at most
                     (`masks.key_span`), with that chunk's dense mask only: on a CPU through the CPU
                     flash kernel (the forward's log-sum-exp feeds its backward, so nothing is
                     recomputed); elsewhere, and for a soft cap (which SDPA lacks), the public SDPA or
                     the scores of the chunk, recomputed in backward (`torch.utils.checkpoint`), with
                     grouped-query K/V repeated (SDPA's `enable_gqa` with a mask falls to its math
                     kernel). No S × S tensor exists at any time; the largest is QUERY_CHUNK × k_len.
                     Under torch.compile the chunks are fixed (no host reads) and plain SDPA.
  decoding           without gradients, at most `DECODE_QUERIES` queries a row (a KV cache's new
                     tokens): public SDPA with the boolean mask and `enable_gqa`, K/V read in place.
                     Its scores are q_len × k_len a head, a few rows. Through the chunked path (its
                     repeated K/V, float mask, autograd function) serve's tokens/s on a CPU with
                     nothing shared was 0.84× the code before this backend; with this path 0.98×.

On a CPU, bf16 attention runs in fp32: PyTorch's CPU flash-attention backward is ~2.7× slower in
bf16 than in fp32 (62 vs 23 ms a call, measured on an AVX-512-BF16 machine without AMX), and fp32 is
the more accurate of the two. GPUs keep bf16 for their fused kernels.

Context parallel's blocks (`block_forward`, `block_backward`): one query block against one key block,
returning the log-sum-exp that merges blocks and taking the merged output and log-sum-exp in
backward. On a CPU the CPU flash kernel; on a GPU FlexAttention, whose backward is its own autograd
given the merged result (`merged_gradients`). This module is the only one that calls PyTorch's
private attention ops.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

from ultratron.models import flex
from ultratron.models.masks import MaskSpec, allowed, key_span, query_positions

QUERY_CHUNK = 1024  # queries per chunk of the masked SDPA path: its mask is QUERY_CHUNK × k_len at most
DECODE_QUERIES = 16  # without gradients, up to this many queries a row take SDPA directly (the module docstring)
CAUSAL = MaskSpec()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec | None, groups: int) -> torch.Tensor:
    """The attention output (batch, heads, q_len, head_dim) in q's dtype."""
    spec = CAUSAL if spec is None else spec
    dtype = q.dtype
    if q.device.type == "cpu" and dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            return attend(q.float(), k.float(), v.float(), spec, groups).to(dtype)
    if spec.plain and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
    if uses_flex(spec, q, k):
        return flex.flex_attend(q, k, v, spec, groups)
    return chunked_attend(q, k, v, spec, groups)


def uses_flex(spec: MaskSpec, q: torch.Tensor, k: torch.Tensor) -> bool:
    """`flex` always; `auto` on a GPU (where torch has FlexAttention) when the queries attend their own
    row: not a KV cache's few new queries against every cached key, whose shapes change each step
    (a compiled FlexAttention would compile again for each). Never for a KV cache's tree of shared
    prefixes (`spec.shared`, a few short forwards): the chunked path's dense masks express it."""
    own_row = spec.rows is None and q.shape[2] == k.shape[2]
    if spec.shared is not None:
        return False
    return spec.backend == "flex" or (spec.backend == "auto" and q.is_cuda and flex.AVAILABLE and own_row)


def repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def fold_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradients of repeated kv heads back onto their kv head."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as the CPU kernel takes it: 0 where allowed, -inf elsewhere."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _chunks(spec: MaskSpec, q: torch.Tensor) -> list:
    """(query slice, its positions, first key, end key) of each chunk of queries: found once per
    forward and window (`spec.cache`, shared by the layers and read again by backward), as the spans'
    host reads are the same for every layer."""
    key = ("chunks", spec.window, q.shape[2], q.device)
    if key not in spec.cache:
        q_pos, spans = query_positions(spec, q.shape[2], q.device), []
        for a in range(0, q.shape[2], QUERY_CHUNK):
            rows = q_pos[:, a:a + QUERY_CHUNK]
            spans.append((slice(a, a + QUERY_CHUNK), rows, *key_span(spec, rows)))
        spec.cache[key] = spans
    return spec.cache[key]


def _empty_output(q: torch.Tensor, dtype=None) -> torch.Tensor:
    """(batch, heads, seq, head_dim) laid out as (batch, seq, heads, head_dim), as PyTorch's kernels
    return it, so that the model's transpose back is a view."""
    b, h, s, d = q.shape
    return torch.empty(b, s, h, d, dtype=dtype or q.dtype, device=q.device).transpose(1, 2)


def chunked_attend(q, k, v, spec: MaskSpec, groups: int) -> torch.Tensor:
    """Masked attention a chunk of queries at a time (the module docstring's "sdpa with a mask")."""
    if torch.compiler.is_compiling() or q.device.type == "meta" or isinstance(q, FakeTensor):
        return _traced_chunks(q, k, v, spec, groups)  # (shapes without values: `simulate`)
    if not spec.softcap and q.shape[2] <= DECODE_QUERIES and not torch.is_grad_enabled():
        mask = allowed(spec, query_positions(spec, q.shape[2], q.device), torch.arange(k.shape[2], device=q.device))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
    if q.device.type == "cpu" and not spec.softcap:
        return _CpuChunks.apply(q, k, v, spec, groups)
    out = _empty_output(q)
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    parts = []
    for rows_slice, rows, lo, hi in _chunks(spec, q):
        fn = partial(_dense_chunk, spec=spec, rows=rows, lo=lo, groups=groups)
        args = (q[:, :, rows_slice], k[:, :, lo:hi], v[:, :, lo:hi])
        part = checkpoint(fn, *args, use_reentrant=False) if grads else fn(*args)
        if grads:
            parts.append(part)
        else:
            out[:, :, rows_slice] = part
    return torch.cat(parts, dim=2) if grads else out


def _traced_chunks(q, k, v, spec: MaskSpec, groups: int) -> torch.Tensor:
    """Under torch.compile (`training.compile`), or on tensors without values: no host reads, so each
    chunk takes every key up to its last query (the whole row where the queries sit at given
    positions), and the compiled graph's autograd decides what to keep; still no S × S tensor."""
    q_pos = query_positions(spec, q.shape[2], q.device)
    parts = []
    for a in range(0, q.shape[2], QUERY_CHUNK):
        end = min(a + QUERY_CHUNK, k.shape[2]) if spec.rows is None else k.shape[2]
        parts.append(_dense_chunk(q[:, :, a:a + QUERY_CHUNK], k[:, :, :end], v[:, :, :end], spec,
                                  q_pos[:, a:a + QUERY_CHUNK], 0, groups))
    return torch.cat(parts, dim=2)


def _dense_chunk(q, k, v, spec: MaskSpec, rows: torch.Tensor, lo: int, groups: int) -> torch.Tensor:
    """One chunk of queries against keys lo .. lo + k_len, with its own dense mask (the reference path)."""
    mask = allowed(spec, rows, torch.arange(lo, lo + k.shape[2], device=q.device))
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    if not spec.softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = (spec.softcap * torch.tanh(scores / spec.softcap)).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).type_as(v) @ v


def reference_attention(q, k, v, spec: MaskSpec | None, groups: int) -> torch.Tensor:
    """Every query at once with the whole dense mask, the scores materialized: what the backends must
    equal (tests; O(q_len × k_len) memory)."""
    spec = CAUSAL if spec is None else spec
    rows = query_positions(spec, q.shape[2], q.device)
    return _dense_chunk(q, k, v, spec, rows, 0, groups) if spec.softcap else F.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups),
        attn_mask=allowed(spec, rows, torch.arange(k.shape[2], device=q.device)))


class _CpuChunks(torch.autograd.Function):
    """The CPU flash kernel a chunk of queries at a time, each chunk's mask made again in backward."""

    @staticmethod
    def forward(ctx, q, k, v, spec: MaskSpec, groups: int):
        out = _empty_output(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for rows_slice, rows, lo, hi in _chunks(spec, q):
            keys = torch.arange(lo, hi, device=q.device)
            o, l_ = _cpu_forward(q[:, :, rows_slice], k[:, :, lo:hi], v[:, :, lo:hi], False, groups,
                                 allowed(spec, rows, keys))
            out[:, :, rows_slice], lse[:, :, rows_slice] = o, l_
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.groups = spec, groups
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        spec, groups = ctx.spec, ctx.groups
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows_slice, rows, lo, hi in _chunks(spec, q):
            keys = torch.arange(lo, hi, device=q.device)
            g = _cpu_backward(dout[:, :, rows_slice], q[:, :, rows_slice], k[:, :, lo:hi], v[:, :, lo:hi],
                              out[:, :, rows_slice], lse[:, :, rows_slice], False, groups, allowed(spec, rows, keys))
            dq[:, :, rows_slice] = g[0]
            dk[:, :, lo:hi] += g[1]
            dv[:, :, lo:hi] += g[2]
        return dq, dk, dv, None, None


# ---- one block with its log-sum-exp (context parallel, and the CPU chunks above) -------------------

def _cpu_forward(q, k, v, causal: bool, groups: int, mask: torch.Tensor | None):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, repeat_kv(k, groups), repeat_kv(v, groups), 0.0, causal, attn_mask=_bias(mask, q.dtype))[:2]
    lse = lse.float()
    if mask is not None:  # the kernel leaves lse 0 (and output 0) on a row that sees no key
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, causal: bool, groups: int, mask: torch.Tensor | None):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype), q, repeat_kv(k, groups), repeat_kv(v, groups), out.to(q.dtype), lse.contiguous(), 0.0,
        causal, attn_mask=_bias(mask, q.dtype))
    return dq, fold_kv(dk, groups), fold_kv(dv, groups)


def block_forward(q, k, v, causal: bool, groups: int, mask: torch.Tensor | None = None, softcap: float = 0.0):
    """(output, lse) of q attending to one block of keys/values; lse (batch, heads, q_len) fp32.
    `mask` (batch or 1, 1, q_len, k_len), True where a query may attend a key (None: `causal` says);
    a row that may attend none gets output 0 and lse -inf, so that merging it changes nothing."""
    if q.device.type == "cpu":
        if softcap:
            raise NotImplementedError("a soft cap in context-parallel attention needs FlexAttention, which has no "
                                      "backward on a CPU: set model.attn_softcap 0 or parallel.cp 1")
        return _cpu_forward(q, k, v, causal, groups, mask)
    return flex.block_attention(q, k, v, causal, groups, mask, softcap)


def block_backward(dout, q, k, v, out, lse, causal: bool, groups: int, mask: torch.Tensor | None = None,
                   softcap: float = 0.0):
    """(dq, dk, dv) fp32 of one block, given the merged output and lse of the whole attention (finite:
    every query attends at least to itself, so a masked key's probability exp(-inf − lse) is 0)."""
    if q.device.type == "cpu":
        dq, dk, dv = _cpu_backward(dout, q, k, v, out, lse, causal, groups, mask)
    else:
        kernel = partial(flex.block_attention, causal=causal, groups=groups, mask=mask, softcap=softcap)
        dq, dk, dv = merged_gradients(kernel, dout, q, k, v, out, lse)
    return dq.float(), dk.float(), dv.float()


def merged_gradients(kernel, dout, q, k, v, out, lse):
    """A block's share of the gradients of a merged attention, by autograd through a kernel that
    returns (o, l) differentiably. The merge is out = Σ_j w_j·o_j with w_j = exp(l_j − lse), so
    ∂out/∂o_j = w_j and ∂out/∂l_j = w_j·(o_j − out): the block's output takes w·dout and its
    log-sum-exp w·⟨dout, o_j − out⟩ (row-wise), and autograd carries them to q, k and v."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        o, l_ = kernel(q, k, v)
        w = torch.exp(l_ - lse)
        do = dout.float()
        grad_o = (w.unsqueeze(-1) * do).to(o.dtype)
        grad_l = w * (do * (o.float() - out.float())).sum(-1)
        return torch.autograd.grad((o, l_), (q, k, v), (grad_o, grad_l.to(l_.dtype)), allow_unused=True)
