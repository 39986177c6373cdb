"""benchmarks/validate_cuda.py (issue 17) runs on the CPU at tiny sizes, every row: the script the GPU check
runs cannot rot between the sessions that have a device. Its bars are the device's: at tiny sizes row 5's
floor moves with the CPU's bf16 kernels (AVX-512-BF16 kernels keep more scratch than AVX2's), so the dry run
is held to running every row, and the figures themselves are checked by the tests of each feature."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.xdist_group("validate-cuda")
def test_the_cuda_check_runs_dry_on_the_cpu(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("validate_cuda")
    assert script.main(["--dry-run"]) == 0  # every row ran
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ") and "check" not in line]
    numbers = [row.split(".")[0].strip("| ") for row in rows]
    assert numbers == [
        "1",
        "2",
        "1",
        "2",
        "10",
        "4",
        "9",
        "3",
        "6",
        "8",
        "5",
        "7",
        "11",
        "11",
        "11",
        "12",
        "12",
        "13",
        "14",
    ]  # none raised
    assert all(row.rstrip(" |").endswith(("met", "n/a", "**missed**")) for row in rows)


def test_a_row_that_raises_is_a_row_of_the_table(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("validate_cuda")

    def broken(bench):
        raise RuntimeError("CUDA error: out of cheese")

    monkeypatch.setattr(script, "ROWS", (broken,))
    assert script.main(["--dry-run"]) == 1
    assert "| broken raised | RuntimeError: CUDA error: out of cheese" in capsys.readouterr().out


def test_a_lease_runs_the_rows_asked_for_and_keeps_the_table_as_it_grows(capsys, monkeypatch, tmp_path):
    """A device is lent for minutes: ``--rows`` runs only some rows, ``--minutes`` starts none after the
    time is up (listed as not run), and ``--out`` holds the table after every row, should the lease end."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("validate_cuda")
    ran = []

    def first(bench):
        ran.append("first")
        bench.add("first", "figure", "bar", True)

    def second(bench):
        ran.append("second")

    monkeypatch.setattr(script, "ROWS", (first, second))
    out = tmp_path / "table.md"
    assert script.main(["--dry-run", "--rows", "first", "--out", str(out)]) == 0
    assert ran == ["first"] and "| first | figure" in out.read_text()
    assert script.main(["--dry-run", "--minutes", "0", "--out", str(out)]) == 1  # rows left unrun
    assert ran == ["first"]  # nothing started once the time was up
    table = out.read_text()
    assert "| first not run | out of time (0 min)" in table and "| second not run |" in table
    with pytest.raises(SystemExit):
        script.main(["--dry-run", "--rows", "first,third"])
    assert "no row named third" in capsys.readouterr().err
