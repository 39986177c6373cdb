"""The documentation site as a reader sees it (issue 49, item 6): `mkdocs build --strict` passing is not
enough, so the built pages are rendered by headless Chromium, as tests/diagnosis/test_html_report.py renders
the HTML report, and read for what a reader would trip on: a menu bar that wraps into rows, a command broken
across lines, a literal `**` where bold was meant, an API signature as one line running off the page.

One Chromium run renders every page: a probe page holds each page in a 1280 x 900 frame (a laptop's
window) and, once all have loaded, writes what it measured into its own DOM, which `--dump-dom` prints.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys

import pytest
from test_docs import REPO, _env

#: The width the pages are rendered at: a laptop's browser window.
WIDTH = 1280

#: Runs in each page (a frame of the probe page): what a reader sees, as JSON-ready values.
PROBE_PAGE = """
function inspect(doc) {
  const items = [...doc.querySelectorAll('#navbar-collapse > ul > li')].map((li) => {
    const box = li.getBoundingClientRect();
    return {text: li.innerText.trim(), top: box.top, height: box.height};
  });
  const broken = [...doc.querySelectorAll(':not(pre) > code')]
    .filter((c) => c.innerText.includes('\\n')).map((c) => c.innerText);
  const stars = [];
  const walker = doc.createTreeWalker(doc.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest('code, pre, script, style')) continue;
    // `**` meant as bold, left literal: not between two word characters (2**20 is arithmetic)
    if (/(^|\\W)\\*\\*|\\*\\*(\\W|$)/.test(node.data)) stars.push(node.data.trim());
  }
  const signatures = [...doc.querySelectorAll('.doc-signature pre')].map((pre) => ({
    text: pre.innerText,
    overflow: pre.scrollWidth - pre.clientWidth,
  }));
  return {title: doc.title, nav: items, broken_code: broken, stars: stars, signatures: signatures};
}
window.addEventListener('load', () => {
  const pages = {};
  for (const frame of document.querySelectorAll('iframe')) {
    pages[frame.dataset.page] = inspect(frame.contentDocument);
  }
  document.getElementById('probe').textContent = JSON.stringify(pages);
});
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built strictly (a broken link or reference fails) into a temporary folder."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed: pip install -e '.[docs]'")
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return site


@pytest.fixture(scope="module")
def rendered(site, tmp_path_factory) -> dict[str, dict]:
    """Every page of the site as headless Chromium lays it out, by its path in the site."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed: the site is not rendered in a browser here")
    pages = sorted(str(p.relative_to(site)) for p in site.rglob("index.html"))
    frames = "\n".join(
        f'<iframe data-page="{html.escape(page)}" src="{(site / page).as_uri()}" '
        f'width="{WIDTH}" height="900"></iframe>'
        for page in pages
    )
    probe = tmp_path_factory.mktemp("probe") / "probe.html"
    probe.write_text(
        f'<!doctype html><html><body><pre id="probe"></pre>\n{frames}\n<script>{PROBE_PAGE}</script>'
        "</body></html>",
        encoding="utf-8",
    )
    done = subprocess.run(
        [
            chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--allow-file-access-from-files",  # the probe reads its frames' documents
            f"--window-size={WIDTH + 40},1000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, flags=re.DOTALL)
    assert found and found.group(1), f"the probe wrote nothing: {done.stdout[-2000:]}"
    measured = json.loads(html.unescape(found.group(1)))
    assert set(measured) == set(pages)
    return measured


@pytest.mark.slow  # about 4 s: griffe reads the package, mkdocstrings renders every docstring
def test_the_site_builds_strictly_with_the_api_reference(site):
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("MemoryMonitor", "AutoFit", "AutoFitStrategy", "estimate_memory", "PretendOOM"):
        assert name in api
    assert "Known not to work" in (site / "models" / "index.html").read_text(encoding="utf-8")


@pytest.mark.slow  # the build, then Chromium over every page: about 10 s
def test_the_menu_bar_is_one_row(rendered):
    for page in ("index.html", "api/index.html"):
        nav = rendered[page]["nav"]
        assert len(nav) >= 5, nav  # the sections, search, previous and next
        tops = {round(item["top"]) for item in nav}
        heights = [item["height"] for item in nav]
        assert len(tops) == 1, f"{page}: the menu bar wraps into {len(tops)} rows at {WIDTH} px: {nav}"
        assert max(heights) < 1.5 * min(heights), f"{page}: an item wraps onto two lines: {nav}"


@pytest.mark.slow
def test_no_inline_command_is_broken_across_lines(rendered):
    broken = {page: found["broken_code"] for page, found in rendered.items() if found["broken_code"]}
    assert not broken, f"inline code rendered over two lines (a line break in the Markdown): {broken}"


@pytest.mark.slow
def test_no_literal_bold_markers(rendered):
    stars = {page: found["stars"] for page, found in rendered.items() if found["stars"]}
    assert not stars, f"`**` rendered as text, not bold: {stars}"


@pytest.mark.slow
def test_api_signatures_are_one_parameter_a_line_and_fit_the_page(rendered):
    signatures = rendered["api/index.html"]["signatures"]
    assert len(signatures) >= 20, "the API reference renders its signatures in their own blocks"
    monitor = next(s["text"] for s in signatures if s["text"].startswith("MemoryMonitor("))
    lines = monitor.splitlines()
    assert len(lines) >= 8, f"MemoryMonitor's signature is not formatted (is ruff installed?): {monitor}"
    assert lines[1].strip().startswith("budget:"), lines
    wide = [(s["overflow"], s["text"][:120]) for s in signatures if s["overflow"] > 1]
    assert not wide, f"signatures wider than the page at {WIDTH} px (px too wide, signature): {wide}"
