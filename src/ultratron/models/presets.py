"""Model shapes by name. Plain data, no torch, so the planner can import it instantly."""

from __future__ import annotations

from dataclasses import dataclass

from ultratron.fields import option
from ultratron.models.specs import DEFAULT as DEFAULT_FAMILY
from ultratron.models.specs import SPECS as FAMILIES

ROUTER_SCORES = ("softmax", "sigmoid")
ATTENTION_BACKENDS = ("auto", "flex", "sdpa")  # model.attention (models/attention.py)


@dataclass(frozen=True)
class ModelShape:
    """A transformer's shape, defined once: the presets below, the trainer's `[model]` fields
    (`config.training.ModelConfig` takes these definitions) and `ultratron plan`'s model flags."""

    n_layers: int = option(help="transformer blocks", minimum=1)
    dim: int = option(help="model width", minimum=1)
    n_heads: int = option(help="attention (query) heads", minimum=1)
    n_kv_heads: int = option(help="key/value heads (grouped-query attention)", minimum=1)
    ffn_dim: int = option(help="SwiGLU hidden width", minimum=1)
    vocab_size: int = option(help="vocabulary size (the tokenizer is trained to it)", minimum=1)
    tie_embeddings: bool = option(help="share the embedding and output matrices")
    rope_theta: float = option(help="RoPE base")
    max_seq_len: int = option(help="longest sequence (RoPE table size)", minimum=1)
    head_dim: int = option(0, "attention head width; 0: dim / n_heads (Qwen3: 128 at width 2048, 32 heads)")
    qk_norm: bool = option(False, "RMSNorm on queries and keys per head (OLMo 2, Gemma 3, Qwen3)")
    sliding_window: int = option(0, "sliding-window attention: a query sees at most this many keys, itself "
                                    "included (Mistral 7B: 4096); 0: every earlier key", minimum=0)
    sliding_window_pattern: int = option(0, "with sliding_window: every N-th layer attends fully, the others "
                                            "through the window (Gemma 2: 2); 0: every layer windowed", minimum=0)
    # Mixture of experts (models/moe.py); 0 experts: every layer has the dense SwiGLU of ffn_dim.
    n_experts: int = option(0, "mixture of experts: routed experts per layer; 0: dense SwiGLU layers")
    n_active_experts: int = option(0, "routed experts each token goes to (top-k)")
    n_shared_experts: int = option(0, "experts every token also passes through (DeepSeek-V3: 1)")
    expert_ffn_dim: int = option(0, "each expert's SwiGLU width; 0: ffn_dim")
    n_dense_layers: int = option(0, "the first N layers keep the dense SwiGLU of ffn_dim (DeepSeek-V3: 3)")
    router_score: str = option("softmax", "router scores: softmax (Mixtral, Qwen3) or sigmoid (DeepSeek-V3)",
                               choices=ROUTER_SCORES)
    family: str = option(DEFAULT_FAMILY, "model family: the folder models/FAMILY/ that builds it (llama: Llama, "
                                         "Mistral, Qwen2/3, Mixtral, Qwen3-MoE and DeepSeek-V3-like shapes)",
                         choices=tuple(FAMILIES))

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


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
    # A mixture of experts that trains on a laptop CPU: tiny's attention and 8 experts of width 256,
    # 2 of them per token (so a token runs 512 of the 2048 hidden units the experts hold).
    "moe-tiny": ModelShape(
        n_layers=4, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=4096,
        tie_embeddings=True, rope_theta=10_000.0, max_seq_len=256,
        n_experts=8, n_active_experts=2, expert_ffn_dim=256,
    ),
    # Published mixture-of-experts shapes (their config.json files; totals in tests/test_moe.py):
    # Mixtral-8x7B (Jiang et al. 2024): 46.7B total, 12.9B active.
    "mixtral-8x7b": ModelShape(
        n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14_336, vocab_size=32_000,
        tie_embeddings=False, rope_theta=1_000_000.0, max_seq_len=32_768,
        n_experts=8, n_active_experts=2,
    ),
    # Qwen3-30B-A3B (Qwen team 2025): 30.5B total, 3.3B active; QK-norm and a head width of its own.
    "qwen3-30b-a3b": ModelShape(
        n_layers=48, dim=2048, n_heads=32, n_kv_heads=4, ffn_dim=6144, vocab_size=151_936,
        tie_embeddings=False, rope_theta=1_000_000.0, max_seq_len=40_960, head_dim=128, qk_norm=True,
        n_experts=128, n_active_experts=8, expert_ffn_dim=768,
    ),
    # DeepSeek-V3-like (DeepSeek-AI 2024): its routed and shared experts, dense first layers, sigmoid
    # router and vocabulary, but grouped-query attention in place of multi-head latent attention (MLA),
    # which ultratron does not implement; 671B total / 37B active once MLA's attention is counted.
    "deepseek-v3-like": ModelShape(
        n_layers=61, dim=7168, n_heads=128, n_kv_heads=128, ffn_dim=18_432, vocab_size=129_280,
        tie_embeddings=False, rope_theta=10_000.0, max_seq_len=4096,
        n_experts=256, n_active_experts=8, n_shared_experts=1, expert_ffn_dim=2048, n_dense_layers=3,
        router_score="sigmoid",
    ),
}

