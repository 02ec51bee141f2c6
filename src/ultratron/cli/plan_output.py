"""Tables and charts for `ultratron plan` (torch-free; matplotlib only when a chart is asked for)."""

from __future__ import annotations

from dataclasses import fields as dataclass_fields

from ultratron.planning.layout import Layout
from ultratron.planning.memory import GiB, MemoryBreakdown


def gib(value: float) -> str:
    return f"{value / GiB:.2f}"


def human(value: float, unit: str = "") -> str:
    """1.23B parameters or tokens (counts: billions); with a unit, SI: 1.23GB, not 1.23BB."""
    for threshold, suffix in ((1e12, "T"), (1e9, "G" if unit else "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f}{suffix}{unit}"
    return f"{value:.0f}{unit}"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = zip(row, widths, strict=True)
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(cells))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def wrap(text: str, per_line: int = 3) -> str:
    words = text.split()
    return "\n".join(" ".join(words[i:i + per_line]) for i in range(0, len(words), per_line))


def varying_labels(layouts: list[Layout]) -> list[str]:
    """Chart labels naming only the layout fields the sweep changes."""
    names = [f.name for f in dataclass_fields(Layout)]
    varying = [n for n in names if len({getattr(lay, n) for lay in layouts}) > 1]
    if not varying:
        return [wrap(lay.describe()) for lay in layouts]
    return [wrap(" ".join(f"{n}={getattr(lay, n)}" for n in varying), 2) for lay in layouts]


def stacked_bars(path: str, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str,
                  limit: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) + 3), 5))
    bottom = [0.0] * len(labels)
    for name, values in series.items():
        if any(values):
            ax.bar(range(len(labels)), values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if limit:
        ax.axhline(limit, color="black", linestyle="--", linewidth=1, label="usable memory")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def start_line(layout: Layout, m: MemoryBreakdown) -> str:
    """The start's peak in words: what a rank holds from `meta` to the first step, fresh or loaded."""
    where = f" on pipeline rank {m.extra['start_pp_rank']}" if layout.pp > 1 else ""
    held = (m.start_shards + m.start_buffers) / GiB
    block = m.start_init_transient / 2 / 2**20
    return (f"start (meta → materialize → init): {gib(m.start_init_bytes)} GiB; from a checkpoint: "
            f"{gib(m.start_load_bytes)} GiB{where} (shards and buffers {held:.2f} GiB, + two {block:.0f} MiB init "
            f"blocks, or + the largest stored tensor, {'×'.join(map(str, m.extra['largest_stored_tensor']))}, "
            f"read whole: {m.start_load_transient / GiB:.2f} GiB in fp32)")


def seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s"


def step_table(est) -> str:
    """The step as a table: compute, each collective (its time and what of it shows), the bubble."""
    rates = "the rates bench comm measured" if est.measured_kernels else "memory bandwidth"
    rows = [["compute", f"matmuls and attention at {est.efficiency:.0%} of peak"
             + (f", slowest stage ×{est.stage_imbalance:.2f}" if est.stage_imbalance > 1 else ""),
             "", "", "", "", seconds(est.compute_s), f"{est.compute_s / est.step_s:.1%}"],
            ["elementwise", f"norms, residuals, rotary, SwiGLU, loss: bytes at {rates}", "", "", "", "",
             seconds(est.elementwise_s), f"{est.elementwise_s / est.step_s:.1%}"]]
    if est.core_share > 1:
        for row in rows:
            row[1] += f", ×{est.core_share:.2f} for ranks sharing cores"
    for c, exposed in zip(est.collectives, est.exposed, strict=True):
        hidden = f"hidden by {c.hidden_by}" if c.hidden_by else "exposed"
        rows.append([f"{c.axis} {c.op}", c.what, f"{c.group}" + (" (nodes)" if c.spans_nodes else ""),
                     f"{c.calls:g}", human(c.nbytes, "B"), f"{seconds(c.seconds)}, {hidden}", seconds(exposed),
                     f"{exposed / est.step_s:.1%}"])
    if est.bubble_s:
        rows.append(["pipeline bubble", f"{est.layout.pp_schedule}, {est.layout.grad_accum} micro-batches", "", "", "",
                     "", seconds(est.bubble_s), f"{est.bubble_s / est.step_s:.1%}"])
    if est.offload_s:
        rows.append(["host offload", f"activations to the host and back at {est.memory.host_activations / GiB:.1f} "
                     "GiB a micro-batch, host link (PCIe)", "", "", "", f"{seconds(est.offload_s)}, overlapped",
                     seconds(est.offload_exposed_s), f"{est.offload_exposed_s / est.step_s:.1%}"])
    rows.append(["optimizer step", f"model states read and written at {rates}", "", "", "", "",
                 seconds(est.optimizer_s), f"{est.optimizer_s / est.step_s:.1%}"])
    rows.append(["step", "", "", "", "", "", seconds(est.step_s), "100%"])
    return table(["term", "what", "group", "calls", "per call", "time", "on the step", "share"], rows)
