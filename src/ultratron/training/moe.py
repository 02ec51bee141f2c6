"""The trainer's mixture-of-experts component: each router's share of the step, its statistics in
the metrics, and DeepSeek-V3's bias update.

Every router records, per trained micro-batch, the token slots each expert got, the slots dropped
over capacity and its balancing loss (`models.moe.Router.record`). After each step they are summed
over the data-parallel and context-parallel ranks — the load of the whole global batch, as one
process counts it —, written to the metrics and, with `model.moe_bias_update`, move each
router's bias toward even load. Metrics: `moe_load_max_mean` (the largest expert load over the
mean, the worst layer; 1.0 is perfect balance), `moe_dropped` (share of the routed slots
dropped), `moe_aux_loss` (the balancing loss, mean over layers and micro-batches, before its
coefficient) and, in metrics.jsonl, `moe_load` (slots per expert, per layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ultratron.models.moe import Router
from ultratron.parallel.axis import Axes


class RouterStats:
    def __init__(self, model: nn.Module, axes: Axes):
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.axes = axes

    def before_step(self, loss_weight: float) -> None:
        """One micro-batch's weight in this step's gradient (a batch ramp varies the micro-batches)."""
        for router in self.routers:
            router.aux_loss_scale = loss_weight

    def after_step(self, n_micro_batches: int) -> dict:
        """The step's router metrics (empty for a dense model) from its `n_micro_batches`; updates the
        biases and clears the records."""
        if not self.routers:
            return {}
        stats = [r.totals(n_micro_batches) for r in self.routers]
        load = self.axes.sum_over_data(torch.stack([s[0] for s in stats]))  # (layers, experts)
        totals = self.axes.sum_over_data(torch.stack([torch.stack([s[1], s[2], s[1].new_tensor(float(s[3]))])
                                                      for s in stats]).sum(0))
        ratio = (load.max(1).values / load.mean(1).clamp_min(1e-9)).max()
        for router, layer_load in zip(self.routers, load, strict=True):
            router.update_bias(layer_load)
            router.clear()
        slots = load.sum()
        if self.axes.splits_layers:  # each rank holds other layers: combine theirs
            ratio = self.axes.reduce_over_stages(ratio, dist.ReduceOp.MAX)
            both = self.axes.reduce_over_stages(torch.stack([totals[0], totals[1], totals[2], slots]))
            totals, slots = both[:3], both[3]
        dropped, aux_sum, micro_batches = (float(v) for v in totals)
        out = {"moe_load_max_mean": float(ratio), "moe_dropped": dropped / max(float(slots), 1.0),
               "moe_aux_loss": aux_sum / max(micro_batches, 1.0)}
        if not self.axes.splits_layers:
            out["moe_load"] = [[int(x) for x in layer] for layer in load.tolist()]
        return out
