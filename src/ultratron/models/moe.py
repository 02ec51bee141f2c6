"""A mixture-of-experts feed-forward layer in plain PyTorch: a top-k router, routed SwiGLU experts
held as one 3-D weight per projection, optional shared experts, load balancing, and dropless or
capacity-limited routing.

Router (Shazeer et al. 2017; Fedus et al. 2021): scores = softmax (Mixtral, Qwen3) or sigmoid
(DeepSeek-V3) of x·W_r; each token goes to the k experts of highest score (+ the balancing bias
below), weighted by their scores, rescaled to sum to 1 when `norm_topk`.

Balancing, either or both:
  * the Switch Transformer auxiliary loss α·E·Σ_i f_i·P_i (Fedus et al. 2021, α = 0.01), with
    f_i the share of the routed token slots expert i got and P_i its mean score (sigmoid scores
    normalised per token first, as DeepSeek-V3's sequence-wise loss does). Its gradient is added
    in backward without touching the training loss (the loss logged stays the cross-entropy):
    `_BalanceAndRecord` passes the aux gradient α·scale into backward, the way Megatron-LM's
    MoEAuxLossAutoScaler does, so it works inside pipeline stages too. `aux_loss_scale` is the
    weight of one micro-batch in the step's loss (1/micro-batches under gradient accumulation;
    the training step sets it).
  * DeepSeek-V3's bias without an auxiliary loss (DeepSeek-AI 2024, §2.1.2): a per-expert bias
    added to the scores only to choose the experts; after each step the trainer moves it by
    `bias_update` toward even load (`Router.update_bias`). The bias is a persistent buffer, so it
    is checkpointed with the weights.

Under context parallel each rank routes its part of the sequences; the counts behind f_i are summed
over the cp ranks first (`share_counts`), and each rank's P_i is its own tokens' mean — the mean of
the ranks' losses then has the gradient of the whole micro-batch's loss, as in one process.

Dropless (capacity_factor 0): every token slot is computed, however uneven the load. With a
capacity factor c an expert takes at most ceil(c·k·T/E) of a micro-batch's T tokens, first come
first served in token order (Fedus et al. 2021); the rest skip it (the residual carries them).
Capacity applies in training only; evaluation and inference are dropless.

Statistics for the metrics (tokens per expert, dropped slots, aux loss) are recorded once per
trained micro-batch — in backward, so that recomputed forwards do not count twice — into
`Router.records`; the trainer sums the step's last micro-batches (`Router.totals`: a pipeline
schedule's first step also runs a shape-inference pass through its stages, whose record is not
the data's) and clears them.

The experts run through `MoE.dispatch(tokens, choice, weights, keep, experts)`: `local_dispatch`
here (sort the token slots by expert, one matmul chain per expert, weighted sum back). Expert
parallelism (`ultratron.parallel.expert`) swaps in one that sends the slots to the rank
holding their expert with all-to-all and back; the model never knows.

Routing's data stays on the device: the experts' rows are sorted on the device and run through
grouped matmuls that take each expert's rows from a device tensor of counts (`grouped_swiglu`), and
dropped slots are sorted last and masked, so no layer waits for the host to learn how many rows an
expert got. Where routing's data must reach the host, it does in one place, `counts_on_host`, the
slots per expert as Python ints: expert parallelism's all-to-all takes its split sizes as Python
ints (one read per layer: the next layer's routing depends on this one's output, so the reads cannot
be gathered into one per step), and fp32 on a GPU, where the grouped matmul does not run. The
counts are a scatter-add, not `bincount`, whose length depends on the largest index, so every shape
is known without the data: `ultratron simulate`, which runs the step on fake tensors without values,
puts balanced counts in `counts_on_host`'s place and nothing else changes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor | list[int], w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert on its rows: x (N, dim) holds counts[e] rows for expert e in order (rows
    past the last expert's, dropped slots, come out zero); w1, w3 (E, hidden, dim), w2 (E, dim, hidden).
    `counts` a tensor on x's device: grouped matmuls (`torch._grouped_mm`) that take the rows'
    boundaries from the device, so the host never waits for routing's data; as Python ints (expert
    parallel has them on the host anyway): the same. Where the grouped matmul does not run (fp32 off a
    CPU: a GPU's kernel, and the fake one of `ultratron simulate`, take bf16 only), one matmul chain
    per expert, with the counts read to the host once."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    if dtype != torch.bfloat16 and (x.device.type != "cpu" or is_fake(x)):  # (a GPU's kernel takes bf16 only)
        return _swiglu_per_expert(x, counts_on_host(counts, x.shape[0]) if torch.is_tensor(counts) else counts,
                                  w1, w2, w3)
    if not torch.is_tensor(counts):
        counts = torch.tensor(counts, dtype=torch.long).to(x.device, non_blocking=True)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    # a grouped matmul leaves the rows past the last group unwritten, in its output and in its input's
    # gradient: they are zeroed both ways (`where`), so a dropped slot adds nothing, nor to its token
    routed = (torch.arange(x.shape[0], device=x.device) < offsets[-1]).unsqueeze(-1)
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))  # (autocast does not cast a grouped matmul)
    x = torch.where(routed, x, 0)
    hidden = F.silu(torch._grouped_mm(x, w1.transpose(1, 2), offs=offsets)) * torch._grouped_mm(
        x, w3.transpose(1, 2), offs=offsets)
    return torch.where(routed, torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offsets), 0)


def _swiglu_per_expert(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
                       w3: torch.Tensor) -> torch.Tensor:
    outs = []
    for e, rows in enumerate(x[:sum(counts)].split(counts)):
        if rows.shape[0]:
            outs.append((F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t())
    out = torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])
    return torch.cat([out, out.new_zeros(x.shape[0] - out.shape[0], out.shape[1])])


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three 3-D weights, expert-major, so a parallel layout can split them along
    the experts (dim 0) and the hidden width (dim 1 of w1/w3, dim 2 of w2)."""

    HIDDEN_DIMS = {"w1": 1, "w3": 1, "w2": 2}

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        return grouped_swiglu(x, counts, self.w1, self.w2, self.w3)


def count_slots(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Slots per expert (int64, n_experts) among `flat`, expert indices; the index n_experts marks a
    dropped slot and is not counted. The counts `bincount` gives, at a length known without the data."""
    bins = torch.zeros(n_experts + 1, dtype=torch.long, device=flat.device)
    return bins.scatter_add_(0, flat, torch.ones_like(flat))[:n_experts]


def counts_on_host(counts: torch.Tensor, routed: int) -> list[int]:
    """Slots per expert (a 1-D tensor of them) as Python ints: routing's one read of the data on the
    host. `routed` is the number of slots a rank's router chose (T·k), which the balanced stand-in of
    `ultratron simulate` (which replaces this function) spreads over the experts; a real read needs
    only the counts."""
    return counts.tolist()


def sort_by_expert(choice: torch.Tensor, keep: torch.Tensor | None, n_experts: int):
    """(token index of each slot in expert order, the order over the flat slots, rows per expert as
    a tensor). Dropped slots sort after every expert's (`grouped_swiglu` gives them zero rows).
    choice (T, k) → T·k slots, slot s = token s // k. Nothing is read to the host."""
    flat = choice.flatten()
    if keep is not None:
        flat = flat.masked_fill(~keep.flatten(), n_experts)
    order = torch.argsort(flat, stable=True)
    return order // choice.shape[1], order, count_slots(flat, n_experts)


def local_dispatch(tokens: torch.Tensor, choice: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None,
                   experts: GroupedExperts) -> torch.Tensor:
    """Every expert on this process: each kept slot's token through its expert, weighted, summed."""
    token, slot, counts = sort_by_expert(choice, keep, experts.n_experts)
    return combine(tokens, experts(tokens[token], counts), token, weights.flatten()[slot])


def combine(tokens: torch.Tensor, out: torch.Tensor, token: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The experts' rows, each weighted, summed back onto its token."""
    out = out * weight.unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(tokens).index_add(0, token, out.to(tokens.dtype))


class _BalanceAndRecord(torch.autograd.Function):
    """Identity on the routing weights; in backward, the aux loss's gradient (its coefficient × the
    micro-batch's weight in the step) joins, and the router records the micro-batch's statistics."""

    @staticmethod
    def forward(ctx, weights, aux, router, load, dropped):
        ctx.router, ctx.stats = router, (load, dropped, aux.detach())
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad):
        router = ctx.router
        router.record(*ctx.stats)
        aux_grad = torch.full((), router.aux_loss * router.aux_loss_scale, device=grad.device)
        return grad, aux_grad, None, None, None


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, score: str = "softmax", norm_topk: bool = True,
                 aux_loss: float = 0.01, bias_update: float = 0.0, capacity_factor: float = 0.0):
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"router score {score!r}: softmax or sigmoid")
        self.n_experts, self.top_k, self.score, self.norm_topk = n_experts, top_k, score, norm_topk
        self.aux_loss, self.bias_update, self.capacity_factor = aux_loss, bias_update, capacity_factor
        self.aux_loss_scale = 1.0
        # counts → their sum over the ranks holding other tokens of the same sequences (context
        # parallel sets it), so that f_i is the micro-batch's, as in one process
        self.share_counts = None
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(n_experts))  # DeepSeek-V3's balancing bias
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (load, dropped, aux) each

    def capacity(self, n_tokens: int) -> int | None:
        """Slots an expert takes per micro-batch, None when dropless (or not training)."""
        if self.capacity_factor <= 0 or not self.training:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def forward(self, x: torch.Tensor):
        """x (T, dim) → (choice (T, k) expert indices, weights (T, k) fp32, keep (T, k) bool or None)."""
        scores = self.gate(x).float()
        scores = scores.softmax(-1) if self.score == "softmax" else scores.sigmoid()
        choice = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices  # the bias only chooses
        weights = scores.gather(-1, choice)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        load = count_slots(choice.flatten(), self.n_experts).float()
        keep, capacity = None, self.capacity(x.shape[0])
        if capacity is not None:
            keep = self._within_capacity(choice, capacity)
        if torch.is_grad_enabled() and self.training:
            shared = self.share_counts(load) if self.share_counts is not None else load
            slots = shared / shared.sum()  # f_i: the share of the routed slots
            probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            aux = self.n_experts * (slots * probs.mean(0)).sum()
            dropped = (~keep).sum().float() if keep is not None else torch.zeros((), device=x.device)
            weights = _BalanceAndRecord.apply(weights, aux, self, load, dropped)
        return choice, weights, keep

    def _within_capacity(self, choice: torch.Tensor, capacity: int) -> torch.Tensor:
        """Each slot's place in its expert's queue (token order) below the capacity."""
        flat = choice.flatten()
        order = torch.argsort(flat, stable=True)
        counts = count_slots(flat, self.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        place = torch.empty_like(flat)
        place[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        return (place < capacity).view_as(choice)

    @torch.no_grad()
    def record(self, load: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor) -> None:
        self.records.append((load, dropped, aux))

    def totals(self, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(slots per expert, dropped slots, aux loss sum, micro-batches) of the last `last` records."""
        records = self.records[-last:] if last else self.records
        if not records:
            zero = self.expert_bias.new_zeros(())
            return self.expert_bias.new_zeros(self.n_experts), zero, zero, 0
        load, dropped, aux = (torch.stack(parts).sum(0) for parts in zip(*records, strict=True))
        return load, dropped, aux, len(records)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3: b_i += γ·sign(mean load − load_i), from the step's load over every rank."""
        if self.bias_update > 0:
            self.expert_bias += self.bias_update * torch.sign(load.mean() - load)

    def clear(self) -> None:
        self.records.clear()


class MoE(nn.Module):
    """Router, routed experts and (optionally) shared experts — a dense SwiGLU module of the family's
    own, of width n_shared × hidden — in place of a dense SwiGLU."""

    def __init__(self, dim: int, n_experts: int, top_k: int, hidden: int, shared: nn.Module | None = None,
                 **router):
        super().__init__()
        self.router = Router(dim, n_experts, top_k, **router)
        self.experts = GroupedExperts(n_experts, dim, hidden)
        self.shared = shared
        self.dispatch = local_dispatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        choice, weights, keep = self.router(tokens)
        out = self.dispatch(tokens, choice, weights, keep, self.experts)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view_as(x)
