"""The versions the package declares are the versions the project has run: the torch floor is the torch of
the GPU check (docs/gpu-check.md) or of this suite, and the suite runs within what is declared (the
installed package's metadata, what pip enforces)."""

import re
from importlib.metadata import requires
from pathlib import Path

import lightning
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _requirement(name: str) -> Requirement:
    (found,) = [r for r in map(Requirement, requires("lightning-memkit")) if r.name == name and not r.marker]
    return found


def _minor(version: str) -> Version:
    return Version(".".join(version.split("+")[0].split(".")[:2]))


def test_the_torch_floor_is_a_torch_the_project_ran():
    checked = re.search(r"torch (\d+\.\d+\.\d+)\+cu", (ROOT / "docs" / "gpu-check.md").read_text())
    assert checked, "docs/gpu-check.md names the torch its GPU run used"
    ran = {_minor(checked.group(1)), _minor(torch.__version__)}
    (floor,) = [Version(s.version) for s in _requirement("torch").specifier if s.operator == ">="]
    assert floor in ran, f"torch>={floor} is declared; the project ran {sorted(map(str, ran))}"


def test_this_suite_runs_within_what_is_declared():
    for name, version in (("torch", torch.__version__), ("lightning", lightning.__version__)):
        assert Version(version.split("+")[0]) in _requirement(name).specifier, (name, version)
