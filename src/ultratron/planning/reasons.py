"""The reasons `plan estimate` and `plan search` give for a layout: what fits and why, what the step
is made of, and what each of its memory-saving choices buys; and the search's own: why #1 beats the
next other split, and where the fastest layout using each memory-saving option ranks."""

from __future__ import annotations

from dataclasses import replace

from ultratron.planning.layout import check_layout
from ultratron.planning.memory import GiB, estimate_memory


def reasons_for(spec, est, bubble_fraction: float) -> list[str]:
    """Why a layout (an `Estimate` of `spec`, a `SearchSpec`): what fits, what the step is made of,
    and what each memory-saving choice buys (what the layout would need without it)."""
    mem, lay = est.memory, est.layout
    reasons = [
        f"fits: {mem.peak_bytes / GiB:.1f} GiB of {spec.usable_bytes / GiB:.1f} GiB usable "
        f"({spec.headroom:.0%} headroom) — model states {mem.static_bytes / GiB:.1f}, "
        f"activations {(mem.activations + mem.loss_logits) / GiB:.1f}, "
        f"other {(mem.comm_buffers + mem.transient) / GiB:.1f}"
        + ("" if mem.fit_moment == "step" else f"; it needs more to start: {mem.fit_description()}"),
        f"step {est.step_s:.2f} s = compute {est.compute_s:.2f} + elementwise {est.elementwise_s:.2f} "
        f"+ TP {est.tp_comm_s:.2f} "
        f"+ CP {est.cp_exposed_s:.2f} " + (f"+ EP all-to-all {est.ep_comm_s:.2f} " if est.ep_comm_s else "") +
        f"+ PP p2p {est.pp_comm_s:.2f} + bubble {est.bubble_s:.2f} ({bubble_fraction:.0%}) "
        f"+ DP exposed {est.dp_exposed_s:.2f} (of {est.dp_comm_s:.2f}) + optimizer {est.optimizer_s:.2f}"
        + (f" + offload {est.offload_exposed_s:.2f} (of {est.offload_s:.2f})" if est.offload_s else ""),
    ]
    overheads = {"tensor-parallel collectives": est.tp_comm_s, "context-parallel ring": est.cp_exposed_s,
                 "expert-parallel all-to-all": est.ep_comm_s,
                 "pipeline bubble": est.bubble_s + est.pp_comm_s, "data-parallel sync": est.dp_exposed_s}
    worst, worst_s = max(overheads.items(), key=lambda kv: kv[1])
    if worst_s > 0.01 * est.step_s:
        reasons.append(f"largest overhead: {worst} ({worst_s / est.step_s:.0%} of the step)")
    else:
        reasons.append("communication is hidden: the step is compute-bound")
    if lay.recompute != "none":
        lighter = "selective" if lay.recompute == "full" else "none"
        if check_layout(spec.shape, replace(lay, recompute=lighter)):  # (selective: not with a split backward)
            lighter = "none"
        need = estimate_memory(spec.shape, replace(lay, recompute=lighter), spec.activation_model).fit_bytes
        cost = "+1/3 compute" if lay.recompute == "full" else "~2% time"
        reasons.append(f"recompute={lay.recompute} ({cost}): with recompute={lighter} this layout needs "
                       f"{need / GiB:.1f} GiB" + (" and does not fit" if need > spec.usable_bytes else
                                                  ", which fits but runs slower at a smaller micro-batch"))
    if lay.zero:
        sharded = {1: "optimizer state", 2: "optimizer state and grads", 3: "all model states"}[lay.zero]
        lower = replace(lay, zero=lay.zero - 1)
        refused = check_layout(spec.shape, lower)  # (HSDP needs ZeRO 2 or 3)
        need = 0.0 if refused else estimate_memory(spec.shape, lower, spec.activation_model).fit_bytes
        why = (f"the trainer refuses it: {refused[0]}" if refused else f"would need {need / GiB:.1f} GiB: "
               + ("does not fit" if need > spec.usable_bytes else "fits too"))
        reasons.append(f"ZeRO-{lay.zero} shards {sharded} over {lay.shard_group} ranks (ZeRO-{lay.zero - 1} {why})")
    for name, off, cost in (("offload_activations", False, f"{est.offload_exposed_s:.2f} s of host copies exposed"),
                            ("loss_chunk", 0, "the head's matmul again in backward")):
        if getattr(lay, name):
            need = estimate_memory(spec.shape, replace(lay, **{name: off}), spec.activation_model).fit_bytes
            reasons.append(f"{name}={getattr(lay, name)} ({cost}): without it this layout needs {need / GiB:.1f} GiB"
                           + (" and does not fit" if need > spec.usable_bytes else ", which fits too"))
    return reasons


def step_terms(est) -> dict[str, float]:
    """The step's parts by name (seconds on the critical path): they add up to `step_s`."""
    return {"compute": est.compute_s, "elementwise": est.elementwise_s, "tensor-parallel collectives": est.tp_comm_s,
            "context-parallel ring": est.cp_exposed_s, "expert all-to-all": est.ep_comm_s,
            "pipeline transfers": est.pp_comm_s, "pipeline bubble": est.bubble_s,
            "data-parallel sync": est.dp_exposed_s, "optimizer step": est.optimizer_s,
            "host offload": est.offload_exposed_s}


def step_difference(best, other) -> tuple[float, str]:
    """(how much longer `other`'s step is, a fraction; the three parts of the step that differ most,
    as "name −/+ms" from `best`'s side: − where `best` spends less)."""
    gains = {name: other_s - best_s for (name, best_s), other_s in
             zip(step_terms(best).items(), step_terms(other).values(), strict=True)}
    top = sorted((kv for kv in gains.items() if abs(kv[1]) > 1e-3 * best.step_s), key=lambda kv: -abs(kv[1]))[:3]
    parts = ", ".join(f"{name} {'−' if gain > 0 else '+'}{abs(gain) * 1e3:.0f} ms" for name, gain in top)
    return other.step_s / best.step_s - 1, parts


def why_first(best, other) -> str:
    """One line: how much faster the winner is than the next layout and which parts of the step make it."""
    faster, parts = step_difference(best, other)
    if faster < 0.005:
        return (f"why #1: as fast as the next other split ({other.layout.describe()}) within the model's "
                "resolution (0.5 %); it has fewer moving parts" + (f" ({parts})" if parts else ""))
    return (f"why #1: {faster:.1%} faster than the next other split ({other.layout.describe()}): "
            + (parts or "the same parts"))


# the memory-saving options `plan search` reports on one by one: where the fastest layout using each
# ranks, or why none that uses it fits
OPTIONS = ("offload_activations", "loss_chunk")


def options_summary(spec, fitting: list, closest_with: dict) -> list[str]:
    """A line for each of `OPTIONS`: #1 uses it, or how much slower the fastest fitting layout that
    uses it is and which parts of its step make the difference, or why no layout using it fits."""
    lines = []
    for option in OPTIONS:
        rank, est = next(((i, e) for i, e in enumerate(fitting, 1) if getattr(e.layout, option)), (0, None))
        if est is not None and rank == 1:
            lines.append(f"{option}: #1 uses it (its reasons say what it buys)")
        elif est is not None:
            slower, parts = step_difference(fitting[0], est)
            lines.append(f"{option}: the fastest layout with it ranks #{rank} ({est.layout.describe()}), "
                         f"{slower:.1%} slower than #1" + (f" (#1: {parts})" if parts else ""))
        elif option in closest_with:
            _, layout, mem = closest_with[option]
            host = spec.accelerator.host_memory_bytes
            over = [f"{mem.fit_description()} on the GPU (of {spec.usable_bytes / GiB:.1f} usable)"] \
                if mem.fit_bytes > spec.usable_bytes else []
            if mem.host_activations > host:
                over.append(f"{mem.host_activations / GiB:.1f} GiB of host memory per GPU (of "
                            f"{host / GiB:.0f})")
            largest = max(mem.TERMS, key=lambda term: getattr(mem, term))
            lines.append(f"{option}: no layout with it fits; the nearest ({layout.describe()}) needs "
                         + " and ".join(over) + f", {getattr(mem, largest) / GiB:.1f} GiB of it {largest}")
        else:
            lines.append(f"{option}: no layout with it is left under the trainer's rules and the fixed fields")
    return lines
