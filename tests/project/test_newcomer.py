"""What a new user sees first (issue 13): no noise that reads like an error."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

# A user's first 8-bit optimizer, in a fresh interpreter: bitsandbytes is imported once per process.
_SWAP_TO_8BIT = """
import torch
from lightning_memkit import swap_optimizer

adamw = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
assert type(swap_optimizer(adamw, "adamw8bit")).__module__.startswith("bitsandbytes")
"""


@pytest.mark.slow
def test_loading_bitsandbytes_prints_nothing():
    """bitsandbytes' CPU backend warned on import about a 4-bit kernel its 8-bit optimizers never use."""
    pytest.importorskip("bitsandbytes")
    done = subprocess.run([sys.executable, "-c", _SWAP_TO_8BIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "gemm_4bit" not in done.stderr + done.stdout


def test_no_plan_fits_does_not_suggest_the_precision_already_allowed():
    """Issue 13, item 6: "What would fit" suggested bf16-true even when bf16-true was allowed."""
    from torch import nn

    from lightning_memkit import plan_fit

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    batch = (torch.zeros(4, 64), torch.zeros(4, 64))
    kwargs = dict(loss_fn=nn.functional.mse_loss, optimizers=["sgd"], cost="flops")
    with pytest.raises(ValueError, match=r"or allow a lower precision \(bf16-true\)"):
        plan_fit(model, batch, 1000, **kwargs)
    with pytest.raises(ValueError, match=r"No plan fits") as refused:
        plan_fit(model, batch, 1000, precision=["32-true", "bf16-true"], **kwargs)
    assert "allow a lower precision" not in str(refused.value)
