"""Training FLOPs per token and model FLOPs utilisation (MFU).

Source: Ultra-Scale Playbook (Hugging Face 2025) and Chowdhery et al. 2022 (PaLM, appendix B):
training FLOPs per token ≈ 6·N + 12·L·h·s, where N counts every weight that takes part in a
matmul (here: all parameters except the input embedding, which is a lookup, but including the
output projection even when tied) and 12·L·h·s covers the attention scores and weighted sum
(forward 4·L·h·s, backward twice that), counted without the causal halving as is customary.
Forward is ≈ 1/3 of it, backward ≈ 2/3. MFU counts model FLOPs only, never recompute (that is HFU).
A mixture of experts counts its active parameters only — the router, each token's k routed experts
and the shared ones (DeepSeek-AI 2024 quotes its FLOPs per token so) —, since a token never
touches the other experts.
"""

from __future__ import annotations

from ultratron.planning.params import ParamCounts


def matmul_params(counts: ParamCounts, vocab_size: int, dim: int) -> int:
    """Parameters that cost 2 FLOPs per token in the forward pass (the output head counts even if tied;
    of a mixture of experts, the experts a token is routed to)."""
    return counts.active_layers + vocab_size * dim


def training_flops_per_token(counts: ParamCounts, *, vocab_size: int, dim: int, n_layers: int,
                             seq_len: int) -> float:
    return 6.0 * matmul_params(counts, vocab_size, dim) + 12.0 * n_layers * dim * seq_len


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation in [0, 1]; 0 when the peak is unknown."""
    if peak_flops <= 0:
        return 0.0
    return tokens_per_second * flops_per_token / peak_flops
