"""A Llama-style decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Options beyond Llama 3: QK-norm (RMSNorm on queries and keys per head, as in OLMo 2 / Gemma 3),
attention-logit and final-logit soft-capping (Gemma 2: cap · tanh(x / cap)), biases on the q/k/v
projections (Qwen2), and RoPE frequency scaling (`linear`, Llama 3.1's `llama3`) for imported
models, a head width of its own (Qwen3), and mixture-of-experts layers in place of the dense SwiGLU
(`ultratron.models.moe`; Mixtral, Qwen3-MoE, DeepSeek-V3-like shapes). This module knows nothing
about parallelism; `ultratron.parallel` applies it from outside — it may swap each attention's
`attend` function (context parallel) and each MoE layer's `dispatch` (expert parallel), and hand
the forward the positions of a sequence shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ultratron.models import init
from ultratron.models.attention import attend
from ultratron.models.init import InitRule
from ultratron.models.llama.spec import layer_windows
from ultratron.models.masks import MaskSpec, allowed, document_starts
from ultratron.models.moe import MoE, Router


@dataclass
class LlamaArgs:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool = True
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    init_std: float = 0.02
    qkv_bias: bool = False
    rope_scaling: str = "none"  # none | linear | llama3
    rope_scaling_params: dict | None = None  # factor; llama3: low/high_freq_factor, original_max_position_embeddings
    head_dim: int = 0  # 0: dim // n_heads
    n_experts: int = 0  # 0: dense SwiGLU layers; else mixture-of-experts layers (models/moe.py)
    n_active_experts: int = 0
    n_shared_experts: int = 0
    expert_ffn_dim: int = 0  # 0: ffn_dim
    n_dense_layers: int = 0  # the first layers stay dense
    router_score: str = "softmax"
    router_norm_topk: bool = True
    moe_aux_loss: float = 0.01
    moe_bias_update: float = 0.0
    moe_capacity_factor: float = 0.0
    attention: str = "auto"  # the attention backend (models/attention.py): auto | flex | sdpa
    sliding_window: int = 0  # keys a query sees at most (itself included); 0: every earlier key
    sliding_window_pattern: int = 0  # N: every N-th layer attends fully, the others windowed; 0: all windowed

    def __post_init__(self):
        self.head_dim = self.head_dim or self.dim // self.n_heads

    @classmethod
    def from_config(cls, model_cfg) -> LlamaArgs:
        """From a resolved `ultratron.config.ModelConfig` (an optional field left None keeps its default)."""
        names = cls.__dataclass_fields__
        return cls(**{name: getattr(model_cfg, name) for name in names if getattr(model_cfg, name, None) is not None})

    def is_moe_layer(self, index: int) -> bool:
        return self.n_experts > 0 and index >= self.n_dense_layers


def document_layout(documents: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents (batch, seq: a document number per token, equal within a document) → each
    token's position within its document (batch, seq) and the dense attention mask (batch, 1, seq,
    seq): causal, and within a document only. The model never builds this mask (it hands the
    attention backend a `MaskSpec`); it is the reference the backends are tested against. `rows` (n,):
    where the tokens at hand sit in the packed row; then the positions and the mask's rows are theirs."""
    rows = torch.arange(documents.shape[1], device=documents.device) if rows is None else rows
    mask = allowed(MaskSpec(documents=documents), rows[None], torch.arange(documents.shape[1], device=rows.device))
    return document_positions(documents, rows), mask


def document_positions(documents: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's position within its document (batch, n), for the tokens at `rows` of the packed
    row (None: every token)."""
    first = document_starts(documents)
    rows = torch.arange(documents.shape[1], device=documents.device) if rows is None else rows
    return rows - first[:, rows]


def rope_and_mask(rope_cos: torch.Tensor, rope_sin: torch.Tensor, seq: int, positions: torch.Tensor | None,
                  documents: torch.Tensor | None, backend: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor, MaskSpec]:
    """The rotary tables' rows for `seq` tokens at `positions` (None: 0, 1, ...) and the attention's
    mask spec (causal, within `documents`). With `documents` (batch, length of the packed row),
    `positions` say where the tokens sit in that row (None: they are the whole row) and the tables
    rotate by each token's position within its document (`document_positions`)."""
    spec = MaskSpec(backend=backend)
    if documents is not None:
        if positions is None and documents.shape[1] != seq:
            raise ValueError(f"documents cover {documents.shape[1]} tokens, the sequence has {seq}: give the "
                             "positions of the sequence's tokens in the documents' row")
        spec = MaskSpec(documents=documents, rows=positions, backend=backend)
        positions = document_positions(documents, positions)
    rows = positions if positions is not None else slice(0, seq)
    return rope_cos[rows], rope_sin[rows], spec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses too much in bf16.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type_as(x)


def scale_frequencies(inv_freq: torch.Tensor, kind: str, params: dict | None) -> torch.Tensor:
    """RoPE frequency scaling for contexts longer than pre-training's. `linear` (Chen et al. 2023,
    position interpolation) divides every frequency by `factor`; `llama3` (Meta's Llama 3.1
    reference code) divides only the low frequencies — wavelengths longer than
    original_max_position_embeddings / low_freq_factor — keeps those shorter than
    original / high_freq_factor, and blends linearly in between."""
    if kind == "none":
        return inv_freq
    params = params or {}
    factor = float(params["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"unknown RoPE scaling {kind!r}")
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > original / low, inv_freq / factor,
                       torch.where(wavelen < original / high, inv_freq, blended))


def rope_tables(head_dim: int, max_seq_len: int, theta: float, scaling: str = "none",
                scaling_params: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim / 2) for rotary position embeddings (Su et al. 2021)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    inv_freq = scale_frequencies(inv_freq, scaling, scaling_params)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) channel pairs of x: (batch, seq, heads, head_dim). cos/sin are
    (seq, head_dim / 2), or (batch, seq, head_dim / 2) when rows sit at different positions."""
    cos, sin = ((t if t.dim() == 3 else t[None])[:, :, None, :].float() for t in (cos, sin))
    if torch.compiler.is_compiling():
        # Real-valued, which Inductor fuses into the block's other element-wise loops (it has no
        # complex code generation); the same products as the complex form below.
        pairs = x.float().unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)
    # Eager: as a complex product (real + i·imag)·(cos + i·sin), one fused multiply forward and
    # backward, where the real-valued form's slicing allocated and zero-filled gradients for every
    # half (measured here: 40 ms against 60 ms forward + backward for a 16×256×6×64 tensor).
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).type_as(x)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(x / cap) if cap > 0 else x


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, index: int = 0):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.softcap = args.attn_softcap
        self.window = layer_windows(args.n_layers, args.sliding_window, args.sliding_window_pattern)[index]
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # (q, k, v, mask spec, groups) → output, all (batch, heads, seq, head_dim); context parallel swaps it
        self.attend = attend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                mask: MaskSpec | None = None) -> torch.Tensor:
        """`mask`: what the queries may attend (`models/masks.py`: causal, within packed documents; a
        context-parallel shard's documents cover the whole row, which the swapped-in attention takes);
        this layer adds its sliding window and soft cap. None: causal."""
        batch, seq, _ = x.shape
        # -1 instead of n_heads so that a tensor-parallel shard (fewer local heads) works unchanged.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        groups = q.shape[1] // k.shape[1]
        if cache is not None:  # inference: past keys/values join the new ones (the spec has the positions)
            k, v = cache.update(k, v)
        spec = (mask or MaskSpec()).for_layer(self.window, self.softcap)
        out = self.attend(q, k, v, spec, groups)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def moe_layer(args: LlamaArgs) -> MoE:
    hidden = args.expert_ffn_dim or args.ffn_dim
    shared = FeedForward(args.dim, args.n_shared_experts * hidden) if args.n_shared_experts else None
    return MoE(args.dim, args.n_experts, args.n_active_experts, hidden, shared, score=args.router_score,
               norm_topk=args.router_norm_topk, aux_loss=args.moe_aux_loss, bias_update=args.moe_bias_update,
               capacity_factor=args.moe_capacity_factor)


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, index)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = moe_layer(args) if args.is_moe_layer(index) else FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                mask: MaskSpec | None = None) -> torch.Tensor:
        # the mask goes by keyword: tensor parallel's input plan names the positional arguments
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index keeps names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # When True, forward stops before the output head and returns the final normed hidden states
        # (batch, seq, dim); `head(h)` makes their logits, e.g. chunk by chunk in a loss that never
        # holds the whole (batch, seq, vocab) tensor. Whoever runs the model decides; default logits.
        self.hidden_out = False
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling,
                               args.rope_scaling_params)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Every parameter as `init_rule` says, drawn block by block (`models/init.py`) from `seed`
        (None: torch's initial seed, what `torch.manual_seed` set): the values any shard of this
        model would get under any layout. A model on the meta device has nothing to fill."""
        seed = torch.initial_seed() if seed is None else seed
        for name, param in self.named_parameters():
            if not param.is_meta:
                init.fill(param, init_rule(name, param.shape, self.args), name, param.shape, seed=seed)

    def forward(self, tokens: torch.Tensor, cache=None, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (batch, seq) → logits (batch, seq, vocab), or the hidden states (`hidden_out`).
        `cache` (inference only, e.g. a view of `ultratron.inference.paged_kv.PagedCache`) supplies each row's
        positions and keeps keys/values;
        `positions` (seq,) are the tokens' positions when they are not 0, 1, ... (a shard of a longer
        sequence, as context parallelism hands each rank); `documents` (batch, seq) number the packed
        documents of each row: attention stays within a document and positions restart at each
        (with `positions`, the documents cover the whole row the shard was cut from)."""
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.args.max_seq_len}")
        x = self.tok_embeddings(tokens)
        if cache is None:
            cos, sin, mask = rope_and_mask(self.rope_cos, self.rope_sin, seq, positions, documents,
                                           self.args.attention)
        elif documents is not None or positions is not None:
            raise ValueError("a KV cache supplies the positions: documents or positions cannot be given with it")
        else:
            positions = cache.positions(seq)  # (batch, seq)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            mask = cache.mask(positions, self.args.attention)  # which of its keys each query sees
        for name, layer in self.layers.items():
            x = layer(x, cos, sin, mask=mask) if cache is None else layer(x, cos, sin, cache.layer(name), mask=mask)
        hidden = self.norm(x)
        return hidden if self.hidden_out else self.head(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states (..., dim) → logits (..., vocab)."""
        return softcap(self.output(hidden), self.args.final_softcap)


def build_model(model_cfg, device: str | torch.device = "cpu") -> Llama:
    """A Llama from a resolved ModelConfig. `device="meta"` builds the shapes without memory."""
    with torch.device(device):
        return Llama(LlamaArgs.from_config(model_cfg))


RESIDUAL_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared.w2.weight")


def init_rule(name: str, shape, args: LlamaArgs) -> InitRule:
    """How a Llama parameter (by its name in the whole model) is drawn: Normal(0, init_std) weights,
    the projections into the residual stream scaled by 1/sqrt(2·n_layers) (GPT-2, Radford et al.
    2019) so the residual variance stays bounded; norms start at one, biases at zero."""
    if name.endswith("norm.weight"):
        return InitRule.constant(1.0)
    if name.endswith(".bias"):
        return InitRule.constant(0.0)
    if name.endswith(RESIDUAL_PROJECTIONS):
        return InitRule.normal(args.init_std / math.sqrt(2 * args.n_layers))
    return InitRule.normal(args.init_std)


@torch.no_grad()
def init_buffers(module: nn.Module) -> None:
    """The buffers of a model (or a pipeline stage of one) made again where they live, after
    `to_empty` left them uninitialized: the rotary tables and the routers' balancing biases."""
    for sub in module.modules():
        if isinstance(sub, Router):
            sub.expert_bias.zero_()
        if isinstance(sub._buffers.get("rope_cos"), torch.Tensor) and hasattr(sub, "args"):
            args = sub.args
            cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling,
                                   args.rope_scaling_params)
            sub.rope_cos.copy_(cos)
            sub.rope_sin.copy_(sin)
