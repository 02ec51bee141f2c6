"""Training FLOPs per token, by the model family's formula (`models/FAMILY/spec.py`, through
`models.specs`), and model FLOPs utilisation (MFU). MFU counts model FLOPs only, never recompute
(that is HFU); a mixture of experts counts the experts a token is routed to.
"""

from __future__ import annotations

from ultratron.models.specs import spec_of


def flops_per_token_of(cfg, seq_len: int) -> float:
    """Model FLOPs (forward + backward) per trained token of anything with the model fields."""
    return spec_of(cfg).flops_per_token(cfg, seq_len)


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation in [0, 1]; 0 when the peak is unknown."""
    if peak_flops <= 0:
        return 0.0
    return tokens_per_second * flops_per_token / peak_flops


def stage_flops_per_token(cfg, seq_len: int, layers: int, last: bool) -> float:
    """The share of `flops_per_token_of` that a pipeline stage of `layers` layers computes: the
    output head's 6·vocab·dim on the last stage, the rest spread evenly over the layers (a mixture
    of experts' dense layers count as its average layer)."""
    head = 6.0 * cfg.vocab_size * cfg.dim
    per_layer = (flops_per_token_of(cfg, seq_len) - head) / cfg.n_layers
    return per_layer * layers + (head if last else 0.0)
