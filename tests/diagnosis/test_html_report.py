"""The HTML report of a simulated step (issue 29, item 8b): one self-contained page whose figures are the
estimate's, byte for byte, and that a browser renders with the peak, the categories, the phases, the top
modules and the advice's fixes.

The figures are checked three ways: the page's embedded data against `estimate_memory`'s breakdown, its top
modules against the snapshot replayed as torch's viewer replays it (`test_snapshot._replay`), and its text
as headless Chromium renders it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from collections import defaultdict
from html.parser import HTMLParser

import pytest
import torch
from helpers import run_cli
from test_snapshot import _frame, _replay
from zoo import ZooModule, zoo_batch

from lightning_memkit import advise, estimate_memory
from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, format_bytes
from lightning_memkit._diagnosis.advise import Finding
from lightning_memkit._diagnosis.html_report import PHASES, _downsample, html_report, step_timeline
from lightning_memkit._diagnosis.snapshot import simulated_snapshot

#: Elements HTML closes itself.
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
#: Attributes that fetch or navigate.
FETCHING = {"src", "href", "xlink:href", "action", "srcset", "data", "poster", "formaction"}


class _Page(HTMLParser):
    """The page's tags checked for nesting, its fetching attributes, its visible text and its data block."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.fetches: list[str] = []
        self.tags: set[str] = set()
        self.text: list[str] = []
        self.chart: list[str] = []  # the text drawn in the SVG
        self.data = ""
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.fetches += [f"{tag} {name}={value}" for name, value in attrs if name in FETCHING]
        if tag in ("script", "style"):
            self._in = dict(attrs).get("id", tag)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.add(tag)
        self.fetches += [f"{tag} {name}={value}" for name, value in attrs if name in FETCHING]

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else 'nothing'}>")
            return
        self.stack.pop()
        self._in = None

    def handle_data(self, data):
        if self._in == "memkit-data":
            self.data += data
        elif self._in is None:
            self.text.append(data)
            if "svg" in self.stack and "title" not in self.stack:  # a tooltip is not drawn
                self.chart.append(data)

    @property
    def visible(self) -> str:
        return re.sub(r"\s+", " ", " ".join(self.text))


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    parser.close()
    return parser


@contextlib.contextmanager
def _one_thread():
    """`conftest.one_thread`, for a module's fixture: tiny models on one thread (a shared CPU cannot stall
    them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gpt2():
    """The zoo's GPT-2 (Hugging Face's code): its model and batch, its estimate, its snapshot and its page."""
    model, batch = ZooModule("gpt2"), zoo_batch("gpt2")
    with _one_thread():
        estimate = estimate_memory(model, batch, device="cpu")
        snapshot, _ = simulated_snapshot(model, batch, device="cpu")
    page = html_report(snapshot, estimate, title="zoo gpt2")
    return (model, batch), estimate, snapshot, page


@pytest.fixture(scope="module")
def advised(gpt2):
    """`advise` of the same step (about 4 s) and the page with its findings."""
    (model, batch), _, snapshot, _ = gpt2
    with _one_thread():
        advice = advise(model, batch, device="cpu")
    return advice, html_report(snapshot, advice.breakdown, advice.findings, title="zoo gpt2, advised")


def _top_modules(snapshot: dict) -> list[tuple[str, int]]:
    """What is live at the snapshot's first highest total, by module frame, largest first (the replay of
    `test_snapshot`, independent of the report's)."""
    best, at_best = -1, {}
    for live in _replay(snapshot):
        total = sum(size for size, _ in live.values())
        if total > best:
            best, at_best = total, dict(live)
    sums: dict[str, int] = defaultdict(int)
    for size, frames in at_best.values():
        sums[_frame(frames, "module")] += size
    return sorted(sums.items(), key=lambda item: (-item[1], item[0]))


def test_the_figures_are_the_estimates(gpt2):
    _, estimate, snapshot, page = gpt2
    data = json.loads(_parse(page).data)
    assert data["peak"] == estimate.peak
    assert data["at_peak"] == {c: getattr(estimate, c) for c in CATEGORIES}
    assert sum(data["at_peak"].values()) == data["peak"]
    tops = [(m["module"], m["bytes"]) for m in data["top_modules"]]
    assert tops == _top_modules(snapshot)[:10]
    assert len(tops) == 10 and tops[0][1] >= tops[-1][1] > 0
    assert all(sum(m["by_category"].values()) == m["bytes"] for m in data["top_modules"])
    assert data["findings"] is None
    # The same figures in the text, in the units the CLI prints.
    text = _parse(page).visible
    assert f"Peak {format_bytes(estimate.peak)} ({estimate.peak:,} bytes)" in text
    for c in CATEGORIES:
        assert f"{c} {format_bytes(getattr(estimate, c))}" in text
    for module, nbytes in tops:
        assert module in text and format_bytes(nbytes) in text
    assert "Run memkit advise" in text


@pytest.mark.slow
def test_the_advice_is_on_the_page(gpt2, advised):
    """The advice's page: the same step (the advisor's breakdown is the estimate's) and every finding,
    largest saving first, with its fix."""
    _, estimate, _, _ = gpt2
    advice, page = advised
    assert advice.breakdown == estimate
    data = json.loads(_parse(page).data)
    assert data["peak"] == estimate.peak
    assert data["findings"] == advice.as_dict()["findings"] and data["findings"]
    text = _parse(page).visible
    for finding in advice.findings:
        assert " ".join(finding.fix.split()) in text


def test_the_timeline_has_the_phases_and_is_the_tracker_count(gpt2):
    _, estimate, snapshot, _ = gpt2
    step = step_timeline(snapshot)
    assert max(sum(t) for t in step.totals) == estimate.peak == sum(step.totals[step.peak_index])
    assert [p for p, _, _ in step.phase_spans()] == ["before the step", *PHASES]
    assert step.phases[step.peak_index] in PHASES
    assert step.times == sorted(step.times) and len(set(step.times)) == len(step.times)


def test_a_long_step_is_downsampled_around_its_peak(gpt2):
    _, estimate, snapshot, _ = gpt2
    step = step_timeline(snapshot)
    assert len(step.times) > 100
    for limit in (7, 50, 100):
        kept = _downsample(step, limit)
        assert len(kept) <= limit + 3 and {step.peak_index, 0, len(step.times) - 1} <= set(kept)
        assert kept == sorted(set(kept))
    small = html_report(snapshot, estimate, max_points=50)
    full = html_report(snapshot, estimate)
    assert len(small) < len(full)
    assert json.loads(_parse(small).data) == json.loads(_parse(full).data)  # the figures do not change
    area = re.search(r'<polygon points="([^"]*)"', small).group(1)
    assert len(area.split()) <= 2 * 53


def test_the_page_is_self_contained_and_well_formed(gpt2):
    _, _, snapshot, page = gpt2
    finding = Finding("logits", "a <script>alert(1)</script> & 'quotes'", 1024, 'fix "<b>this</b>" http://x')
    with_findings = html_report(snapshot, findings=[finding], title="<title> & such")
    text = _parse(with_findings).visible  # markup in the text is shown, not run or rendered
    assert "a <script>alert(1)</script> & 'quotes'" in text and "<title> & such" in text
    assert 'fix: fix "<b>this</b>" http://x' in text
    for html in (page, with_findings.replace("http://x", "x")):
        parsed = _parse(html)
        assert not parsed.errors and not parsed.stack, (parsed.errors, parsed.stack)
        assert not parsed.fetches, parsed.fetches
        assert {"svg", "polygon", "table", "style"} <= parsed.tags
        assert "http://" not in html and "https://" not in html
        assert not re.search(r"url\(|@import|<link|<iframe|<img", html)
        assert not re.search(r"<script(?![^>]*type=\"application/json\")", html)  # no code runs


def test_a_breakdown_of_another_step_is_refused(gpt2):
    _, estimate, snapshot, _ = gpt2
    other = MemoryBreakdown(**{**{c: getattr(estimate, c) for c in CATEGORIES}, "temporary": 0})
    with pytest.raises(ValueError, match="not the breakdown's"):
        html_report(snapshot, other)


def _rendered(path, timeout: float = 60) -> str:
    """The DOM headless Chromium renders from ``path``."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed: the HTML report is not rendered in a browser here")
    done = subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--dump-dom", path.as_uri()],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_a_browser_renders_it(gpt2, advised, tmp_path):
    _, estimate, _, page = gpt2
    advice, advised = advised
    path = tmp_path / "estimate.html"
    path.write_text(page, encoding="utf-8")
    dom = _parse(_rendered(path))
    text = dom.visible
    assert {"svg", "polygon", "circle", "table"} <= dom.tags
    chart = " ".join(dom.chart)
    assert f"peak {format_bytes(estimate.peak)}" in chart  # the marker's label
    for phase in PHASES:
        assert phase in chart
    for c in CATEGORIES:
        assert f"{c} {format_bytes(getattr(estimate, c))}" in text
    top = json.loads(dom.data)["top_modules"][0]["module"]
    assert top.startswith("model.transformer.h.") and top in text

    path = tmp_path / "advised.html"
    path.write_text(advised, encoding="utf-8")
    text = _parse(_rendered(path)).visible
    assert advice.findings
    for finding in advice.findings:
        fix = re.sub(r"\s+", " ", finding.fix)
        assert f"fix: {fix}" in text
        assert format_bytes(finding.saved) in text


def test_cli_estimate_writes_it(tmp_path):
    path = tmp_path / "step.html"
    argv = ["estimate", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--device", "cpu"]
    status, out, err = run_cli([*argv, "--html", str(path)])
    assert status == 0, err
    said = [line for line in out.splitlines() if str(path) in line]
    assert said == [
        f"HTML report of the simulated step written to {path} (self-contained: open it in a browser)"
    ]
    status, out, _ = run_cli([*argv, "--json"])
    assert status == 0
    simulated = json.loads(out)["simulated"]
    data = json.loads(_parse(path.read_text(encoding="utf-8")).data)
    assert data["peak"] == simulated["peak"]
    assert data["at_peak"] == {c: simulated[c] for c in CATEGORIES}
    assert data["findings"] is None


@pytest.mark.slow
def test_cli_advise_writes_it_with_the_findings(tmp_path):
    path = tmp_path / "advice.html"
    argv = ["advise", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--device", "cpu"]
    status, out, err = run_cli([*argv, "--json", "--html", str(path)])
    assert status == 0, err
    report = json.loads(out)
    assert report["html"] == str(path)
    data = json.loads(_parse(path.read_text(encoding="utf-8")).data)
    assert data["peak"] == report["breakdown"]["peak"]
    assert data["findings"] == report["findings"] and data["findings"]
