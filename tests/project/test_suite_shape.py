"""The suite's own shape, held as its pages describe it: its tests sit in the folder of the package stage
they test, and every Trainer they build is the suite's (`helpers.trainer_arguments`), so a default the
suite relies on (one CPU, no progress bar, no checkpoints) is written once."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "lightning_memkit"

#: Trainers built otherwise, and why: the GPT example's test runs the example's Trainer as its page shows it.
OWN_TRAINERS = {"demos/test_gpt.py"}


def _trainer_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name == "Trainer":
                yield node


def test_every_trainer_the_suite_builds_takes_the_suites_arguments():
    """A ``Trainer(...)`` call outside `helpers` spreads ``**trainer_arguments(...)`` (or a fixture built on
    it, ``trainer_kwargs``); `helpers.cpu_trainer` is the short form."""
    spelled_out = []
    for path in sorted(TESTS.rglob("*.py")):
        where = path.relative_to(TESTS).as_posix()
        if where in OWN_TRAINERS or where == "helpers.py":
            continue
        for call in _trainer_calls(ast.parse(path.read_text())):
            if not any(keyword.arg is None for keyword in call.keywords):
                spelled_out.append(f"{where}:{call.lineno}")
    assert spelled_out == [], f"Trainers with their own arguments (use helpers.cpu_trainer): {spelled_out}"


def test_the_test_folders_are_the_package_stages():
    """``tests/<stage>/`` for each of the package's stages (``_measuring`` is ``measuring``), and
    ``project`` for the suite's checks of the project itself; `AutoFitStrategy` (``strategies``) is tested
    with the sharding it plans, in ``sharding``."""
    stages = {p.name.lstrip("_") for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders - stages == {"project"}, folders - stages
    assert stages - folders == {"strategies"}, stages - folders
