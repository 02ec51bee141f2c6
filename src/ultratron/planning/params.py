"""Parameter counts of the Llama-style decoder in `ultratron.models.llama`, by formula, and of its
mixture-of-experts layers: what the model holds (total) and what one token uses (active).

Source: Ultra-Scale Playbook (Hugging Face 2025) — embeddings v·h (×2 untied), attention
h·(2·a·d + 2·kv·d) for a query heads and kv key/value heads of width d (= 4·h² for multi-head
attention with d = h/a), SwiGLU MLP 3·h·h_ff, plus the RMSNorm weights. A mixture-of-experts layer
(models/moe.py) replaces the MLP by a router h·E and E experts of 3·h·h_e each, plus S shared
experts (3·h·S·h_e); a token uses the router, k routed experts and the shared ones (Fedus et al.
2021; DeepSeek-AI 2024), so active = total − (E − k)·3·h·h_e per MoE layer. A test checks
`sum(p.numel())` of the real module for every preset, and the published totals of Mixtral-8x7B,
Qwen3-30B-A3B and DeepSeek-V3.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    output: int  # 0 when tied to the embedding
    per_layer: int  # a dense layer (attention, SwiGLU, norms)
    n_layers: int  # every layer, dense and mixture-of-experts
    final_norm: int
    moe_layer: int = 0  # a mixture-of-experts layer: attention, norms, router, routed and shared experts
    routed_experts: int = 0  # of which the routed experts (what expert parallelism shards)
    active_experts: int = 0  # of which one token's k routed experts
    n_moe_layers: int = 0

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    @property
    def layers(self) -> int:
        return self.per_layer * self.n_dense_layers + self.moe_layer * self.n_moe_layers

    @property
    def active_layers(self) -> int:
        """Layer parameters one token computes with (the k routed experts of each MoE layer)."""
        return self.layers - (self.routed_experts - self.active_experts) * self.n_moe_layers

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.layers + self.final_norm

    @property
    def active(self) -> int:
        return self.total - self.layers + self.active_layers

    @property
    def mean_layer(self) -> float:
        """Parameters of the average layer (a stage's share when dense and MoE layers mix)."""
        return self.layers / self.n_layers


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
