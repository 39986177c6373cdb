"""Every script under benchmarks/ imports: they borrow the tests' models and rank runners by module name,
and a test module that moves (tests/<stage>/) must not leave a benchmark that no longer starts."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_IMPORT_EACH = """
import importlib.util, pathlib, sys
for path in sorted(pathlib.Path("benchmarks").glob("*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # each script's main() runs under `if __name__ == "__main__"`
    except Exception as error:
        print(f"FAILED {path.name}: {error!r}")
print("IMPORTED", len(list(pathlib.Path("benchmarks").glob("*.py"))))
"""


@pytest.mark.slow  # a Python of its own importing torch, Lightning, transformers and deepspeed
def test_every_benchmark_imports():
    """One Python imports them all (a few seconds): none fails, and there are some to import."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()  # a library may print too (deepspeed's logger)
    assert not [line for line in lines if line.startswith("FAILED ")], done.stdout
    (count,) = [int(line.split()[1]) for line in lines if line.startswith("IMPORTED ")]
    assert count >= 10, done.stdout
