"""What a new user sees first (issue 13): no noise that reads like an error."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_loading_bitsandbytes_prints_nothing():
    """bitsandbytes' CPU backend warned on import about a 4-bit kernel its 8-bit optimizers never use."""
    pytest.importorskip("bitsandbytes")
    code = "from lightning_memkit._optim import load_bitsandbytes; assert load_bitsandbytes() is not None"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "gemm_4bit" not in done.stderr + done.stdout
