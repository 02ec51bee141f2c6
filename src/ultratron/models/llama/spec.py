"""The Llama family's planning formulas, torch-free: parameter counts by part — what the model holds
(total) and what one token uses (active) — and training FLOPs per token, for anything with the model
fields (a preset's ModelShape, a resolved ModelConfig). `planning/` asks `models.specs.spec_of(cfg)`.

Parameters. Source: Ultra-Scale Playbook (Hugging Face 2025) — embeddings v·h (×2 untied), attention
h·(2·a·d + 2·kv·d) for a query heads and kv key/value heads of width d (= 4·h² for multi-head
attention with d = h/a), SwiGLU MLP 3·h·h_ff, plus the RMSNorm weights. A mixture-of-experts layer
(models/moe.py) replaces the MLP by a router h·E and E experts of 3·h·h_e each, plus S shared
experts (3·h·S·h_e); a token uses the router, k routed experts and the shared ones (Fedus et al.
2021; DeepSeek-AI 2024), so active = total − (E − k)·3·h·h_e per MoE layer. A test checks
`sum(p.numel())` of the real module for every preset, and the published totals of Mixtral-8x7B,
Qwen3-30B-A3B and DeepSeek-V3.

FLOPs. Source: Ultra-Scale Playbook and Chowdhery et al. 2022 (PaLM, appendix B): training FLOPs per
token ≈ 6·N + 12·L·h·s, where N counts every weight that takes part in a matmul (here: all parameters
except the input embedding, which is a lookup, but including the output projection even when tied)
and 12·L·h·s covers the attention scores and weighted sum (forward 4·L·h·s, backward twice that),
counted without the causal halving as is customary. h there is the attention's width, heads × head
dim (PaLM writes 12·L·H·Q·T), which is the model width for Llama's own shapes but not for a model
with a wider head (Qwen3-30B-A3B: 32 × 128 over a width of 2,048). Forward is ≈ 1/3 of it, backward ≈ 2/3. A
mixture of experts counts its active parameters only — the router, each token's k routed experts and
the shared ones (DeepSeek-AI 2024 quotes its FLOPs per token so) —, since a token never touches the
other experts.

Sliding windows: a windowed layer's query attends at most W keys, so its attention costs 12·h·min(W, s)
per token where a full layer's costs 12·h·s (the band s × W against the square s × s, both without
the causal halving); `layer_windows` says which layers are windowed (Mistral 7B: all, W 4096; Gemma
2: every other layer, the rest global).
"""

from __future__ import annotations

from ultratron.models.family import ParamCounts, PlanningSpec


def count_params(
    *,
    n_layers: int,
    dim: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    tie_embeddings: bool,
    qk_norm: bool = False,
    qkv_bias: bool = False,
    head_dim: int = 0,
    n_experts: int = 0,
    n_active_experts: int = 0,
    n_shared_experts: int = 0,
    expert_ffn_dim: int = 0,
    n_dense_layers: int = 0,
) -> ParamCounts:
    head_dim = head_dim or dim // n_heads
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    attention = dim * q_dim + 2 * dim * kv_dim + q_dim * dim  # wq, wk, wv, wo
    attention += (q_dim + 2 * kv_dim) if qkv_bias else 0  # their biases (Qwen2)
    norms = 2 * dim + (2 * head_dim if qk_norm else 0)  # attention_norm, ffn_norm (+ q_norm, k_norm)
    embedding = vocab_size * dim
    moe = {}
    if n_experts:
        expert = 3 * dim * (expert_ffn_dim or ffn_dim)
        routed = n_experts * expert
        moe = dict(moe_layer=attention + norms + dim * n_experts + routed + n_shared_experts * expert,
                   routed_experts=routed, active_experts=n_active_experts * expert,
                   n_moe_layers=n_layers - n_dense_layers)
    return ParamCounts(
        embedding=embedding,
        output=0 if tie_embeddings else embedding,
        per_layer=attention + 3 * dim * ffn_dim + norms,  # + SwiGLU w1 (gate), w3 (up), w2 (down)
        n_layers=n_layers,
        final_norm=dim,
        **moe,
    )


def count_params_of(cfg) -> ParamCounts:
    """Counts for anything with the model fields (a ModelShape or a resolved ModelConfig)."""
    optional = ("qk_norm", "qkv_bias", "head_dim", "n_experts", "n_active_experts", "n_shared_experts",
                "expert_ffn_dim", "n_dense_layers")
    return count_params(
        n_layers=cfg.n_layers,
        dim=cfg.dim,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        ffn_dim=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        tie_embeddings=cfg.tie_embeddings,
        **{name: getattr(cfg, name) for name in optional if getattr(cfg, name, None) is not None},
    )


def matmul_params(counts: ParamCounts, vocab_size: int, dim: int) -> int:
    """Parameters that cost 2 FLOPs per token in the forward pass (the output head counts even if tied;
    of a mixture of experts, the experts a token is routed to)."""
    return counts.active_layers + vocab_size * dim


def layer_windows(n_layers: int, window: int | None, pattern: int | None = 0) -> list[int]:
    """Each layer's sliding window, 0 where it attends to every earlier key: `window` on every layer,
    or with `pattern` N on all but every N-th (layers N−1, 2N−1, ...: Gemma 2's alternation is N = 2)."""
    if not window:
        return [0] * n_layers
    return [0 if pattern and (i + 1) % pattern == 0 else window for i in range(n_layers)]


def attention_keys(cfg, seq_len: int) -> int:
    """The keys per query that attention is counted over, summed over the layers: s for a full
    layer, min(W, s) for a windowed one (module docstring)."""
    windows = layer_windows(cfg.n_layers, getattr(cfg, "sliding_window", 0),
                            getattr(cfg, "sliding_window_pattern", 0))
    return sum(min(w, seq_len) if w else seq_len for w in windows)


def attention_flops_per_token(cfg, seq_len: int) -> float:
    """Attention's training FLOPs per token (scores and weighted sum, forward and backward): 12 · heads
    × head dim · the keys of `attention_keys`, the one place this is written."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.dim // cfg.n_heads
    return 12.0 * cfg.n_heads * head_dim * attention_keys(cfg, seq_len)


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token of a model with these fields at this sequence length."""
    return 6.0 * matmul_params(count_params_of(cfg), cfg.vocab_size, cfg.dim) + attention_flops_per_token(cfg, seq_len)


SPEC = PlanningSpec(count_params=count_params_of, flops_per_token=flops_per_token,
                    attention_flops_per_token=attention_flops_per_token)
