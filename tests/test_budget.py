import pytest
import torch

from lightning_memkit import GPUS, Budget, parse_budget
from lightning_memkit._budget import CUDA_CONTEXT_BYTES, FRAGMENTATION_RESERVE  # what a card loses


def _device_usable(total: int) -> int:
    return int((total - CUDA_CONTEXT_BYTES) * (1 - FRAGMENTATION_RESERVE))


def test_sizes_are_limits_as_given():
    assert parse_budget("24GB") == Budget(24 * 10**9, 24 * 10**9, "24GB")
    assert parse_budget("24 gib").usable == 24 * 2**30
    assert parse_budget(10**9).usable == 10**9


def test_a_size_as_a_card_loses_the_context_and_the_reserve():
    budget = parse_budget("24GB", device_size=True)
    assert budget.total == 24 * 10**9
    assert budget.usable == _device_usable(24 * 10**9)


@pytest.mark.parametrize("name", ["A100-40GB", "a100-40gb", "H100 80GB", "rtx 4090", "RTX-3090", "h200"])
def test_gpu_names(name):
    budget = parse_budget(name)
    canonical = budget.source
    assert canonical in GPUS
    assert budget.total == GPUS[canonical] * 2**20
    assert budget.usable == _device_usable(budget.total)


def test_unknown_gpu_lists_close_matches():
    with pytest.raises(ValueError, match=r"Did you mean A100-40GB"):
        parse_budget("A100-40")


def test_fraction_and_auto_use_the_current_device(monkeypatch):
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    assert parse_budget("auto").usable == _device_usable(80 * 2**30)
    assert parse_budget(0.5).total == 40 * 2**30


def test_fraction_without_cuda_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"needs a CUDA device.*'24GB'"):
        parse_budget(0.9)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        parse_budget(1.5)
