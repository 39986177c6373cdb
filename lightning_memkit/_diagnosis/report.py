"""Human-facing views of memory: the summary table of the peak step and the area plot over steps.

`render_table` is the one table every printed report goes through (this summary, ``memkit estimate``'s
columns, a fit plan's alternatives): rich's when it is installed, aligned plain text otherwise.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

from lightning_memkit._breakdown import CATEGORIES, GiB, MemoryBreakdown, MiB, format_bytes

__all__ = ["plot_history", "render_summary", "render_table"]

_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")


def render_table(
    header: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    title: str | None = None,
    left: Collection[str] = (),
    bold: Callable[[Sequence[str]], bool] | None = None,
    width: int = 110,
) -> str:
    """Rows of strings as a table: drawn by rich when it is installed, aligned plain text otherwise.

    Args:
        header: the column names.
        rows: one string per column each.
        title: a line above the table (rich centres it over the table).
        left: the columns aligned left, by name; the others are aligned right (numbers).
        bold: which rows rich sets in bold (the total, the chosen plan); plain text has no bold.
        width: rich's console width, in characters.

    Returns:
        The table without a trailing newline.
    """
    rows = [tuple(row) for row in rows]
    try:  # rich is optional (the "examples" extra): without it, or hidden by a test, the table is plain
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if name in left else cell.rjust(w)
                for cell, w, name in zip(row, widths, header, strict=True)
            ).rstrip()
            for row in [header, *rows]
        ]
        return "\n".join([title, *lines] if title is not None else lines)
    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="left" if name in left else "right")
    for row in rows:
        table.add_row(*row, style="bold" if bold is not None and bold(row) else None)
    console = Console(width=width, record=True, force_terminal=False)
    with console.capture() as capture:
        console.print(table)
    return capture.get().rstrip("\n")


def render_summary(breakdown: MemoryBreakdown, *, step: int, budget: int | None = None) -> str:
    """The peak step's categories as a table: memory and share of the peak, the peak in bold."""
    title = f"Peak training memory (step {step})"
    if budget is not None:
        title += f", {100 * breakdown.peak / budget:.1f}% of the {format_bytes(budget)} budget"
    peak = breakdown.peak or 1
    rows = [
        (name, format_bytes(getattr(breakdown, name)), f"{100 * getattr(breakdown, name) / peak:.1f}%")
        for name in CATEGORIES
    ]
    rows.append(("peak", format_bytes(breakdown.peak), "100.0%"))
    return render_table(
        ("category", "memory", "share"),
        rows,
        title=title,
        left=("category",),
        bold=lambda row: row[0] == "peak",
        width=100,
    )


#: How far above the highest peak a budget is still drawn as a line (the y range then reaches it).
OFF_SCALE = 2.0


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
    ``budget`` (bytes) a dashed line marks it, labelled with its size, and the y range reaches it.

    Dips in the gradients band are real, not lost samples: a step whose peak comes before backward has
    produced any gradient (the first step, and the first step after each validation) has no gradients
    alive at its peak. The figure says so in a footnote when such a step follows one with gradients. A
    budget more than `OFF_SCALE` times the highest peak is named in the legend rather than drawn, so that the
    data keeps the chart.

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
    peak = max(b.peak for b in breakdowns)
    # A budget far above the data would squash the data into a sliver at the bottom: it is named in the
    # legend, off the scale, instead of drawn.
    drawn = budget is not None and budget <= OFF_SCALE * peak
    top = max(peak, budget) if drawn else peak
    unit, scale = ("GiB", GiB) if top >= GiB else ("MiB", MiB)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100, layout="constrained")
    series = [[getattr(b, name) / scale for b in breakdowns] for name in CATEGORIES]
    # stackplot draws the first series at the bottom; the legend below is reversed to read top-down
    areas = ax.stackplot(steps, series, labels=[n.replace("_", " ") for n in CATEGORIES], colors=_COLORS)
    handles = areas[::-1]
    if drawn:
        line = ax.axhline(budget / scale, color="black", linestyle="--", linewidth=1)
        line.set_label(f"budget ({format_bytes(budget)})")
        handles.insert(0, line)
    elif budget is not None:
        (line,) = ax.plot([], [], color="black", linestyle="--", linewidth=1)  # a legend entry only
        line.set_label(f"budget ({format_bytes(budget)},\n{budget / peak:.0f}x the peak: off the scale)")
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
    # A dip: a step without gradients at its peak after one with them (a run's first step is its start)
    if any(later == 0 < earlier for earlier, later in itertools.pairwise(grads)):
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
