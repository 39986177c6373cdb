"""What users read: the one table every report prints (`render_table`, rich or plain text), the peak step's
summary, and the memory plot (`plot_history`) read back from the figure it returns: legend, ticks, budget
line."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import sys

import pytest

from lightning_memkit._breakdown import CATEGORIES, GiB, MemoryBreakdown, MiB
from lightning_memkit._diagnosis.report import plot_history, render_summary, render_table

STEPS = list(range(5))


def _history(*, dips=(0, 3)):
    """Five steps of ~20 MiB; the steps in ``dips`` peaked before any gradient existed."""
    return [
        MemoryBreakdown(
            parameters=4 * MiB,
            gradients=0 if step in dips else 4 * MiB,
            optimizer_state=8 * MiB,
            activations=3 * MiB,
            temporary=MiB,
        )
        for step in STEPS
    ]


HEADER = ("name", "size", "fits")
ROWS = [("small", "1.00 MiB", "yes"), ("larger one", "10.00 GiB", "no")]


@pytest.fixture
def plain(monkeypatch):
    """Tables as without rich installed."""
    monkeypatch.setitem(sys.modules, "rich.console", None)


def test_plain_table_aligns_numbers_right_and_named_columns_left(plain):
    text = render_table(HEADER, ROWS, title="Two rows", left=("name",))
    assert text.splitlines() == [
        "Two rows",
        "name             size  fits",
        "small        1.00 MiB   yes",
        "larger one  10.00 GiB    no",
    ]


def test_rich_table_has_the_same_cells_and_its_title():
    text = render_table(HEADER, ROWS, title="Two rows", left=("name",), bold=lambda row: row[2] == "no")
    lines = text.splitlines()
    assert lines[0].strip() == "Two rows" and not text.endswith("\n")
    assert "┃ name       ┃      size ┃ fits ┃" in lines  # the header row, as wide as the widest cell
    assert "│ small      │  1.00 MiB │  yes │" in lines
    assert "│ larger one │ 10.00 GiB │   no │" in lines


@pytest.mark.parametrize("rich", [True, False])
def test_summary_shows_each_category_its_share_and_the_budget(monkeypatch, rich):
    if not rich:
        monkeypatch.setitem(sys.modules, "rich.console", None)
    breakdown = _history(dips=())[0]  # 20 MiB: 4 + 4 + 8 + 3 + 1
    text = render_summary(breakdown, step=7, budget=40 * MiB)
    assert " ".join(text.split()).startswith("Peak training memory (step 7), 50.0% of the 40.00 MiB budget")
    for name, share in zip(CATEGORIES, ("20.0%", "20.0%", "40.0%", "15.0%", "5.0%"), strict=True):
        row = next(line for line in text.splitlines() if name in line)
        assert row.rstrip(" │").endswith(share), row
    assert next(line for line in text.splitlines() if "peak" in line).rstrip(" │").endswith("100.0%")


def _plot(tmp_path, budget=20 * MiB, **kwargs):
    fig = plot_history(STEPS, _history(**kwargs), tmp_path / "memory.png", budget=budget)
    fig.canvas.draw()
    return fig, fig.axes[0]


def _legend(fig, ax):
    return ax.get_legend() or fig.legends[0]


def _budget_lines(ax, value):
    return [line for line in ax.get_lines() if list(line.get_ydata()) == [value, value]]


def test_writes_the_png(tmp_path):
    _plot(tmp_path)
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_legend_is_outside_the_axes(tmp_path):
    fig, ax = _plot(tmp_path)
    legend = _legend(fig, ax).get_window_extent()
    axes = ax.get_window_extent()
    assert not legend.overlaps(axes), f"legend {legend} overlaps the axes {axes}"


def test_x_ticks_are_integer_steps(tmp_path):
    _, ax = _plot(tmp_path)
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    labels = [label.get_text() for label in ax.get_xticklabels() if label.get_text()]
    assert all(label.lstrip("−-").isdigit() for label in labels), labels


def test_legend_lists_the_stack_top_down(tmp_path):
    fig, ax = _plot(tmp_path)
    stacked = [c.get_label() for c in ax.collections]  # drawn bottom first
    assert stacked == [c.replace("_", " ") for c in CATEGORIES]
    legend = [t.get_text() for t in _legend(fig, ax).get_texts() if not t.get_text().startswith("budget")]
    assert legend == stacked[::-1]


def test_budget_line_is_labelled_with_its_size(tmp_path):
    fig, ax = _plot(tmp_path, budget=20 * MiB)
    (line,) = _budget_lines(ax, 20.0)
    assert "20.00 MiB" in line.get_label()
    assert any("20.00 MiB" in t.get_text() for t in _legend(fig, ax).get_texts())
    assert "MiB" in ax.get_ylabel()


def test_a_budget_far_above_the_peaks_leaves_the_chart_to_the_data(tmp_path):
    """Issue 29: a 20 GiB budget over 20 MiB steps drew an empty chart under its line. The data keeps the
    scale (MiB); the legend names the budget, off the scale."""
    fig, ax = _plot(tmp_path, budget=20 * GiB)
    assert "MiB" in ax.get_ylabel()
    assert _budget_lines(ax, 20.0) == [] and _budget_lines(ax, 20 * 1024.0) == []
    low, high = ax.get_ylim()
    assert low <= 0 and 20.0 < high < 25.0  # the stack's top, with headroom
    (label,) = [t.get_text() for t in _legend(fig, ax).get_texts() if t.get_text().startswith("budget")]
    assert "20.00 GiB" in label and "off the scale" in label


def test_a_budget_within_twice_the_peak_is_drawn(tmp_path):
    _, ax = _plot(tmp_path, budget=36 * MiB)
    assert len(_budget_lines(ax, 36.0)) == 1
    assert ax.get_ylim()[1] > 36.0


def test_no_budget_no_line(tmp_path):
    _, ax = _plot(tmp_path, budget=None)
    assert ax.get_lines() == []


@pytest.mark.parametrize(
    ("dips", "noted"), [((0, 3), True), ((), False), ((0,), False)], ids=["dips", "none", "first-step-only"]
)
def test_dips_get_a_footnote(tmp_path, dips, noted):
    fig, ax = _plot(tmp_path, dips=dips)
    texts = [t.get_text() for t in [*ax.texts, *fig.texts]]
    assert any("before any gradient existed" in t for t in texts) is noted
