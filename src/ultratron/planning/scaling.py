"""Compute-optimal model size and tokens, predicted loss, time, cost and checkpoint storage.

Loss fits L(N, D) = E + A/N^α + B/D^β (N parameters, D training tokens):
  * Hoffmann et al. 2022 (Chinchilla, approach 3): E 1.69, A 406.4, B 410.7, α 0.34, β 0.28.
    These are the paper's rounded constants, which are known to give allocations that disagree
    with the paper's own approaches 1 and 2 (far fewer tokens per parameter).
  * Besiroglu et al. 2024 (Epoch AI's refit of the same data, arXiv 2404.10102): E 1.8172,
    A 482.01, B 2085.43, α 0.3478, β 0.3658; ≈ 20 tokens per parameter across 1e21–1e25 FLOPs.
With C = 6·N·D, minimising L gives N_opt = G·(C/6)^(β/(α+β)), G = (α·A/(β·B))^(1/(α+β)), and
D_opt = C/(6·N_opt). The rule of thumb D = 20·N gives N = sqrt(C/120).
For a mixture of experts, FLOPs follow the *active* parameters (6·N_active per token), while
memory and checkpoints follow the *total*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class LossFit:
    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str

    def loss(self, params: float, tokens: float) -> float:
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta


FITS: dict[str, LossFit] = {
    "epoch": LossFit("epoch", 1.8172, 482.01, 2085.43, 0.3478, 0.3658,
                     "Besiroglu et al. 2024, Chinchilla scaling: a replication attempt (Epoch AI), "
                     "arXiv 2404.10102"),
    "hoffmann": LossFit("hoffmann", 1.69, 406.4, 410.7, 0.34, 0.28,
                        "Hoffmann et al. 2022, Training compute-optimal LLMs, approach 3 (rounded)"),
}


@dataclass(frozen=True)
class Allocation:
    method: str
    params: float
    tokens: float
    flops: float
    loss: float | None  # None for the rule of thumb, which predicts no loss

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


def compute_optimal(flops: float, fit: LossFit) -> Allocation:
    """The (N, D) with 6·N·D = flops that minimises the fit's loss."""
    a, b = fit.alpha, fit.beta
    g = (a * fit.A / (b * fit.B)) ** (1 / (a + b))
    params = g * (flops / 6) ** (b / (a + b))
    tokens = flops / (6 * params)
    return Allocation(fit.name, params, tokens, flops, fit.loss(params, tokens))


def tokens_per_param_rule(flops: float, ratio: float = 20.0) -> Allocation:
    """D = ratio·N with C = 6·N·D (≈ 20 from Hoffmann et al.'s approaches 1 and 2)."""
    params = math.sqrt(flops / (6 * ratio))
    return Allocation(f"{ratio:g} tokens/param", params, ratio * params, flops, None)


def budget_flops(n_gpus: int, days: float, mfu: float, peak_flops: float) -> float:
    """Training FLOPs a cluster delivers: GPUs × seconds × MFU × dense peak."""
    return n_gpus * days * SECONDS_PER_DAY * mfu * peak_flops


def training_seconds(flops: float, n_gpus: int, mfu: float, peak_flops: float) -> float:
    return flops / (n_gpus * mfu * peak_flops)


def checkpoint_bytes(total_params: float, precision: str = "bf16") -> float:
    """A full training checkpoint: weights + fp32 master + two fp32 Adam moments.

    bf16: 2 + 4 + 4 + 4 = 14 bytes/param (7B → 98 GB); fp32 weights are their own master: 4 + 4 + 4.
    """
    return total_params * (14 if precision == "bf16" else 12)


@dataclass(frozen=True)
class Storage:
    checkpoint_bytes: float
    saves: int  # checkpoints written over the run
    kept: int  # checkpoints on disk at once under the retention policy
    peak_bytes: float  # kept + the one being written before the oldest is deleted
    written_bytes: float  # everything written over the run (object-store traffic)


def checkpoint_storage(total_params: float, total_steps: int, save_interval: int, keep: int,
                       precision: str = "bf16") -> Storage:
    """Disk needed for a save interval and a keep-newest-N retention policy (the final step is saved too)."""
    size = checkpoint_bytes(total_params, precision)
    saves = math.ceil(total_steps / save_interval) if save_interval > 0 else 1
    kept = min(keep, saves)
    in_flight = 1 if saves > kept else 0
    return Storage(size, saves, kept, (kept + in_flight) * size, saves * size)
