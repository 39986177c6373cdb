"""``memkit`` parses its arguments before it imports torch: ``--help``, ``plan --help`` and a usage error
(and ``import lightning_memkit`` alone) leave torch, Lightning and transformers unimported, while every
public name still resolves. Each check runs in a fresh subprocess (this one has torch imported already);
how fast they answer is `benchmarks/bench_cli_startup.py`'s to say."""

import json
import subprocess
import sys

import pytest

import lightning_memkit

HEAVY = ("torch", "lightning", "transformers")

# Runs ``memkit <argv>`` as the console script does, then prints the heavy modules imported (stdout's
# last line, JSON) after the command's own output.
_MEMKIT = """
import json, sys
from lightning_memkit.cli import main
sys.argv = ["memkit", *json.loads(sys.argv[1])]
status = main()
sys.stdout.flush()
print()
print(json.dumps({{"status": status, "heavy": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""


def _memkit(*argv, heavy=HEAVY):
    """(exit status, the ``heavy`` modules imported, stdout, stderr) of ``memkit argv`` in a subprocess."""
    done = subprocess.run(
        [sys.executable, "-c", _MEMKIT.format(heavy=heavy), json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    *out, last = done.stdout.rstrip("\n").split("\n")
    result = json.loads(last)
    return result["status"], result["heavy"], "\n".join(out), done.stderr


@pytest.mark.parametrize(
    "argv, status",
    [
        (["--help"], 0),
        (["plan", "--help"], 0),
        (["estimate", "--help"], 0),
        (["advise", "--help"], 0),
        (["plan", "--gpu"], 2),  # --gpu without its value
        (["plan", "--model", "tiny", "--gpu", "A100-41GB", "--global-batch", "8", "--seq-len", "64"], 2),
        (["plan", "--model", "tiny", "--gpu", "24GB", "--global-batch", "8", "--seq-len", "64", "--gpus"], 2),
        (["estimate", "--model", "tiny", "--batch-size", "0", "--seq-len", "64"], 2),
        (["estimate", "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--precision", "bf16"], 2),
        (["frobnicate"], 2),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_parsing_imports_no_torch(argv, status):
    got, heavy, out, err = _memkit(*argv)
    assert got == status, err
    assert heavy == [], f"memkit {' '.join(argv)} imported {heavy}"
    if status == 2:
        assert "error:" in err and len(err.strip().splitlines()) == 1, err  # the one-line error
    else:
        assert "usage: memkit" in out


def test_plan_help_lists_the_gpu_names():
    _, _, out, _ = _memkit("plan", "--help")
    flat = " ".join(out.split())  # argparse wraps the help
    for name in lightning_memkit.GPUS:
        assert name in flat, name
    assert "A100-40GB" in flat and "H100-80GB" in flat


def test_a_typo_in_the_gpu_name_is_answered_from_the_light_table():
    status, heavy, _, err = _memkit(
        "plan", "--model", "tiny", "--gpu", "A100-41GB", "--global-batch", "8", "--seq-len", "64"
    )
    assert (status, heavy) == (2, [])
    assert "Did you mean A100-40GB" in err


@pytest.mark.slow  # a subprocess that imports torch and plans: the full tier's
def test_a_command_that_parses_imports_the_rest_and_runs():
    """After parsing the subcommand's module is imported: the run itself still works from a process."""
    status, heavy, out, err = _memkit(
        "estimate", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--device", "cpu", "--json"
    )
    assert status == 0, err
    assert "torch" in heavy and "lightning" in heavy
    assert json.loads(out)["simulated"]["peak"] > 0


@pytest.mark.slow  # a subprocess that imports torch and plans: the full tier's
def test_a_plan_that_builds_no_8bit_optimizer_leaves_bitsandbytes_unimported():
    """Importing bitsandbytes costs a plan about 1 s after torch and Lightning (a 7B plan's 15 s bar): its
    candidates are listed where it is installed, and it is imported only to build one of them."""
    argv = ("plan", "--model", "tiny", "--gpu", "24GB", "--global-batch", "8", "--seq-len", "64", "--json")
    status, heavy, out, err = _memkit(*argv, heavy=("bitsandbytes", "lightning"))
    assert status == 0, err
    assert heavy == ["lightning"]
    assert json.loads(out)["optimizer"] == "adamw"


def test_python_dash_m_help_imports_no_torch():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['memkit', 'plan', '--help']\n"
        "try:\n"
        "    runpy.run_module('lightning_memkit.cli', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_import_lightning_memkit_alone_is_light():
    code = f"import sys, lightning_memkit; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.slow  # a fresh process importing every public name: the full tier's
def test_every_public_name_resolves_in_a_fresh_process():
    """``from lightning_memkit import X`` and ``lightning_memkit.X`` for every X of ``__all__``, each the
    object of the module it comes from; ``import *`` too; submodules as attributes, as before."""
    code = (
        "import importlib, lightning_memkit as lm\n"
        "for name in lm.__all__:\n"
        "    value = getattr(lm, name)\n"
        "    if name != '__version__':\n"
        "        assert value is getattr(importlib.import_module(lm._EXPORTS[name]), name), name\n"
        "ns = {}\n"
        "exec('from lightning_memkit import *', ns)\n"
        "assert set(lm.__all__) <= set(ns), set(lm.__all__) - set(ns)\n"
        "assert set(lm.__all__) <= set(dir(lm))\n"
        "assert lm.callbacks.AutoFit is lm.AutoFit and lm._budget.GPUS is lm.GPUS\n"
        "try:\n"
        "    lm.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('lm.no_such_name resolved')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_every_public_name_resolves_here():
    assert set(lightning_memkit._EXPORTS) | {"__version__"} == set(lightning_memkit.__all__)
    for name in lightning_memkit.__all__:
        assert getattr(lightning_memkit, name) is not None, name


def test_the_parsers_names_are_the_librarys():
    """The names the parsers accept come from the torch-free modules the library itself reads."""
    from lightning_memkit._checkpointing import policies as _checkpointing
    from lightning_memkit._estimating import analytic as _analytic
    from lightning_memkit._estimating import fake_step as _fake_step
    from lightning_memkit._estimating import precision as _precision
    from lightning_memkit._step import LEVERS
    from lightning_memkit.cli import _parsers, parser
    from lightning_memkit.demos import gpt

    assert _parsers.PRESETS == tuple(gpt.PRESETS) == tuple(_analytic.PRESETS)
    assert tuple(_precision.PRECISION_DTYPES) == _parsers.PRECISIONS
    assert _fake_step.DEVICES is _parsers.DEVICES
    assert _checkpointing.CHECKPOINT_MODES is _parsers.CHECKPOINT_MODES
    assert set(_parsers.RELAXED_PRECISIONS) <= set(_parsers.PRECISIONS)
    # what the plan's relaxed attempts read from the parsed arguments: one flag per lever
    args = parser().parse_args(
        ["plan", "--model", "tiny", "--gpu", "24GB", "--global-batch", "8", "--seq-len", "8"]
    )
    assert all(hasattr(args, lever) for lever in LEVERS)
