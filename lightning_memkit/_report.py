"""Human-facing views of measured memory: the summary table of the peak step and the area plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, MiB, format_bytes

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
    """Save a stacked-area PNG of the categories over steps (MiB) and return the matplotlib figure.

    Returns None (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    series = [[getattr(b, name) / MiB for b in breakdowns] for name in CATEGORIES]
    ax.stackplot(list(steps), series, labels=[n.replace("_", " ") for n in CATEGORIES], colors=_COLORS)
    if budget is not None:
        ax.axhline(budget / MiB, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("step")
    ax.set_ylabel("memory at the step's peak (MiB)")
    ax.set_title("Training memory by category")
    ax.legend(loc="upper left", fontsize="small")
    ax.margins(x=0)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return fig
