"""Human-facing views of measured memory: the summary table of the peak step and the area plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning_memkit._breakdown import CATEGORIES, GiB, MemoryBreakdown, MiB, format_bytes

__all__ = ["plot_history", "render_summary"]

_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")


def render_summary(breakdown: MemoryBreakdown, *, step: int, budget: int | None = None) -> str:
    """The peak step's categories as a table (rich when installed, plain text otherwise)."""
    title = f"Peak training memory (step {step})"
    if budget is not None:
        title += f", {100 * breakdown.peak / budget:.1f}% of the {format_bytes(budget)} budget"
    rows = [(name, getattr(breakdown, name)) for name in CATEGORIES]
    peak = breakdown.peak or 1
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return f"{title}\n{breakdown}"
    table = Table(title=title)
    table.add_column("category")
    table.add_column("memory", justify="right")
    table.add_column("share", justify="right")
    for name, value in rows:
        table.add_row(name, format_bytes(value), f"{100 * value / peak:.1f}%")
    table.add_row("peak", format_bytes(breakdown.peak), "100.0%", style="bold")
    console = Console(width=100, record=True, force_terminal=False)
    with console.capture() as capture:
        console.print(table)
    return capture.get()


def plot_history(
    steps: Sequence[int],
    breakdowns: Sequence[MemoryBreakdown],
    path: str | Path,
    *,
    budget: int | None = None,
):
    """Save a stacked-area PNG of the categories over steps and return the matplotlib figure.

    The categories are stacked in `CATEGORIES` order (parameters at the bottom); the legend, outside the
    axes, lists them top of the stack first. The y axis is in MiB, or GiB from 1 GiB up. With a
    ``budget`` (bytes) a dashed line marks it, labelled with its size, and the y range always reaches it.

    Dips in the gradients band are real, not lost samples: a step whose peak comes before backward has
    produced any gradient (the first step, and the first step after each validation) has no gradients
    alive at its peak. The figure says so in a footnote when such a step appears.

    Returns None (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    steps = list(steps)
    top = max([b.peak for b in breakdowns] + [budget or 0])
    unit, scale = ("GiB", GiB) if top >= GiB else ("MiB", MiB)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100, layout="constrained")
    series = [[getattr(b, name) / scale for b in breakdowns] for name in CATEGORIES]
    # stackplot draws the first series at the bottom; the legend below is reversed to read top-down
    areas = ax.stackplot(steps, series, labels=[n.replace("_", " ") for n in CATEGORIES], colors=_COLORS)
    handles = areas[::-1]
    if budget is not None:
        line = ax.axhline(budget / scale, color="black", linestyle="--", linewidth=1)
        line.set_label(f"budget ({format_bytes(budget)})")
        handles.insert(0, line)
    # 8% headroom so the top of the stack and the budget line never sit on the frame
    ax.set_ylim(0, 1.08 * top / scale or 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(x=0)
    ax.set_xlabel("step")
    ax.set_ylabel(f"memory at the step's peak ({unit})")
    ax.set_title("Training memory by category")
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    grads = [b.gradients for b in breakdowns]
    if 0 in grads and max(grads) > 0:
        ax.annotate(
            "Dips: steps whose peak came before any gradient existed (the first step, and the first "
            "step after each validation).",
            xy=(0, 0),
            xycoords=("axes fraction", ax.xaxis.label),
            xytext=(0, -4),
            textcoords="offset points",
            va="top",
            fontsize="x-small",
            color="dimgray",
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return fig
