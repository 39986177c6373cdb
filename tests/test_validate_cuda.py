"""benchmarks/validate_cuda.py (issue 17) runs on the CPU at tiny sizes, every row: the script the GPU check
runs cannot rot between the sessions that have a device. Its bars are the device's: at tiny sizes row 5's
floor moves with the CPU's bf16 kernels (AVX-512-BF16 kernels keep more scratch than AVX2's), so the dry run
is held to running every row, and the figures themselves are checked by the tests of each feature."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
@pytest.mark.xdist_group("validate-cuda")
def test_the_cuda_check_runs_dry_on_the_cpu(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("validate_cuda")
    assert script.main(["--dry-run"]) == 0  # every row ran
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ") and "check" not in line]
    numbers = [row.split(".")[0].strip("| ") for row in rows]
    assert numbers == ["1", "2", "1", "2", "3", "4", "8", "5", "6", "7", "9", "10"]  # no row raised
    assert all(row.rstrip(" |").endswith(("met", "n/a", "**missed**")) for row in rows)


def test_a_row_that_raises_is_a_row_of_the_table(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("validate_cuda")

    def broken(bench):
        raise RuntimeError("CUDA error: out of cheese")

    monkeypatch.setattr(script, "ROWS", (broken,))
    assert script.main(["--dry-run"]) == 1
    assert "| broken raised | RuntimeError: CUDA error: out of cheese" in capsys.readouterr().out
