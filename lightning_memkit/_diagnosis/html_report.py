"""One self-contained HTML page of a simulated step's peak: the timeline, the modules at the peak, the advice.

`html_report` reads the step from its PyTorch memory snapshot (`_diagnosis.snapshot.simulated_snapshot`),
whose allocations carry frames naming the op, the tensor, the module, the phase and the category, and
replays it as torch's viewer does: the blocks live from the trace's start, then each free and alloc in
order. The running total's highest point is `estimate_memory`'s peak byte for byte, and what is live there
sums, category by category, to its breakdown: the page's figures are the estimate's, not a drawing of it.

The page holds:

- the timeline: bytes live after each of the simulation's ops (its count, not time), stacked by category,
  the phases (forward, zero_grad, backward, optimizer) shaded and named, the peak marked. A long step is
  downsampled to at most `MAX_POINTS` points, each the highest of its span of ops (the peak is one of
  them); it is inline SVG, drawn here (no script, no network).
- the breakdown at the peak, and the modules holding the most bytes there (each allocation counted for the
  module that made it, a parameter's or its state's for the module owning the parameter), by category.
- the advice: `advise`'s findings with the bytes each fix saves and the fix, when given.

A phase is read from the allocations of each op; an op that only frees takes the phase before it, except
that the previous step's gradients freed between the forward and the backward are Lightning's
``zero_grad`` (which allocates nothing).
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, format_bytes

__all__ = ["MAX_POINTS", "StepTimeline", "html_report", "step_timeline"]

#: The most points the timeline is drawn with (a 7B step has tens of thousands of ops).
MAX_POINTS = 2000
#: Modules listed at the peak.
TOP_MODULES = 10
#: The phase of what was live before the step began (`_diagnosis.snapshot.BEFORE`).
BEFORE = "before the step"
#: The phases, in a Lightning step's order.
PHASES = ("forward", "zero_grad", "backward", "optimizer")
#: Each category's colour (Tableau 10), bottom to top of the stack.
COLOURS = {
    "parameters": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer_state": "#59a14f",
    "activations": "#e15759",
    "temporary": "#b07aa1",
}
PHASE_SHADES = {"forward": "#eef3fa", "zero_grad": "#fdf3e6", "backward": "#f7eef3", "optimizer": "#eef6ec"}
#: The chart's size in SVG units, and its margins.
WIDTH, HEIGHT = 1000, 400
LEFT, RIGHT, TOP, BOTTOM = 78, 16, 44, 42
#: The least share of the chart's width a phase is drawn with.
MIN_PHASE_SHARE = 0.06
#: Rows of phase names above the chart (a phase of few ops sits close to the next).
LABEL_ROWS = 2


@dataclass(frozen=True)
class _Alloc:
    """What an allocation's frames say: its op, tensor, module, phase and category."""

    op: str
    tensor: str
    module: str
    phase: str
    category: str


@dataclass
class StepTimeline:
    """A snapshot replayed: bytes by category after each op, the peak and what is live there.

    Attributes:
        times: the op (``time_us``, the simulation's count) of each point; ``-1``: before the step.
        totals: bytes live by category at each point, in `CATEGORIES`' order.
        phases: each point's phase.
        peak: the highest total; ``peak_index`` the first point at it.
        at_peak: the allocations live at the peak, ``(bytes, frames read)``.
        peak_op: the op whose allocations reach the peak (``""``: the step's start).
    """

    times: list[int] = field(default_factory=list)
    totals: list[tuple[int, ...]] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    peak: int = 0
    peak_index: int = 0
    at_peak: list[tuple[int, _Alloc]] = field(default_factory=list)
    peak_op: str = ""
    peak_module: str = ""

    @property
    def by_category(self) -> dict[str, int]:
        """Bytes by category at the peak."""
        return dict(zip(CATEGORIES, self.totals[self.peak_index], strict=True))

    def modules(self) -> list[tuple[str, int, dict[str, int]]]:
        """The modules by bytes live at the peak, largest first: (module, bytes, bytes by category)."""
        sums: dict[str, dict[str, int]] = {}
        for nbytes, alloc in self.at_peak:
            by = sums.setdefault(alloc.module, dict.fromkeys(CATEGORIES, 0))
            by[alloc.category] += nbytes
        rows = [(name, sum(by.values()), by) for name, by in sums.items()]
        return sorted(rows, key=lambda row: (-row[1], row[0]))

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """Consecutive points of one phase: (phase, first point, last point)."""
        spans: list[tuple[str, int, int]] = []
        for i, phase in enumerate(self.phases):
            if spans and spans[-1][0] == phase:
                spans[-1] = (phase, spans[-1][1], i)
            else:
                spans.append((phase, i, i))
        return spans


def step_timeline(snapshot: dict) -> StepTimeline:
    """Replay ``snapshot`` (one device's trace, as `simulated_snapshot` writes it): one point before the step
    and one after each op with events, the peak and what is live there."""
    read: dict[int, _Alloc] = {}

    def of(frames: list[dict]) -> _Alloc:
        alloc = read.get(id(frames))
        if alloc is None:
            names = {f["filename"]: f["name"] for f in frames}
            alloc = read[id(frames)] = _Alloc(
                names.get("op", ""),
                names.get("tensor", ""),
                names.get("module", "(none)"),
                names.get("phase", ""),
                names.get("category", "temporary"),
            )
        return alloc

    trace = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    # Blocks live when the trace starts: freed with no alloc before, or live at its end with none at all.
    allocated: set[int] = set()
    live: dict[int, tuple[int, list[dict]]] = {}
    for e in trace:
        if e["action"] == "alloc":
            allocated.add(e["addr"])
        elif e["action"] == "free_completed":
            if e["addr"] in allocated:
                allocated.discard(e["addr"])
            else:
                live.setdefault(e["addr"], (e["size"], e["frames"]))
    for seg in snapshot["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and addr not in allocated:
                live[addr] = (b["requested_size"], b["frames"])
            addr += b["size"]

    index = {c: i for i, c in enumerate(CATEGORIES)}
    sums = [0] * len(CATEGORIES)
    for size, frames in live.values():
        sums[index[of(frames).category]] += size
    step = StepTimeline(times=[-1], totals=[tuple(sums)], phases=[BEFORE], peak=sum(sums))
    best_live: dict[int, tuple[int, list[dict]]] = dict(live)
    phase = BEFORE

    i = 0
    while i < len(trace):
        at = trace[i]["time_us"]
        made: list[_Alloc] = []
        freed: list[_Alloc] = []
        while i < len(trace) and trace[i]["time_us"] == at:
            e = trace[i]
            i += 1
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e["frames"])
                alloc = of(e["frames"])
                sums[index[alloc.category]] += e["size"]
                made.append(alloc)
            elif e["action"] == "free_completed":
                size, frames = live.pop(e["addr"])
                alloc = of(frames)
                sums[index[alloc.category]] -= size
                freed.append(alloc)
        phase = _phase(phase, made, freed)
        step.times.append(at)
        step.totals.append(tuple(sums))
        step.phases.append(phase)
        total = sum(sums)
        if total > step.peak:  # an op's frees come before its allocations: its highest total is its last
            step.peak, step.peak_index, best_live = total, len(step.times) - 1, dict(live)
            step.peak_op = next((a.op for a in made if a.op), "")
            step.peak_module = made[0].module if made else ""
    step.at_peak = [(size, of(frames)) for size, frames in best_live.values()]
    return step


def _phase(phase: str, made: list[_Alloc], freed: list[_Alloc]) -> str:
    """The phase of an op, from what it allocated and freed, and the phase before it."""
    for alloc in made:
        if alloc.phase not in ("", BEFORE):
            return alloc.phase
    if (
        phase in (BEFORE, "forward")
        and freed
        and all(a.phase == BEFORE and a.category == "gradients" for a in freed)
    ):
        return "zero_grad"  # the previous step's gradients freed before the backward: Lightning's zero_grad
    return phase


# --------------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------------


def html_report(
    snapshot: dict,
    breakdown: MemoryBreakdown | None = None,
    findings: Sequence[Any] | None = None,
    *,
    title: str = "Peak memory of one simulated training step",
    notes: Iterable[str] = (),
    no_findings: str = "Run memkit advise with the same arguments for what the peak holds that it need not, "
    "with the bytes each fix saves.",
    max_points: int = MAX_POINTS,
) -> str:
    """The step of ``snapshot`` as one self-contained HTML page (inline CSS and SVG, no script, nothing
    fetched): its timeline by category with the phases and the peak, the breakdown and the top modules at
    the peak, and the findings.

    Args:
        snapshot: `memory_snapshot`'s dict of the step (`_diagnosis.snapshot`).
        breakdown: the step's breakdown (`estimate_memory`'s); the snapshot's peak must be it, category by
            category (`ValueError` otherwise: the page would show other figures than the estimate).
        findings: `advise`'s findings (``Advice.findings``: ``kind``, ``what``, ``saved``, ``fix``); ``None``:
            the section says ``no_findings`` instead; empty: no waste found.
        title: the page's heading (the model and the step's settings).
        notes: lines under the heading.
        max_points: the most points the timeline is drawn with.
    """
    step = step_timeline(snapshot)
    if breakdown is not None:
        expected = {c: getattr(breakdown, c) for c in CATEGORIES}
        if step.by_category != expected or step.peak != breakdown.peak:
            raise ValueError(
                f"the snapshot's peak ({step.peak} bytes: {step.by_category}) is not the breakdown's "
                f"({breakdown.peak} bytes: {expected}): a snapshot of another step?"
            )
    data = _data(step, findings)
    body = [
        f"<h1>{_e(title)}</h1>",
        *(f'<p class="note">{_e(note)}</p>' for note in notes),
        _summary(step),
        "<h2>Timeline of the step</h2>",
        _chart(step, max_points),
        _legend(step),
        "<h2>At the peak</h2>",
        _breakdown_table(step),
        _modules_table(step),
        "<h2>Advice</h2>",
        _advice(step, findings, no_findings),
        '<p class="note">Simulated on fake tensors (nothing allocated): the peak and each category are '
        "<code>estimate_memory</code>'s, byte for byte. Written by lightning_memkit.</p>",
    ]
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")  # no tag ends it
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f"<title>{_e(title)}</title>",
            f"<style>{_CSS}</style>",
            "</head>",
            "<body>",
            *body,
            f'<script type="application/json" id="memkit-data">{payload}</script>',
            "</body>",
            "</html>",
            "",
        ]
    )


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _share(n: int, of: int) -> str:
    return f"{100 * n / of:.1f}%" if of else "—"


def _data(step: StepTimeline, findings: Sequence[Any] | None) -> dict[str, Any]:
    """The page's figures, machine-readable (in a JSON script block, which no browser runs)."""
    return {
        "peak": step.peak,
        "at_peak": step.by_category,
        "peak_phase": step.phases[step.peak_index],
        "peak_op": step.peak_op,
        "ops": len(step.times) - 1,
        "top_modules": [
            {"module": name, "bytes": nbytes, "by_category": by}
            for name, nbytes, by in step.modules()[:TOP_MODULES]
        ],
        "findings": None
        if findings is None
        else [{"kind": f.kind, "what": f.what, "saved": f.saved, "fix": f.fix} for f in findings],
    }


def _summary(step: StepTimeline) -> str:
    phase = step.phases[step.peak_index]
    where = (
        f", at <code>{_e(step.peak_op)}</code> in <code>{_e(step.peak_module)}</code>" if step.peak_op else ""
    )
    parts = ", ".join(
        f'<span class="swatch" style="background:{COLOURS[c]}"></span>{c} {_e(format_bytes(n))}'
        for c, n in step.by_category.items()
    )
    return (
        f'<p class="peak">Peak <strong id="peak">{_e(format_bytes(step.peak))}</strong> '
        f"({step.peak:,} bytes), reached in the <strong>{_e(phase)}</strong>{where}.</p>"
        f'<p class="parts">{parts}</p>'
    )


def _downsample(step: StepTimeline, max_points: int) -> list[int]:
    """Indices of about ``max_points`` points (at most 3 more): each the highest of its span, the peak, the
    first and the last among them."""
    n = len(step.times)
    if n <= max_points:
        return list(range(n))
    kept = []
    per = n / max_points
    for k in range(max_points):
        lo, hi = int(k * per), min(int((k + 1) * per), n)
        if lo >= hi:
            continue
        kept.append(max(range(lo, hi), key=lambda j: (sum(step.totals[j]), j == step.peak_index)))
    # The peak's own point (a tie in its span may have kept another), and the step's start and end.
    return sorted({*kept, step.peak_index, 0, n - 1})


def _ticks(top: int) -> list[int]:
    """Round byte values for the y axis, up to ``top``."""
    if top <= 0:
        return [0]
    unit = 1
    while unit * 1024 <= top:
        unit *= 1024
    for step in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000):
        if top / (unit * step) <= 6:
            break
    tick = unit * step
    return [k * tick for k in range(int(top // tick) + 1)]


def _chart(step: StepTimeline, max_points: int) -> str:
    """The stacked timeline as inline SVG."""
    kept = _downsample(step, max_points)
    last = step.times[-1]
    top = max(step.peak, 1) * 1.08
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    xs, bands = _x_scale(step, LEFT, plot_w)

    def x(i: int) -> float:
        return xs[i]

    def y(nbytes: float) -> float:
        return TOP + plot_h * (1 - nbytes / top)

    out = [
        f'<svg id="timeline" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        'aria-label="bytes live over the step, stacked by category">'
    ]
    # The phases: shaded bands, each named at its top (on a second row where the first is taken), the op
    # it starts at under the axis.
    rows_end = [float("-inf")] * LABEL_ROWS
    for phase, x0, x1, t0, t1 in bands:
        shade = PHASE_SHADES.get(phase, "#f4f4f4")
        out.append(
            f'<rect x="{x0:.1f}" y="{TOP}" width="{max(x1 - x0, 0.5):.1f}" height="{plot_h}" fill="{shade}">'
            f"<title>{_e(phase)}: ops {t0 + 1} to {t1}</title></rect>"
        )
        if phase == BEFORE:
            continue
        width = 7.5 * len(phase)
        tx = min(x0 + 3, WIDTH - RIGHT - width)  # the last phase's name kept inside the chart
        row = next((r for r, end in enumerate(rows_end) if end < tx), rows_end.index(min(rows_end)))
        rows_end[row] = tx + width + 6
        out.append(
            f'<line x1="{x0:.1f}" x2="{x0:.1f}" y1="{TOP - 18 * row}" y2="{TOP + plot_h}" '
            f'class="phase-line"/><text x="{tx:.1f}" y="{TOP - 6 - 18 * row}" class="phase">'
            f"{_e(phase)}</text>"
        )
        if LEFT + 20 < x0 < WIDTH - RIGHT - 40:
            out.append(
                f'<text x="{x0:.1f}" y="{TOP + plot_h + 14}" class="tick" text-anchor="middle">'
                f"{t0 + 1}</text>"
            )
    # The y axis: round sizes.
    for tick in _ticks(int(top)):
        ty = y(tick)
        out.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{ty:.1f}" y2="{ty:.1f}" class="grid"/>'
            f'<text x="{LEFT - 6}" y="{ty + 4:.1f}" class="tick" text-anchor="end">'
            f"{_e(format_bytes(tick))}</text>"
        )
    # The stacked areas, parameters at the bottom.
    below = [0] * len(kept)
    for c, category in enumerate(CATEGORIES):
        above = [below[k] + step.totals[i][c] for k, i in enumerate(kept)]
        if any(a != b for a, b in zip(above, below, strict=True)):
            upper = " ".join(f"{x(i):.1f},{y(a):.1f}" for i, a in zip(kept, above, strict=True))
            lower = " ".join(
                f"{x(i):.1f},{y(b):.1f}" for i, b in zip(reversed(kept), reversed(below), strict=True)
            )
            out.append(
                f'<polygon points="{upper} {lower}" fill="{COLOURS[category]}" class="area">'
                f"<title>{category}: {_e(format_bytes(step.by_category[category]))} at the peak</title>"
                "</polygon>"
            )
        below = above
    # The peak: a marker, a line down to the axis and its size.
    px, py = x(step.peak_index), y(step.peak)
    anchor = "end" if px > LEFT + plot_w * 0.7 else "start"
    dx = -8 if anchor == "end" else 8
    out.append(
        f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{py:.1f}" y2="{TOP + plot_h}" class="peak-line"/>'
        f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4.5" class="peak-dot"/>'
        f'<text x="{px + dx:.1f}" y="{py - 6:.1f}" text-anchor="{anchor}" class="peak-label">'
        f"peak {_e(format_bytes(step.peak))}</text>"
    )
    # The x axis.
    out.append(
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" class="axis"/>'
        f'<text x="{LEFT}" y="{TOP + plot_h + 14}" class="tick">0</text>'
        f'<text x="{WIDTH - RIGHT}" y="{TOP + plot_h + 14}" class="tick" text-anchor="end">{last + 1}</text>'
        f'<text x="{LEFT + plot_w / 2:.0f}" y="{HEIGHT - 8}" class="tick" text-anchor="middle">'
        f"ops of the step, in order (each phase at least {100 * MIN_PHASE_SHARE:.0f}% of the width)</text>"
    )
    out.append("</svg>")
    sampled = (
        f" Drawn with {len(kept)} of its {len(step.times)} points, each the highest of its span of ops."
        if len(kept) < len(step.times)
        else ""
    )
    out.append(
        f'<p class="note">Bytes live after each op of the step ({len(step.times) - 1} ops that allocate or '
        f"free), stacked by category as it is counted at the peak.{sampled}</p>"
    )
    return "\n".join(out)


def _x_scale(step: StepTimeline, left: float, width: float) -> tuple[list[float], list[tuple]]:
    """Each point's x, and the phases' bands ``(phase, x0, x1, first op before it, its last op)``: within a
    phase x is the op count; each phase is at least `MIN_PHASE_SHARE` of ``width`` (an optimizer step of a
    few foreach ops, where a large model peaks, would otherwise be a hairline)."""
    spans = step.phase_spans()
    ops = []  # each span's ops: from the previous span's last op to its own
    for k, (_, lo, hi) in enumerate(spans):
        before = step.times[spans[k - 1][2]] if k else step.times[lo]
        ops.append(step.times[hi] - before)
    total = max(sum(ops), 1)
    shares = [max(n / total, MIN_PHASE_SHARE) if n else 0.0 for n in ops]
    scale = width / max(sum(shares), 1e-9)
    xs = [left] * len(step.times)
    bands = []
    x0 = left
    for (phase, lo, hi), n, share in zip(spans, ops, shares, strict=True):
        w = share * scale
        start = step.times[hi] - n  # the op before the span's first
        for j in range(lo, hi + 1):
            xs[j] = x0 + (w * (step.times[j] - start) / n if n else 0.0)
        bands.append((phase, x0, x0 + w, start, step.times[hi]))
        x0 += w
    return xs, bands


def _legend(step: StepTimeline) -> str:
    items = "".join(
        f'<li><span class="swatch" style="background:{COLOURS[c]}"></span>{c}</li>' for c in CATEGORIES
    )
    phases = "".join(
        f'<li><span class="swatch" style="background:{PHASE_SHADES[p]};border:1px solid #bbb"></span>{p}</li>'
        for p in PHASES
        if p in step.phases
    )
    return f'<ul class="legend">{items}</ul><ul class="legend">{phases}</ul>'


def _breakdown_table(step: StepTimeline) -> str:
    rows = []
    for c, n in step.by_category.items():
        width = 100 * n / step.peak if step.peak else 0
        rows.append(
            f'<tr><td><span class="swatch" style="background:{COLOURS[c]}"></span>{c}</td>'
            f'<td class="num" data-bytes="{n}">{_e(format_bytes(n))}</td>'
            f'<td class="num">{_share(n, step.peak)}</td>'
            f'<td class="bar"><div style="width:{width:.1f}%;background:{COLOURS[c]}"></div></td></tr>'
        )
    rows.append(
        f'<tr class="total"><td>peak</td><td class="num" data-bytes="{step.peak}">'
        f'{_e(format_bytes(step.peak))}</td><td class="num">100%</td><td></td></tr>'
    )
    return (
        '<section><h3>Breakdown</h3><table id="breakdown"><thead><tr><th>category</th><th>bytes</th>'
        f"<th>of peak</th><th></th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def _modules_table(step: StepTimeline) -> str:
    modules = step.modules()
    rows = []
    for name, nbytes, by in modules[:TOP_MODULES]:
        bar = "".join(
            f'<div title="{c} {_e(format_bytes(n))}" style="width:{100 * n / max(nbytes, 1):.1f}%;'
            f'background:{COLOURS[c]}"></div>'
            for c, n in by.items()
            if n
        )
        split = ", ".join(f"{c} {format_bytes(n)}" for c, n in by.items() if n)
        rows.append(
            f'<tr><td><code>{_e(name)}</code><div class="split">{_e(split)}</div></td>'
            f'<td class="num" data-bytes="{nbytes}">{_e(format_bytes(nbytes))}</td>'
            f'<td class="num">{_share(nbytes, step.peak)}</td>'
            f'<td class="bar"><div class="stack">{bar}</div></td></tr>'
        )
    more = (
        f'<p class="note">and {len(modules) - TOP_MODULES} more modules '
        f"({format_bytes(sum(n for _, n, _ in modules[TOP_MODULES:]))}).</p>"
        if len(modules) > TOP_MODULES
        else ""
    )
    return (
        f'<section><h3>Top modules at the peak</h3><table id="modules"><thead><tr><th>module</th>'
        f"<th>bytes</th><th>of peak</th><th></th></tr></thead><tbody>{''.join(rows)}</tbody></table>{more}"
        '<p class="note">Each allocation live at the peak counted for the module that made it (in backward: '
        "the module whose forward made the autograd node); parameters, their gradients and optimizer state "
        "for the module owning the parameter.</p></section>"
    )


def _advice(step: StepTimeline, findings: Sequence[Any] | None, no_findings: str) -> str:
    if findings is None:
        return f'<p class="note" id="advice">{_e(no_findings)}</p>'
    if not findings:
        return (
            '<p id="advice">No waste found: every byte at the peak is needed by the step as configured.</p>'
        )
    rows = []
    for i, f in enumerate(findings, 1):
        rows.append(
            f'<tr><td class="num">{i}</td><td class="num" data-bytes="{f.saved}">'
            f'{_e(format_bytes(f.saved))}</td><td class="num">{_share(f.saved, step.peak)}</td>'
            f'<td><code>{_e(f.kind)}</code>: {_e(f.what)}<div class="fix">fix: {_e(f.fix)}</div></td></tr>'
        )
    return (
        '<table id="advice"><thead><tr><th>#</th><th>saves</th><th>of peak</th><th>finding</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
        '<p class="note">Each saving is the drop of the whole step\'s peak with the fix applied '
        "(simulated).</p>"
    )


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1100px;
color:#222;padding:0 16px}
h1{font-size:20px;margin:0 0 8px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:4px 0 8px}
.note{color:#555;font-size:13px;margin:4px 0}.peak{font-size:16px;margin:12px 0 4px}
.parts{margin:0 0 8px}.parts .swatch{margin-left:10px}
svg{width:100%;height:auto;display:block}
.tick{font-size:11px;fill:#555}.phase{font-size:12px;fill:#333;font-weight:600}
.grid{stroke:#ddd;stroke-width:.6}.axis{stroke:#888}.phase-line{stroke:#999;stroke-dasharray:3 3}
.area{stroke:none;opacity:.92}.peak-line{stroke:#c00;stroke-dasharray:4 3}
.peak-dot{fill:#c00;stroke:#fff;stroke-width:1.5}.peak-label{font-size:13px;fill:#c00;font-weight:700}
.legend{list-style:none;padding:0;margin:6px 0;display:flex;flex-wrap:wrap;gap:16px}
.swatch{display:inline-block;width:11px;height:11px;margin-right:5px;vertical-align:-1px;border-radius:2px}
#breakdown{max-width:720px}
table{border-collapse:collapse;width:100%}th,td{padding:4px 8px;border-bottom:1px solid #eee;
text-align:left;vertical-align:top}th{font-weight:600;border-bottom:1px solid #ccc}
.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
.total td{font-weight:700;border-top:1px solid #ccc}
.bar{width:30%}.bar div{height:12px;border-radius:2px}.bar .stack{display:flex;width:100%}
.stack div{border-radius:0}
.split{color:#666;font-size:12px}.fix{color:#135;margin-top:4px}
code{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
"""
