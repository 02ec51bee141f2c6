"""Tables and charts for `ultratron plan` (torch-free; matplotlib only when a chart is asked for)."""

from __future__ import annotations

from dataclasses import fields as dataclass_fields

from ultratron.planning.layout import Layout
from ultratron.planning.memory import GiB


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
