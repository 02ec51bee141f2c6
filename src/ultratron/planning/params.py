"""Parameter counts of the Llama-style decoder in `ultratron.models.llama`, by formula.

Source: Ultra-Scale Playbook (Hugging Face 2025) — embeddings v·h (×2 untied), attention
(2 + 2·n_kv/n_heads)·h², SwiGLU MLP 3·h·h_ff, plus the RMSNorm weights. A test checks that this
equals `sum(p.numel())` of the real module for every preset.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    output: int  # 0 when tied to the embedding
    per_layer: int
    n_layers: int
    final_norm: int

    @property
    def layers(self) -> int:
        return self.per_layer * self.n_layers

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.layers + self.final_norm



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
) -> ParamCounts:
    head_dim = dim // n_heads
    kv_dim = n_kv_heads * head_dim
    attention = dim * dim + 2 * dim * kv_dim + dim * dim  # wq, wk, wv, wo
    attention += (dim + 2 * kv_dim) if qkv_bias else 0  # their biases (Qwen2)
    mlp = 3 * dim * ffn_dim  # w1 (gate), w3 (up), w2 (down)
    norms = 2 * dim + (2 * head_dim if qk_norm else 0)  # attention_norm, ffn_norm (+ q_norm, k_norm)
    embedding = vocab_size * dim
    return ParamCounts(
        embedding=embedding,
        output=0 if tie_embeddings else embedding,
        per_layer=attention + mlp + norms,
        n_layers=n_layers,
        final_norm=dim,
    )


def count_params_of(cfg) -> ParamCounts:
    """Counts for anything with the model fields (a ModelShape or a resolved ModelConfig)."""
    return count_params(
        n_layers=cfg.n_layers,
        dim=cfg.dim,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        ffn_dim=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        tie_embeddings=cfg.tie_embeddings,
        qk_norm=getattr(cfg, "qk_norm", False),
        qkv_bias=getattr(cfg, "qkv_bias", False),
    )
