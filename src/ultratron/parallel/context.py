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

Either way each block runs through the model's attention backend (`models/attention.py`:
`block_forward`, `block_backward`), which returns the log-sum-exp and has a backward that takes the
merged output and lse (so each block's gradient is exact): the CPU flash kernel on a CPU,
FlexAttention on a GPU. PyTorch's `context_parallel` has no CPU sharding rule for the CPU kernel,
hence this module. Grouped-query heads are repeated per block for the kernel and their gradients
summed back; K/V travel unrepeated.

The mask is the model's `MaskSpec` (`models/masks.py`), as one process takes it: under document
masking the shard keeps the whole micro-batch's document numbers (every rank holds them already),
and a sliding window is a number; each block builds its own dense mask from its queries' and keys'
positions in the sequence (a block's size, never the sequence's square). A block the mask hides
wholly (other documents, or beyond the window) is skipped; a query row that sees no key of a block
gets lse −inf from it, which the merge treats as no contribution (and whose backward gives it no
gradient), so no nan appears. Soft-capped scores run on a GPU only (FlexAttention; the CPU kernel
has none).

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
from ultratron.models.attention import block_backward, block_forward
from ultratron.models.masks import MaskSpec, allowed
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


# ---- one block of attention, with its log-sum-exp: the attention backend's kernels -----------

def _block_mask(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, rows: slice, keys: slice):
    """The dense mask of one block (its query rows × its keys, never the whole sequence), or None where
    only causality masks (the kernels' causal flag and the ring's block order handle that)."""
    if spec.documents is None and not spec.window:
        return None
    return allowed(spec, q_pos[rows][None], k_pos[keys])


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


def _seen(mask: torch.Tensor | None) -> bool:
    """Whether a block has a key some query may attend (a block the documents hide wholly is skipped)."""
    return mask is None or bool(mask.any())


def _attend_block(out, lse, q, kv, rows: slice, keys: slice, causal: bool, groups: int, mask, softcap: float):
    """Merge the attention of q's `rows` to kv's (K and V stacked) `keys` into out and lse."""
    if not _seen(mask):
        return out, lse
    part = block_forward(q[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys], causal, groups, mask, softcap)
    if rows == slice(None):
        return merge(out, lse, *part)
    out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], *part)
    return out, lse


def _block_gradients(dq, dkv, dout, q, kv, out, lse, rows: slice, keys: slice, causal: bool, groups: int,
                     mask, softcap: float) -> None:
    """Add that block's gradients: its query rows' into dq, its keys' and values' into dkv."""
    if not _seen(mask):
        return
    g = block_backward(dout[:, :, rows], q[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys], out[:, :, rows],
                       lse[:, :, rows], causal, groups, mask, softcap)
    dq[:, :, rows] += g[0]
    dkv[0, :, :, keys] += g[1]
    dkv[1, :, :, keys] += g[2]


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: MaskSpec, groups: int, group, rank: int, cp: int):
        c, seq = q.shape[2] // 2, q.shape[2] * cp
        mine = shard_positions(seq, cp, rank, q.device)
        out, lse = _empty_output(q)
        kv = torch.stack([k, v])
        for step in range(cp):
            if step < cp - 1:
                incoming, requests = _exchange(kv, group, rank, cp)
            source = (rank - step) % cp
            rows, keys, causal = _ring_block(step, source, rank, c)
            block_mask = _block_mask(spec, mine, shard_positions(seq, cp, source, q.device), rows, keys)
            out, lse = _attend_block(out, lse, q, kv, rows, keys, causal, groups, block_mask, spec.softcap)
            if step < cp - 1:
                _wait(requests)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.groups, ctx.group, ctx.rank, ctx.cp = spec, groups, group, rank, cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        spec, groups, group, rank, cp = ctx.spec, ctx.groups, ctx.group, ctx.rank, ctx.cp
        c, seq = q.shape[2] // 2, q.shape[2] * cp
        mine = shard_positions(seq, cp, rank, q.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        for step in range(cp):
            if step < cp - 1:
                incoming, requests = _exchange(kv, group, rank, cp)
            source = (rank - step) % cp
            rows, keys, causal = _ring_block(step, source, rank, c)
            block_mask = _block_mask(spec, mine, shard_positions(seq, cp, source, q.device), rows, keys)
            _block_gradients(dq, dkv, dout, q, kv, out, lse, rows, keys, causal, groups, block_mask, spec.softcap)
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
    def forward(ctx, q, k, v, spec: MaskSpec, groups: int, group, rank: int, cp: int):
        full = _gather_natural(torch.stack([k, v]), group, cp)  # (2, b, kv heads, seq, d) in sequence order
        mine, every = shard_positions(full.shape[3], cp, rank, q.device), torch.arange(full.shape[3], device=q.device)
        out, lse = _empty_output(q)
        for rows, keys, causal in _allgather_blocks(rank, cp, q.shape[2] // 2):
            block_mask = _block_mask(spec, mine, every, rows, keys)
            out, lse = _attend_block(out, lse, q, full, rows, keys, causal, groups, block_mask, spec.softcap)
        ctx.save_for_backward(q, full, out, lse)
        ctx.spec, ctx.groups, ctx.group, ctx.rank, ctx.cp = spec, groups, group, rank, cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, full, out, lse = ctx.saved_tensors
        spec, groups, group, rank, cp = ctx.spec, ctx.groups, ctx.group, ctx.rank, ctx.cp
        mine, every = shard_positions(full.shape[3], cp, rank, q.device), torch.arange(full.shape[3], device=q.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dfull = torch.zeros(full.shape, dtype=torch.float32, device=q.device)
        for rows, keys, causal in _allgather_blocks(rank, cp, q.shape[2] // 2):
            block_mask = _block_mask(spec, mine, every, rows, keys)
            _block_gradients(dq, dfull, dout, q, full, out, lse, rows, keys, causal, groups, block_mask,
                             spec.softcap)
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

    def __call__(self, q, k, v, spec: MaskSpec | None, groups: int) -> torch.Tensor:
        """`spec` (None: causal): the model's mask; its documents (under document masking) cover the
        whole sequence, every key of it in sequence order, and this rank's queries are its shard."""
        if not self.active:
            return self.local(q, k, v, spec, groups)
        spec = spec or MaskSpec()
        if spec.documents is not None and spec.documents.shape[1] != q.shape[2] * self.cp:
            raise ValueError(f"context-parallel attention: documents of {spec.documents.shape[1]} tokens for "
                             f"{q.shape[2]} local queries; they must cover each of the sequence's "
                             f"{q.shape[2] * self.cp} keys")
        dtype = q.dtype
        if q.device.type == "cpu" and dtype == torch.bfloat16:  # as models/attention.py: fp32 on CPU
            q, k, v = q.float(), k.float(), v.float()
        with torch.autocast(q.device.type, enabled=False):
            fn = _Ring if self.mode == "ring" else _AllGather
            return fn.apply(q, k, v, spec, groups, self.group, self.rank, self.cp).to(dtype)


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
