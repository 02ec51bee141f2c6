"""Model shapes by name. Plain data, no torch, so the planner can import it instantly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool
    rope_theta: float
    max_seq_len: int


# Llama 3 shapes from Meta's published model cards / params.json (Llama 3.1 8B/70B/405B,
# Llama 3.2 1B/3B). 1B and 3B tie the embedding and output matrices; the larger ones do not.
PRESETS: dict[str, ModelShape] = {
    # A few million parameters: trains on a laptop CPU in minutes.
    "tiny": ModelShape(
        n_layers=4, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=4096,
        tie_embeddings=True, rope_theta=10_000.0, max_seq_len=256,
    ),
    "llama3-1b": ModelShape(
        n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128_256,
        tie_embeddings=True, rope_theta=500_000.0, max_seq_len=8192,
    ),
    "llama3-3b": ModelShape(
        n_layers=28, dim=3072, n_heads=24, n_kv_heads=8, ffn_dim=8192, vocab_size=128_256,
        tie_embeddings=True, rope_theta=500_000.0, max_seq_len=8192,
    ),
    "llama3-8b": ModelShape(
        n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14_336, vocab_size=128_256,
        tie_embeddings=False, rope_theta=500_000.0, max_seq_len=8192,
    ),
    "llama3-70b": ModelShape(
        n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28_672, vocab_size=128_256,
        tie_embeddings=False, rope_theta=500_000.0, max_seq_len=8192,
    ),
    "llama3-405b": ModelShape(
        n_layers=126, dim=16_384, n_heads=128, n_kv_heads=8, ffn_dim=53_248, vocab_size=128_256,
        tie_embeddings=False, rope_theta=500_000.0, max_seq_len=8192,
    ),
}

