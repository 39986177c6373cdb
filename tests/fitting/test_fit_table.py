"""What fits a budget: `largest_micro_batch` (any whole number, held to the allocator on the CPU) and
``memkit fit-table``'s grid (each cell a simulated step, the skipped ones known over, the work a count)."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cli, spawn_ranks, steady_step_and_estimate
from models import lm_loss, tiny_lm

from lightning_memkit import estimate_memory, largest_micro_batch
from lightning_memkit._fitting.limits import largest_fitting
from lightning_memkit._fitting.table import fit_table
from lightning_memkit.cli._models import example_batch, load_model, step_options
from lightning_memkit.testing import build_counting_allocator

T = 16  # tokens a sample


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (m, T), generator=torch.Generator().manual_seed(m))
    return ids, ids


def test_the_largest_micro_batch_is_the_allocators():
    """A budget between 20 and 21 samples' steps: the answer is 20 (no power of two), whose real step's
    peak is within the budget and 21's over it, as the CPU allocator counts them; the proof is in it."""
    torch.manual_seed(0)
    model = tiny_lm()
    optimizer = torch.optim.AdamW(model.parameters())
    peaks = {m: steady_step_and_estimate(model, _batch(m), optimizer, lm_loss) for m in (20, 21)}
    (real20, sim20), (real21, sim21) = peaks[20], peaks[21]
    assert all(real <= simulated <= 1.01 * real for real, simulated in peaks.values()), peaks
    budget = (sim20 + min(real21, sim21)) // 2
    found = largest_micro_batch(
        model, _batch(3), budget, margin=0.0, optimizer=optimizer, loss_fn=lm_loss, device="cpu"
    )
    assert found.micro_batch_size == 20 and found.peak == sim20 and found.next_peak == sim21
    assert real20 <= budget < real21  # the allocator's largest micro-batch under the budget
    assert len(found.simulated) <= 6, found.simulated  # probed where the line crosses, not 1, 2, 4, ...
    assert str(found).startswith("largest micro-batch 20: peak ")


def test_largest_fitting_edges():
    """Nothing fits; everything up to the cap fits; a step as flat as a constant."""
    assert largest_fitting(lambda m: 10 + m, 5)[0] == 0
    assert largest_fitting(lambda m: m, 100, max_size=50)[0] == 50
    size, seen = largest_fitting(lambda m: 7 * m + 3, 1000)
    assert size == 142 and 7 * size + 3 <= 1000 < 7 * (size + 1) + 3 and len(seen) <= 5


def test_largest_micro_batch_refuses_bad_arguments():
    model = tiny_lm()
    with pytest.raises(ValueError, match=r"margin must be in \[0, 1\), got 1.5"):
        largest_micro_batch(model, _batch(1), "1GB", margin=1.5, loss_fn=lm_loss)
    with pytest.raises(ValueError, match="max_size must be a whole number of samples, at least 1; got 0"):
        largest_micro_batch(model, _batch(1), "1GB", max_size=0, loss_fn=lm_loss)


@pytest.mark.slow  # about 20 simulations, each checked by one more
def test_the_grid_skips_only_what_a_smaller_cell_settles():
    """Every cell shown with a peak is that step simulated; a cell left unsimulated is over because a cell
    with no more samples and no more tokens is over with every mode; the largest micro-batch at each
    length fits and one more does not."""
    spec = "tiny"
    model = load_model(spec, "lightning")
    options = step_options(model, None)

    def make(b, t):
        return example_batch(model, spec, b, t)

    full = estimate_memory(model, make(2, 64), **options, device="cpu", checkpointing="full").peak
    table = fit_table(
        model, make, full - 1, batch_sizes=(1, 2, 4), seq_lens=(32, 64), precisions=("32-true",),
        modes=("none", "full"), device="cpu", margin=0.0, max_seq_len=128, **options,
    )  # fmt: skip
    assert not table.cell("32-true", 2, 64).fits and table.cell("32-true", 2, 64).peak == full
    for cell in table.cells:
        mode = cell.checkpointing or "full"
        if cell.peak is not None:
            simulated = estimate_memory(
                model, make(cell.batch_size, cell.seq_len), **options, precision="32-true", device="cpu",
                checkpointing=None if mode == "none" else mode,
            ).peak  # fmt: skip
            assert simulated == cell.peak and (simulated <= table.limit) == cell.fits
        else:
            assert cell.known_over and not cell.fits
    assert table.cell("32-true", 4, 64).known_over  # 2 x 64 is over already with either mode
    for t in (32, 64):
        m, peak = table.largest[("32-true", t)]
        over = estimate_memory(model, make(m + 1, t), **options, device="cpu", checkpointing="full").peak
        assert peak <= table.limit < over
    assert table.simulations <= 20


def test_the_cli_prints_one_cell():
    argv = ["fit-table", "--model", "tiny", "--gpu", "24MB", "--device", "cpu", "--batch-sizes", "2"]
    status, out, err = run_cli([*argv, "--seq-lens", "32", "--precision", "32-true", "--max-batch", "2"])
    assert status == 0, err
    assert out.startswith("What fits 24MB (20.60 MiB: 22.89 MiB usable less the 10% margin): tiny, "), out
    cell = next(line for line in out.splitlines() if line.startswith("│ 2 "))
    assert cell.rstrip(" │").endswith("none"), out  # fits without checkpointing
    assert re.search(r"│ largest +│ +at least 2 \(", out), out  # the search stops at --max-batch
    assert "Each cell: the simulated peak" in out


@pytest.mark.slow  # two precisions, twice
def test_the_cli_prints_a_table_per_precision():
    argv = [
        "fit-table", "--model", "tiny", "--gpu", "24MB", "--device", "cpu", "--batch-sizes", "1,2",
        "--seq-lens", "32", "--precision", "32-true,bf16-true", "--checkpointing", "none",
    ]  # fmt: skip
    status, out, err = run_cli(argv)
    assert status == 0, err
    assert out.startswith("What fits 24MB (")
    # the preset's configure_optimizers is AdamW, stepped as its Kahan twin over bf16 weights
    assert "32-true, adamw: static floor" in out and "bf16-true, adamw_kahan: static floor" in out
    assert "│ largest " in out and "longest sequence at micro-batch 1" in out
    assert "Each cell: the simulated peak" in out
    report = json.loads(run_cli([*argv, "--json"])[1])
    assert {c["precision"] for c in report["cells"]} == {"32-true", "bf16-true"}
    assert all(c["fits"] == (c["peak"] is not None and c["peak"] <= report["limit"]) for c in report["cells"])
    assert all(c["state"] == ("fits" if c["fits"] else "over") for c in report["cells"])  # all simulated


def test_the_cli_refuses_a_sequence_past_the_block_size():
    status, _, err = run_cli(
        ["fit-table", "--model", "tiny", "--gpu", "24MB", "--device", "cpu", "--seq-lens", "256"]
    )
    assert status == 2 and "--seq-lens 256 exceeds the model's block_size of 128" in err
    status, _, err = run_cli(["fit-table", "--model", "tiny", "--gpu", "24MB", "--batch-sizes", "1,x"])
    assert status == 2 and "must be positive integers separated by commas (1,2,4,8), got '1,x'" in err


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _beside_the_finder(rank: int, out: Path) -> None:
    """`benchmarks/bench_fit_table.py`'s measures in a fresh process (the counting allocator installed
    before any model is built): 11 and 12 samples' real fits, the budget between them, our answer and
    BatchSizeFinder's in power mode on a pretend device of that size."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_fit_table as bench

    bench.counting_allocator()
    torch.set_num_threads(1)
    below, above = bench.measured(11), bench.measured(12)
    budget = (below + above) // 2
    x = torch.randint(0, 256, (1, bench.T))
    ours = bench.largest_micro_batch(bench.gpt(), (x, x), budget, margin=0.0, device="cpu")
    power, steps, ooms = bench.finder("power", budget)  # raises if the emulated OOM never fired
    record = dict(
        below=below, above=above, budget=budget, ours=ours.micro_batch_size, simulated=ours.peak,
        next_simulated=ours.next_peak, power=power, steps=steps, ooms=ooms, per_trial=bench.STEPS,
        power_peak=bench.measured(power), trial_off=max(abs(p - bench.measured(m)) for m, p in bench.trials),
    )  # fmt: skip
    (out / "record.json").write_text(json.dumps(record))


@pytest.mark.slow  # two real fits, four simulated steps and BatchSizeFinder's trials: about 30 s
def test_largest_micro_batch_finds_the_true_maximum_where_the_power_finder_stops_lower(tmp_path):
    """The tiny GPT's real fits under the counting allocator put the truth at 11 samples (12 over the
    budget); `largest_micro_batch` answers 11 from simulated steps, within 0.1 % of the measured peaks.
    Lightning's BatchSizeFinder(mode="power"), its trials stopped by an out-of-memory error emulated past
    the budget from the module's own hooks, stops at 8: the last power of two that ran."""
    build_counting_allocator()
    spawn_ranks(_beside_the_finder, (tmp_path,), world=1, what="fit-table benchmark")
    r = json.loads((tmp_path / "record.json").read_text())

    assert r["below"] <= r["budget"] < r["above"]  # truth: 11 fits, 12 does not
    assert r["ours"] == 11, r
    assert abs(r["simulated"] - r["below"]) <= 1e-3 * r["below"], r
    assert abs(r["next_simulated"] - r["above"]) <= 1e-3 * r["above"], r
    assert r["power"] == 8 and r["power_peak"] <= r["budget"], r
    assert r["ooms"] == 1 and r["steps"] == 4 * r["per_trial"] + 1, r  # 1, 2, 4, 8 ran; 16 failed at once
    assert r["trial_off"] <= 1e-3 * r["below"], r  # the trials' steps peak as fresh fits at their sizes


def _lm_table(budget, **kw):
    model = tiny_lm()

    def make(b, t):
        ids = torch.zeros(b, t, dtype=torch.long, device="meta")
        return ids, ids.clone()

    kw = {"batch_sizes": (1, 2), "seq_lens": (16,), "precisions": ("32-true",), **kw}
    return fit_table(model, make, budget, optimizer="sgd", loss_fn=lm_loss, device="cpu", margin=0.0, **kw)


def test_a_search_cut_short_is_not_searched_not_none():
    """--max-simulations stopping the largest and longest searches leaves them unknown (None), not "nothing
    fits"; a cell never simulated says so, apart from one known over."""
    table = _lm_table("1GB", batch_sizes=(1, 2, 4), max_simulations=2, max_seq_len=64)
    assert [c.state for c in table.cells] == ["fits", "fits", "not simulated"]
    assert table.largest[("32-true", 16)] is None and table.longest["32-true"] is None and table.truncated
    from lightning_memkit._fitting.table import Cell

    assert Cell("32-true", 4, 16, None, None, known_over=True).state == "over"


def test_the_longest_sequence_includes_a_block_size_off_the_steps():
    """A block size of 200 (100) tokens: the longest sequence is 200 (100) with that step's peak, not 128
    (nothing fits)."""
    for block in (200, 100):
        table = _lm_table("1GB", batch_sizes=(1,), max_seq_len=block, max_batch=2)
        ids = torch.zeros(1, block, dtype=torch.long, device="meta")
        peak = estimate_memory(tiny_lm(), (ids, ids), optimizer="sgd", loss_fn=lm_loss, device="cpu").peak
        assert table.longest["32-true"] == (block, peak)


def test_a_largest_micro_batch_at_max_batch_is_a_lower_bound():
    table = _lm_table("1GB", max_batch=4, max_seq_len=16)
    assert table.largest[("32-true", 16)][0] == 4 and table.at_max_batch == {("32-true", 16)}


def test_modes_are_tried_lightest_first_and_precisions_once():
    """--checkpointing full,none: "none" is the lightest, "full" the strongest, whatever the order."""
    model = load_model("tiny", "lightning")
    table = fit_table(
        model, lambda b, t: example_batch(model, "tiny", b, t), "1GB", batch_sizes=(1,), seq_lens=(32,),
        precisions=("32-true", "32-true"), modes=("full", "none"), device="cpu", max_simulations=0,
    )  # fmt: skip
    assert table.modes == ("none", "full") and table.precisions == ("32-true",) and len(table.cells) == 1


def test_a_probe_past_the_example_batch_allocates_nothing():
    """Sizes past the example batch are its samples repeated on the meta device: a billion samples (64 GB
    of token ids as real tensors) are probed without allocating them, and the search stops at max_size."""
    from lightning_memkit._fitting.limits import _resized

    make = _resized(_batch(3), None)
    assert make(2)[0].device.type == "cpu" and make(2)[0].shape == (2, T)
    assert make(10**9)[0].device.type == "meta" and make(10**9)[0].shape == (10**9, T)
    found = largest_micro_batch(tiny_lm(), _batch(3), 10**18, optimizer="sgd", loss_fn=lm_loss, device="cpu",
                                max_size=10**9)  # fmt: skip
    assert found.micro_batch_size == 10**9 and found.next_peak is None


def test_a_failing_step_says_which_model_and_batch(tmp_path, monkeypatch):
    """A factory model whose step raises a ValueError: the error names the model, the failing cell's batch
    and how to give another, as memkit estimate's does (it printed the bare ValueError)."""
    (tmp_path / "fit_table_models.py").write_text(
        "import torch\n\n\nclass Images(torch.nn.Linear):\n    def forward(self, x):\n"
        "        raise ValueError('expected pixel_values')\n\n\ndef build():\n    return Images(4, 4)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["fit-table", "--model", "fit_table_models:build", "--gpu", "1GB", "--device", "cpu"]
    status, _, err = run_cli([*argv, "--batch-sizes", "2,3", "--seq-lens", "8,16", "--precision", "32-true"])
    sys.modules.pop("fit_table_models", None)
    assert status == 2, err
    assert re.search(
        r"--model fit_table_models:build: the simulated training step failed: ValueError: expected "
        r"pixel_values; the batch was \(x, y\), int64 token ids of shape \(2, 8\), stepped as "
        r"cross_entropy\(model\(x\), y\); a model that takes other inputs .* defines example_batch",
        err,
    ), err
