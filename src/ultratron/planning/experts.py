"""What a mixture of experts adds to a layout's memory and step time: expert parameters, the
activations of routed token slots, and the all-to-all of expert parallelism. Torch-free; used by
`plan memory` (planning.memory, planning.activations) and `plan search` (planning.search).

Parameters: the routed experts of a MoE layer (E·3·h·h_e) are split over ep·tp ranks. Once split
(ep or tp > 1), data parallelism leaves them alone in ultratron (they are not ZeRO-sharded:
`parallel.expert` reduces their gradients itself), so a rank holds their parameters,
gradients and optimizer state whole for its E/ep experts; everything else shards as the ZeRO stage
says. (Sharding them over the ranks that hold the same experts too, as torchtitan does with FSDP
on its expert-data-parallel mesh, is not built.)

Activations (per MoE layer and micro-batch, what ultratron's `models.moe` saves, T tokens on the
rank, k routed experts each, p = 2 bytes in bf16 or 4 in fp32, h_e expert width, S shared experts;
in place of the dense SwiGLU's 4·p·T·h_ff/t):
  router: its fp32 scores 4·T·E, their sum 4·T, the chosen int64 indices and fp32 weights 16·T·k;
  the k·T slots: int64 token and slot indices and fp32 weights 20·T·k, the gathered inputs, the
  expert outputs and their weighted copy 3·p·T·k·h, each expert's SwiGLU 4·p·T·k·h_e/t as the
  dense one; shared experts 4·p·T·S·h_e/t (the layer's input is the norm's output, counted there).
  Selective recompute keeps the matmul outputs only (p·T·E, 3·p·T·k·h_e/t, p·T·k·h, 3·p·T·S·h_e/t);
  full recompute keeps only the layer input. Dense first layers (DeepSeek-V3) count as dense; a
  pipeline rank is charged the average of its own layers (`planning.memory`; the dense ones sit on the
  first stage). `planning.activations` puts these in place of the
  dense SwiGLU's share and, under autocast's per-matmul casts, adds the router's, the slots' and
  the shared experts' bf16 input copies and the rank's expert weight copies.

All-to-all (ep > 1): each MoE layer sends a rank's k·T slots (p·T·k·h bytes) to their experts' ranks
and back, in forward twice (dispatch, combine) and again in backward; a fraction (ep−1)/ep leaves
the rank. In flight: a send and a receive buffer of p·T·k·h each (`all_to_all_buffer_bytes`).
Assumes balanced routing (what the balancing aims at); an uneven step sends more to the busiest.
"""

from __future__ import annotations

from ultratron.planning.params import count_params_of
from ultratron.planning.rules import expert_ffn_dim_of, field_of


def is_moe(shape) -> bool:
    return field_of(shape, "n_experts") > 0


def moe_layer_share(shape) -> float:
    """The fraction of the layers that are mixture-of-experts layers."""
    return (shape.n_layers - field_of(shape, "n_dense_layers")) / shape.n_layers if is_moe(shape) else 0.0


def routed_expert_params_per_layer(shape) -> float:
    """The routed experts' parameters of the average layer (all ranks together)."""
    return count_params_of(shape).routed_experts * moe_layer_share(shape)


def moe_mlp_activation_bytes(shape, tokens: float, p: int, t: int, recompute: str) -> float:
    """Bytes a MoE layer's feed-forward saves for backward (module docstring), T = `tokens`."""
    experts, k = shape.n_experts, field_of(shape, "n_active_experts")
    he, shared = expert_ffn_dim_of(shape), field_of(shape, "n_shared_experts")
    slots = tokens * k
    if recompute == "selective":
        return p * tokens * experts + 3 * p * slots * he / t + p * slots * shape.dim + 3 * p * tokens * shared * he / t
    router = 4 * tokens * experts + 4 * tokens + 16 * slots  # scores, their sum, chosen indices and weights
    indices = 16 * slots + 4 * slots  # token and slot indices, the slots' weights
    return router + indices + 3 * p * slots * shape.dim + 4 * p * slots * he / t + 4 * p * tokens * shared * he / t


def all_to_all_buffer_bytes(shape, tokens: float, p: int, ep: int) -> float:
    """A MoE layer's dispatch in flight: send and receive buffers of the rank's slots."""
    if not is_moe(shape) or ep == 1:
        return 0.0
    return 2 * p * tokens * field_of(shape, "n_active_experts") * shape.dim
