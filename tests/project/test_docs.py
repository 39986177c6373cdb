"""The README and the documentation (issue 29): the README stays a newcomer's page whose commands, links
and Hugging Face example are true, and the API reference lists every public name. The site's build and
how it renders: tests/project/test_site.py."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
EXAMPLE = REPO / "examples" / "hf" / "train.py"
#: the README's two commands, exactly as .ci/run and a newcomer run them
QUICK_START = (
    'pip install torch==2.13.0 && pip install -e ".[examples]" && python examples/gpt/train.py',
    'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q -n 2',
)


def _env() -> dict[str, str]:
    """This checkout first on the path, whatever checkout an editable install points at."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_the_readme_is_short_and_keeps_the_quick_start_commands():
    text = README.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move the detail into docs/"
    blocks = _code_blocks(text, "bash")
    for command in QUICK_START:
        assert command in (block.strip() for block in blocks), f"not verbatim in a bash block: {command}"


def test_every_relative_link_in_the_readme_exists():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+:|#", link)]
    assert relative, "the README links into docs/"
    missing = [link for link in relative if not (REPO / link.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_example_is_the_script_the_tests_run():
    """The README's Hugging Face code, up to its Trainer (which the script builds from its flags), is
    examples/hf/train.py line for line."""
    text = README.read_text(encoding="utf-8")
    block = next(b for b in _code_blocks(text, "python") if "AutoModelForCausalLM" in b)
    head = block.split("trainer = L.Trainer(")[0]
    script = set(EXAMPLE.read_text(encoding="utf-8").splitlines())
    missing = [line for line in head.splitlines() if line.strip() and line not in script]
    assert not missing, f"README lines not in {EXAMPLE.relative_to(REPO)}: {missing}"


def test_the_api_reference_lists_every_public_name():
    tree = ast.parse((REPO / "lightning_memkit" / "__init__.py").read_text(encoding="utf-8"))
    (exported,) = (
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__"
    )
    names = {ast.literal_eval(element) for element in exported.elts} - {"__version__"}
    api = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^::: lightning_memkit\.(\w+)$", api, flags=re.MULTILINE))
    assert not names - listed, f"add to docs/api.md: {sorted(names - listed)}"


@pytest.mark.slow  # a fresh interpreter that imports torch, Lightning and transformers, then plans
def test_the_readme_hugging_face_example_runs(tmp_path):
    pytest.importorskip("transformers")
    tiny = ["--max-steps", "2", "--batch-size", "4", "--seq-len", "32", "--root-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *tiny],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "AutoFit: micro-batch" in output  # the plan
    assert "Peak training memory" in output  # MemoryMonitor's table
    run = tmp_path / "hf" / "version_0"
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"memory/peak", "memory/activations", "autofit/micro_batch_size"} <= set(header)
    assert (run / "memory.png").is_file()


def test_the_development_pages_layout_names_every_module():
    """docs/development.md's layout of the package, held to the package: each folder's line names every
    module in it, and each top-level module is named (five modules had gone missing)."""
    text = (REPO / "docs" / "development.md").read_text(encoding="utf-8")
    block = re.search(r"^lightning_memkit/\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert block, "docs/development.md has no layout block starting 'lightning_memkit/'"
    entries: dict[str, str] = {}
    name = ""
    for line in block.group(1).splitlines():
        head = re.match(r"  (\S+/)\s", line)
        if head:
            name = head.group(1)
        entries[name] = entries.get(name, "") + line
    package = REPO / "lightning_memkit"
    missing = [
        f"{folder.name}/{module.stem}"
        for folder in sorted(p for p in package.iterdir() if (p / "__init__.py").exists())
        for module in sorted(folder.glob("*.py"))
        if module.stem != "__init__"
        and not re.search(rf"\b{re.escape(module.stem)}\b", entries.get(f"{folder.name}/", ""))
    ]
    missing += [
        module.name
        for module in sorted(package.glob("*.py"))
        if module.stem != "__init__" and module.name not in block.group(1)
    ]
    assert not missing, f"docs/development.md's layout does not name: {missing}"
