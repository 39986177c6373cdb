"""The memory plot (`plot_history`) read back from the figure it returns: legend, ticks, budget line."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest

from lightning_memkit._breakdown import CATEGORIES, GiB, MemoryBreakdown, MiB
from lightning_memkit._report import plot_history

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


def test_budget_far_above_the_peaks_is_in_view_in_gib(tmp_path):
    _, ax = _plot(tmp_path, budget=20 * GiB)
    assert "GiB" in ax.get_ylabel()
    (line,) = _budget_lines(ax, 20.0)
    assert "20.00 GiB" in line.get_label()
    low, high = ax.get_ylim()
    assert low <= 0 and high > 20.0


def test_no_budget_no_line(tmp_path):
    _, ax = _plot(tmp_path, budget=None)
    assert ax.get_lines() == []


@pytest.mark.parametrize(("dips", "noted"), [((0, 3), True), ((), False)], ids=["dips", "none"])
def test_dips_get_a_footnote(tmp_path, dips, noted):
    fig, ax = _plot(tmp_path, dips=dips)
    texts = [t.get_text() for t in [*ax.texts, *fig.texts]]
    assert any("before any gradient existed" in t for t in texts) is noted
