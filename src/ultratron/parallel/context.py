"""Context parallelism: the sequence split over the `cp` ranks, attention computed across them.

Each cp rank holds 2 of the sequence's 2·cp equal chunks — chunk r and chunk 2·cp−1−r (the
zig-zag / head-tail split of Liu et al. 2023's ring attention as Megatron-LM balances it): under a
causal mask early tokens attend to little and late ones to much, and the pair gives every rank the
same work. Token ids, targets and RoPE positions are cut alike (`shard_batch`), so each rank's
embedding, MLP, loss and RoPE run on its own tokens; only attention needs the others' keys and
values, in one of two ways (`parallel.cp_attention`):

  ring       K/V blocks travel round the ring in cp−1 steps while each rank attends to the block it
             holds (the next one is already on its way); the partial outputs are merged by their
             log-sum-exp: lse = log(e^lse_a + e^lse_b), out = e^(lse_a−lse)·out_a + e^(lse_b−lse)·out_b.
             With the zig-zag split, block j < r is seen by all local queries but only its first
             chunk, block j > r by the second local chunk only, both unmasked; block r is causal.
             Backward sends the blocks round again with their gradient accumulators, which reach
             their owners after a last hop. Memory: the local q, k, v, output and lse only.
  allgather  all-gather K and V once (what Llama 3 trained long context with, Dubey et al. 2024:
             simple, and cheap while GQA keeps K/V small), attend to the causal prefix of each
             local chunk; backward sums the K/V gradients over the ranks.

Either way the kernel is PyTorch's own fused attention on a block, which returns the log-sum-exp
and has a backward that takes the merged output and lse (so each block's gradient is exact):
`_scaled_dot_product_flash_attention_for_cpu` on CPU, the memory-efficient kernel on CUDA (it
takes fp32 as well as bf16). PyTorch's `context_parallel` has no CPU sharding rule for the CPU
kernel, hence this module. Grouped-query heads are repeated per block for the kernel and their
gradients summed back; K/V travel unrepeated.

Under document masking (packed documents that must not see each other) the shard keeps the whole
micro-batch's document numbers, which every rank holds already: the model builds from them each
local query's mask row over every key of the sequence and the tokens' positions within their
documents, and each block takes its piece of that mask (the CPU kernel as an additive −inf bias;
the CUDA path is not wired yet and refuses). A block the documents hide wholly is skipped; a query
row that sees no key of a block gets lse −inf from it, which the merge treats as no contribution
(and whose backward gives it no gradient), so no nan appears.

The attention function is swapped into the model from outside (`ParallelPlan.set_attention`); it
runs across the ranks only inside the axis' step context — the training step and validation, whose
micro-batches `ContextAxis.shard` cut — and the family's own attention otherwise (sampling runs the
whole context on every rank). The shard carries its tokens' positions (`MicroBatch.positions`),
which the model's RoPE takes, inside pipeline stages too. Gradients of every parameter are averaged
over dp × cp (FSDP/DDP on the flattened mesh), since the cp ranks see different tokens of the same
sequences; the loss is averaged over the cp ranks here, each shard's mean weighted by its share of
the micro-batch's counted targets (`MicroBatch.loss_weight`), so that it is the micro-batch's mean.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ultratron.data.loader import IGNORE
from ultratron.models.plan import ParallelPlan
from ultratron.parallel.axis import Axis, MicroBatch
from ultratron.parallel.dims import ParallelDims

MODES = ("ring", "allgather")


# ---- the sequence split -------------------------------------------------------------------------

def shard_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions (in the full sequence) of rank's tokens: chunks rank and 2·cp−1−rank."""
    c = seq // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of `shard_sequence`, for tests)."""
    cp = len(shards)
    chunks: list = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        chunks[rank], chunks[2 * cp - 1 - rank] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


# ---- one block of attention, with its log-sum-exp --------------------------------------------

def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradients of repeated kv heads back onto their kv head."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as the kernels take it: 0 where allowed, -inf elsewhere."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _no_cuda_mask(q: torch.Tensor, mask: torch.Tensor | None) -> None:
    if mask is not None and q.device.type != "cpu":
        raise NotImplementedError("document masking under context parallel runs on CPU only so far: the CUDA "
                                  "kernel's attention bias is not wired in; use cp=1 or data.document_masking=off")


def block_forward(q, k, v, causal: bool, groups: int, mask: torch.Tensor | None = None):
    """(output, lse) of q attending to one block of keys/values; lse (batch, heads, q_len) fp32.
    `mask` (batch, 1, q_len, k_len), True where a query may attend a key: a row that may attend
    none gets output 0 and lse -inf, so that merging it changes nothing."""
    k, v = _repeat(k, groups), _repeat(v, groups)
    _no_cuda_mask(q, mask)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                               attn_mask=_bias(mask, q.dtype))
        lse = lse.float()
        if mask is not None:  # the kernel leaves lse 0 (and output 0) on a row that sees no key
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out, lse
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
    return out, lse[..., :q.shape[2]].float()


def block_backward(dout, q, k, v, out, lse, causal: bool, groups: int, mask: torch.Tensor | None = None):
    """(dq, dk, dv) of one block, given the merged output and lse of the whole attention (finite:
    every query attends at least to itself, so a masked key's probability exp(-inf − lse) is 0)."""
    kr, vr = _repeat(k, groups), _repeat(v, groups)
    out = out.to(q.dtype)
    _no_cuda_mask(q, mask)
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, kr, vr, out, lse.contiguous(), 0.0, causal, attn_mask=_bias(mask, q.dtype))
    else:
        pad = -lse.shape[-1] % 32  # the efficient kernel's lse rows come in blocks of 32
        lse = torch.nn.functional.pad(lse, (0, pad)).contiguous()
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.to(q.dtype).contiguous(), q, kr, vr, torch.empty(0, device=q.device), out, lse, empty, empty, 0.0,
            [True, True, True, False], causal)
    return dq.float(), _fold(dk, groups).float(), _fold(dv, groups).float()


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Combine two partial attentions over disjoint keys by their log-sum-exps (fp32). A row that has
    seen no key in either (lse −inf in both, under document masking) stays output 0, lse −inf."""
    new = torch.logaddexp(lse, block_lse)
    shift = new.masked_fill(new == float("-inf"), 0.0)  # −inf − −inf would be nan; the weights are 0 there
    out = out * torch.exp(lse - shift).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - shift).unsqueeze(-1)
    return out, new


# ---- the ring --------------------------------------------------------------------------------

def _exchange(tensor: torch.Tensor, group, rank: int, cp: int, tag: int = 0) -> tuple[torch.Tensor, list]:
    """Send `tensor` to the next cp rank and receive the previous one's, asynchronously."""
    received = torch.empty_like(tensor)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), nxt, group, tag),
           dist.P2POp(dist.irecv, received, prev, group, tag)]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _empty_output(q: torch.Tensor):
    """The fp32 output accumulator (batch, heads, seq, head_dim) laid out as (batch, seq, heads, head_dim)
    in memory, as PyTorch's kernels return it, so the model's transpose back is a view, not a copy;
    and the log-sum-exp, -inf where nothing has been attended yet."""
    b, h, s, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
    return out, torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)


def _ring_block(step: int, source: int, rank: int, c: int) -> tuple[slice, slice, bool]:
    """Which local query rows attend to which keys of the block from `source`, and whether causally."""
    if step == 0:
        return slice(None), slice(None), True
    if source < rank:  # its first chunk precedes both of ours; its second follows both
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False  # both its chunks precede our second chunk and follow our first


def _shard_columns(mask: torch.Tensor | None, cp: int, source: int) -> torch.Tensor | None:
    """The mask's columns (every key of the sequence, in order) of the keys `source` holds."""
    return None if mask is None else shard_sequence(mask, cp, source, dim=3)


def _block_mask(mask: torch.Tensor | None, rows: slice, keys: slice) -> torch.Tensor | None:
    return None if mask is None else mask[:, :, rows, keys]


def _seen(mask: torch.Tensor | None) -> bool:
    """Whether a block has a key some query may attend (a block the documents hide wholly is skipped)."""
    return mask is None or bool(mask.any())


def _attend_block(out, lse, q, kv, rows: slice, keys: slice, causal: bool, groups: int, mask):
    """Merge the attention of q's `rows` to kv's (K and V stacked) `keys` into out and lse."""
    if not _seen(mask):
        return out, lse
    part = block_forward(q[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys], causal, groups, mask)
    if rows == slice(None):
        return merge(out, lse, *part)
    out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], *part)
    return out, lse


def _block_gradients(dq, dkv, dout, q, kv, out, lse, rows: slice, keys: slice, causal: bool, groups: int,
                     mask) -> None:
    """Add that block's gradients: its query rows' into dq, its keys' and values' into dkv."""
    if not _seen(mask):
        return
    g = block_backward(dout[:, :, rows], q[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys], out[:, :, rows],
                       lse[:, :, rows], causal, groups, mask)
    dq[:, :, rows] += g[0]
    dkv[0, :, :, keys] += g[1]
    dkv[1, :, :, keys] += g[2]


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, groups: int, group, rank: int, cp: int):
        c = q.shape[2] // 2
        out, lse = _empty_output(q)
        kv = torch.stack([k, v])
        for step in range(cp):
            if step < cp - 1:
                incoming, requests = _exchange(kv, group, rank, cp)
            source = (rank - step) % cp
            rows, keys, causal = _ring_block(step, source, rank, c)
            block_mask = _block_mask(_shard_columns(mask, cp, source), rows, keys)
            out, lse = _attend_block(out, lse, q, kv, rows, keys, causal, groups, block_mask)
            if step < cp - 1:
                _wait(requests)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.groups, ctx.group, ctx.rank, ctx.cp = groups, group, rank, cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        groups, group, rank, cp = ctx.groups, ctx.group, ctx.rank, ctx.cp
        c = q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        for step in range(cp):
            if step < cp - 1:
                incoming, requests = _exchange(kv, group, rank, cp)
            source = (rank - step) % cp
            rows, keys, causal = _ring_block(step, source, rank, c)
            block_mask = _block_mask(_shard_columns(mask, cp, source), rows, keys)
            _block_gradients(dq, dkv, dout, q, kv, out, lse, rows, keys, causal, groups, block_mask)
            dkv, dkv_requests = _exchange(dkv, group, rank, cp, tag=1)  # on to the next rank; the last hop: home
            _wait(dkv_requests)
            if step < cp - 1:
                _wait(requests)
                kv = incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def _allgather_blocks(rank: int, cp: int, c: int):
    """(query rows, keys in sequence order, causal) of each block a rank's queries attend to: each
    local chunk to the keys before it, unmasked, and to its own keys, causally."""
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        rows = slice(half * c, (half + 1) * c)
        if chunk > 0:
            yield rows, slice(0, chunk * c), False
        yield rows, slice(chunk * c, (chunk + 1) * c), True


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, groups: int, group, rank: int, cp: int):
        full = _gather_natural(torch.stack([k, v]), group, cp)  # (2, b, kv heads, seq, d) in sequence order
        out, lse = _empty_output(q)
        for rows, keys, causal in _allgather_blocks(rank, cp, q.shape[2] // 2):
            out, lse = _attend_block(out, lse, q, full, rows, keys, causal, groups, _block_mask(mask, rows, keys))
        ctx.save_for_backward(q, full, out, lse, mask)
        ctx.groups, ctx.group, ctx.rank, ctx.cp = groups, group, rank, cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, full, out, lse, mask = ctx.saved_tensors
        groups, group, rank, cp = ctx.groups, ctx.group, ctx.rank, ctx.cp
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dfull = torch.zeros(full.shape, dtype=torch.float32, device=q.device)
        for rows, keys, causal in _allgather_blocks(rank, cp, q.shape[2] // 2):
            block_mask = _block_mask(mask, rows, keys)
            _block_gradients(dq, dfull, dout, q, full, out, lse, rows, keys, causal, groups, block_mask)
        dist.all_reduce(dfull, group=group)  # every rank's queries' share of each key and value
        mine = shard_sequence(dfull, cp, rank, dim=3)
        return dq.to(q.dtype), mine[0].to(q.dtype), mine[1].to(q.dtype), None, None, None, None, None


def _gather_natural(kv: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Every rank's (zig-zag) shard of K and V, put back in sequence order."""
    shards = [torch.empty_like(kv) for _ in range(cp)]
    dist.all_gather(shards, kv.contiguous(), group=group)
    return unshard_sequence(shards, dim=3)


class ContextParallelAttention:
    """The attention function of every block under context parallel: across the cp ranks while
    `active` (the axis' step context), `local` (the family's own attention) otherwise."""

    def __init__(self, group, rank: int, cp: int, mode: str = "ring", local=None):
        if mode not in MODES:
            raise ValueError(f"context-parallel attention {mode!r}: one of {', '.join(MODES)}")
        self.group, self.rank, self.cp, self.mode, self.local = group, rank, cp, mode, local
        self.active = False

    def __call__(self, q, k, v, mask, groups: int) -> torch.Tensor:
        """`mask` (under document masking; None: causal) has a row for each local query and a column
        for each key of the whole sequence, in sequence order (`models.llama.model.document_layout`)."""
        if not self.active:
            return self.local(q, k, v, mask, groups)
        if mask is not None and mask.shape[-2:] != (q.shape[2], q.shape[2] * self.cp):
            raise ValueError(f"context-parallel attention: a mask of {tuple(mask.shape[-2:])} (queries, keys) for "
                             f"{q.shape[2]} local queries; it needs a column for each of the sequence's "
                             f"{q.shape[2] * self.cp} keys")
        dtype = q.dtype
        if q.device.type == "cpu" and dtype == torch.bfloat16:  # as sdpa_attention: fp32 on CPU
            q, k, v = q.float(), k.float(), v.float()
        with torch.autocast(q.device.type, enabled=False):
            fn = _Ring if self.mode == "ring" else _AllGather
            return fn.apply(q, k, v, mask, groups, self.group, self.rank, self.cp).to(dtype)


# ---- the axis ---------------------------------------------------------------------------------

class ContextAxis(Axis):
    name = "context"

    def __init__(self, attention: ContextParallelAttention, dims: ParallelDims):
        self.attention, self.cp, self.rank = attention, dims.cp, dims.cp_rank

    def shard(self, batch: MicroBatch) -> MicroBatch:
        """This rank's two chunks of every sequence: token ids, targets and their positions alike. The
        documents stay whole: with the positions they give each local query's mask row over every key
        (and the tokens' positions within their documents), with no communication."""
        seq = batch.inputs.shape[1]
        positions = shard_positions(seq, self.cp, self.rank, batch.inputs.device)
        if batch.positions is not None:
            positions = batch.positions[positions]
        targets = shard_sequence(batch.targets, self.cp, self.rank)
        return MicroBatch(shard_sequence(batch.inputs, self.cp, self.rank), targets, positions, batch.documents,
                          self._loss_weight(batch.targets, targets))

    def _loss_weight(self, whole: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """cp × this shard's share of the micro-batch's counted targets: its mean loss times this,
        averaged over the cp ranks, is the micro-batch's mean (exactly 1 where the shares are equal;
        not where documents or a chat's prompts leave some targets out of the loss)."""
        return self.cp * (mine != IGNORE).sum() / (whole != IGNORE).sum().clamp(min=1)

    @contextlib.contextmanager
    def step_context(self, training: bool):
        """Attention across the cp ranks (the micro-batches are this rank's shards)."""
        self.attention.active = True
        try:
            yield
        finally:
            self.attention.active = False

    def average_loss(self, value: torch.Tensor, training: bool) -> torch.Tensor:
        """Each cp rank holds as many tokens of the same sequences: the mean of their means."""
        return self.sum_over_data(value) / self.cp

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(value, group=self.attention.group)
        return value


def apply_context_parallel(model: nn.Module, dims: ParallelDims, plan: ParallelPlan,
                           mode: str = "ring") -> tuple[nn.Module, Axis | None]:
    """Give every block the context-parallel attention."""
    if dims.cp == 1:
        return model, None
    group = dims.cp_mesh.get_group()
    attention = ContextParallelAttention(group, dims.cp_rank, dims.cp, mode, local=plan.attention)
    plan.set_attention(model, attention)
    for moe in plan.moe_layers(model):  # the balancing loss counts the whole micro-batch's routing
        moe.router.share_counts = partial(_summed, group=group)
    return model, ContextAxis(attention, dims)


def _summed(counts: torch.Tensor, group) -> torch.Tensor:
    counts = counts.clone()
    dist.all_reduce(counts, group=group)
    return counts
