"""FlexAttention (`torch.nn.attention.flex_attention`) for the attention backend (`models/attention.py`).

A spec's mask (causal, within documents, within a sliding window) becomes a `BlockMask` without an
S × S tensor: each 128 × 128 tile of (queries, keys) is classified from the smallest and largest
position and document number of its queries and of its keys (O((S/128)²) work), as *skipped* (no
query sees a key), *full* (every query sees every key: the kernel skips the mask there) or *partial*
(the kernel asks `mask_mod` per element). The classification errs only towards partial, which is
exact because `mask_mod` decides inside. One BlockMask serves every layer with the same window in a
forward (the spec's cache). The soft cap is a score modification, cap · tanh(score / cap).

On a GPU flex_attention runs compiled (Inductor writes its kernel; eager FlexAttention is a dense
reference). On a CPU it runs eagerly and only without gradients: torch has no FlexAttention backward
on a CPU.
"""

from __future__ import annotations

import warnings
from functools import cache

import torch

from ultratron.models.masks import MaskSpec, query_positions

try:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
    AVAILABLE = True
except ImportError:  # an older torch
    AVAILABLE = False

BLOCK = 128  # FlexAttention's tile


@cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def _kernel(q: torch.Tensor):
    if not AVAILABLE:
        raise RuntimeError("model.attention=flex needs torch.nn.attention.flex_attention (torch >= 2.5); use sdpa")
    return _compiled() if q.is_cuda else _eager


def _eager(*args, **kwargs):
    with warnings.catch_warnings():  # "flex_attention called without torch.compile": eager is meant here
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(*args, **kwargs)


def _refuse_cpu_backward(q, k, v) -> None:
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("model.attention=flex cannot train on a CPU: torch's FlexAttention has no CPU backward "
                         "(it runs there for inference only); use model.attention=auto or sdpa")


def _softcap_mod(cap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return score_mod


def flex_attend(q, k, v, spec: MaskSpec, groups: int) -> torch.Tensor:
    _refuse_cpu_backward(q, k, v)
    q_pos = query_positions(spec, q.shape[2], q.device)
    key = ("flex", spec.window, tuple(q.shape), k.shape[2], q.device)
    block_mask = spec.cache.get(key)
    if block_mask is None:
        block_mask = spec.cache[key] = block_mask_of(spec, q_pos, torch.arange(k.shape[2], device=q.device))
    score_mod = _softcap_mod(spec.softcap) if spec.softcap else None
    return _kernel(q)(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=groups > 1)


def _tile(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of BLOCK along the last dim: (min, max), the last tile padded with its last value."""
    pad = -x.shape[-1] % BLOCK
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    tiles = x.unflatten(-1, (-1, BLOCK))
    return tiles.amin(-1), tiles.amax(-1)


def block_mask_of(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> BlockMask:
    """The BlockMask of queries at q_pos (1 or batch, n) and keys at k_pos (m,) (module docstring)."""
    documents, window = spec.documents, spec.window
    batch = documents.shape[0] if documents is not None else q_pos.shape[0]
    q_pos = q_pos.expand(batch, -1)
    q_lo, q_hi = (t[:, :, None] for t in _tile(q_pos))  # (batch, q tiles, 1)
    k_lo, k_hi = (t[None, None, :] for t in _tile(k_pos))  # (1, 1, k tiles)
    some, every = k_lo <= q_hi, k_hi <= q_lo
    if window:
        some, every = some & (q_lo - k_hi < window), every & (q_hi - k_lo < window)
    if documents is not None:
        qd_lo, qd_hi = (t[:, :, None] for t in _tile(documents.gather(1, q_pos)))
        kd_lo, kd_hi = (t[:, None, :] for t in _tile(documents[:, k_pos]))
        some = some & (qd_lo <= kd_hi) & (kd_lo <= qd_hi)
        every = every & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
    partial = some & ~every

    def listed(blocks: torch.Tensor):  # (counts, indices) with the listed tiles first, heads broadcast
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
        return blocks.sum(-1)[:, None].to(torch.int32), order[:, None].to(torch.int32)

    return BlockMask.from_kv_blocks(*listed(partial), *listed(every), BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod_of(spec, q_pos, k_pos),
                                    seq_lengths=(q_pos.shape[1], k_pos.shape[0]))


def mask_mod_of(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """FlexAttention's per-element rule for queries at q_pos (batch, n) and keys at k_pos (m,)."""
    documents, window = spec.documents, spec.window
    shared = q_pos.shape[0] == 1  # the same positions for every row (the BlockMask broadcasts over the batch)

    def mask_mod(b, h, q_idx, kv_idx):
        q, k = (q_pos[0, q_idx] if shared else q_pos[b, q_idx]), k_pos[kv_idx]
        ok = k <= q
        if window:
            ok = ok & (q - k < window)
        if documents is not None:
            ok = ok & (documents[b, q] == documents[b, k])
        return ok
    return mask_mod


def _dense_mask_mod(mask: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, 0, q_idx, kv_idx]
    return mask_mod


def block_attention(q, k, v, causal: bool, groups: int, mask: torch.Tensor | None, softcap: float = 0.0):
    """(output, lse fp32) of one context-parallel block by FlexAttention, differentiable where grad is
    enabled (`attention.merged_gradients`). `mask` (batch or 1, 1, q_len, k_len) is the block's own
    (a block is at most the local sequence long, never the whole S × S); None: `causal` or nothing."""
    from torch.nn.attention.flex_attention import create_block_mask

    n, m = q.shape[2], k.shape[2]
    if mask is not None:
        mask = mask.expand(q.shape[0], -1, -1, -1)
        block_mask = create_block_mask(_dense_mask_mod(mask), q.shape[0], None, n, m, device=q.device)
    elif causal:
        block_mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, n, m, device=q.device)
    else:
        block_mask = None
    score_mod = _softcap_mod(softcap) if softcap else None
    out, aux = _kernel(q)(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=groups > 1,
                          return_aux=AuxRequest(lse=True))
    return out, aux.lse.float()
