import dataclasses

import pytest

from lightning_memkit import MemoryBreakdown, format_bytes, parse_bytes


def test_peak_is_the_sum_and_the_object_is_frozen():
    b = MemoryBreakdown(parameters=1, gradients=2, optimizer_state=3, activations=4, temporary=5)
    assert b.peak == 15
    assert b.static == 6
    assert b.as_dict() == {
        "parameters": 1,
        "gradients": 2,
        "optimizer_state": 3,
        "activations": 4,
        "temporary": 5,
        "peak": 15,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.parameters = 0  # type: ignore[misc]
    assert b + b == MemoryBreakdown(2, 4, 6, 8, 10)


def test_fields_must_be_integer_bytes():
    with pytest.raises(TypeError, match="int number of bytes"):
        MemoryBreakdown(parameters=1.5)  # type: ignore[arg-type]


def test_str_is_a_table_in_binary_units():
    text = str(MemoryBreakdown(parameters=3 * 2**30, activations=512 * 2**20))
    assert "3.00 GiB" in text and "512.00 MiB" in text and "peak" in text
    assert "85.7%" in text  # 3 GiB of 3.5 GiB


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1024, 1024), ("24GB", 24 * 10**9), ("24GiB", 24 * 2**30), ("24 gib", 24 * 2**30), ("1.5MiB", 1572864)],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(
    ("value", "match"), [("24 parsecs", "Cannot read"), (0, "positive"), ("-1GB", "Cannot")]
)
def test_parse_bytes_rejects_nonsense(value, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(value)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
