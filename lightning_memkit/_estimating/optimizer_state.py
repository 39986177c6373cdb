"""Bytes of ``optimizer.state`` after the first step, per parameter shape: the exact formula of each
optimizer in the catalogue, as torch 2.x and bitsandbytes 0.50 allocate it (checked against real steps
in ``tests/estimating/test_analytic.py``). `optimizer_state_bytes
<lightning_memkit._estimating.analytic.optimizer_state_bytes>`
looks a name up in `OPTIMIZERS`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

Shape = tuple[int, ...]

#: bitsandbytes 0.50 ``Optimizer{1,2}State.init_state``: 8-bit state is quantized in blocks of 256
#: elements, each with one fp32 absmax scale ...
BNB_BLOCK_SIZE = 256
#: ... and parameters with fewer elements than this keep plain fp32 state.
BNB_MIN_8BIT_SIZE = 4096
#: Each 8-bit state kind also holds a 256-entry fp32 quantization map (``qmap1``/``qmap2``), shared by
#: every parameter of one optimizer, so it is counted once per optimizer.
_BNB_QMAP_BYTES = 256 * 4
#: torch.optim keeps ``state["step"]`` as a 0-d tensor of the default dtype (fp32) per parameter.
_TORCH_STEP_BYTES = 4


def adamw_state_bytes(shapes: Sequence[Shape], state_bytes: int = 4) -> int:
    """torch.optim.AdamW / Adam (Loshchilov & Hutter 2019; Kingma & Ba 2015): the first and second moments
    ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype and a 4-byte ``step`` tensor, so
    ``2·n·state_bytes + 4`` bytes for a parameter of n elements."""
    return sum(2 * math.prod(s) * state_bytes + _TORCH_STEP_BYTES for s in shapes)


def sgd_momentum_state_bytes(shapes: Sequence[Shape], state_bytes: int = 4) -> int:
    """torch.optim.SGD(momentum > 0) (heavy-ball momentum, as torch's SGD documents it): one
    ``momentum_buffer`` per parameter, ``n·state_bytes`` bytes, no step counter."""
    return sum(math.prod(s) * state_bytes for s in shapes)


def sgd_state_bytes(shapes: Sequence[Shape], state_bytes: int = 4) -> int:
    """torch.optim.SGD without momentum keeps no state."""
    return 0


def adafactor_state_bytes(shapes: Sequence[Shape], state_bytes: int = 4) -> int:
    """torch.optim.Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear
    Memory Cost", §3): a factored second moment, no first moment, plus a 4-byte ``step``.

    A parameter of shape (..., m, n) keeps ``row_var`` (..., m, 1) and ``col_var`` (..., 1, n): O(m + n)
    instead of O(m·n). Parameters with fewer than 2 dimensions keep a full ``variance``.
    """
    total = 0
    for s in shapes:
        if len(s) >= 2:
            lead = math.prod(s[:-2])
            total += lead * (s[-2] + s[-1]) * state_bytes
        else:
            total += math.prod(s) * state_bytes
        total += _TORCH_STEP_BYTES
    return total


def _bnb_state_bytes(
    shapes: Sequence[Shape], n_states: int, min_8bit_size: int, block_size: int, eight_bit: bool
) -> int:
    # bitsandbytes' step counter is a Python int; its 32-bit state is fp32 whatever the param dtype.
    total, any_8bit = 0, False
    for s in shapes:
        n = math.prod(s)
        if eight_bit and n >= min_8bit_size:
            any_8bit = True
            total += n_states * (n + 4 * -(-n // block_size))  # uint8 state + fp32 absmax per block
        else:
            total += n_states * 4 * n
    return total + (n_states * _BNB_QMAP_BYTES if any_8bit else 0)


def adamw8bit_state_bytes(
    shapes: Sequence[Shape], *, min_8bit_size: int = BNB_MIN_8BIT_SIZE, block_size: int = BNB_BLOCK_SIZE
) -> int:
    """bitsandbytes AdamW8bit / PagedAdamW8bit (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
    Quantization"): two uint8 states with one fp32 absmax per block of 256 elements, ≈ 2 B/param + 8 B
    per block, and the two 256-entry fp32 quantization maps once per optimizer.

    Parameters under ``min_8bit_size`` elements keep two fp32 states (8 B/param). Paged state on CUDA
    lives in managed memory, which ``torch.cuda.memory_allocated`` does not see, but it is counted here.
    """
    return _bnb_state_bytes(shapes, 2, min_8bit_size, block_size, eight_bit=True)


def lion_state_bytes(shapes: Sequence[Shape], state_bytes: int = 4) -> int:
    """bitsandbytes Lion, 32-bit (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
    one fp32 momentum, 4 B/param (always fp32, whatever ``state_bytes``)."""
    return _bnb_state_bytes(shapes, 1, BNB_MIN_8BIT_SIZE, BNB_BLOCK_SIZE, eight_bit=False)


def lion8bit_state_bytes(
    shapes: Sequence[Shape], *, min_8bit_size: int = BNB_MIN_8BIT_SIZE, block_size: int = BNB_BLOCK_SIZE
) -> int:
    """bitsandbytes Lion8bit: Lion's one momentum quantized as AdamW8bit's states are, ≈ 1 B/param + 4 B
    per 256-element block; parameters under ``min_8bit_size`` elements keep it in fp32."""
    return _bnb_state_bytes(shapes, 1, min_8bit_size, block_size, eight_bit=True)


def adamw_kahan_state_bytes(shapes: Sequence[Shape], state_bytes: int = 4) -> int:
    """torch-optimi AdamW with Kahan summation (Zamirai et al. 2020, "Revisiting BFloat16 Training"): the
    two moments in the parameter's dtype and, for 16-bit parameters, a Kahan compensation buffer of the same
    size that keeps the low bits each update loses; no per-parameter step counter (one per group). So
    ``2·n·4`` bytes for fp32 parameters and ``3·n·2`` for bf16 ones."""
    per_element = 2 * state_bytes + (state_bytes if state_bytes < 4 else 0)
    return sum(math.prod(s) * per_element for s in shapes)


def sgd_kahan_state_bytes(shapes: Sequence[Shape], state_bytes: int = 4) -> int:
    """torch-optimi SGD without momentum, with Kahan summation: only the compensation buffer, for 16-bit
    parameters (``n·2`` bytes); nothing for fp32 ones."""
    return sum(math.prod(s) * state_bytes for s in shapes) if state_bytes < 4 else 0


#: name -> f(shapes, state_bytes) -> bytes. ``state_bytes`` is the element size torch.optim state takes
#: from the parameters; the bitsandbytes optimizers ignore it (their full-precision state is fp32).
OPTIMIZERS: dict[str, Callable[[Sequence[Shape], int], int]] = {
    "adamw": adamw_state_bytes,
    "adamw8bit": lambda shapes, _: adamw8bit_state_bytes(shapes),
    "paged_adamw8bit": lambda shapes, _: adamw8bit_state_bytes(shapes),
    "lion": lion_state_bytes,
    "lion8bit": lambda shapes, _: lion8bit_state_bytes(shapes),
    "adafactor": adafactor_state_bytes,
    "sgd_momentum": sgd_momentum_state_bytes,
    "sgd": sgd_state_bytes,
    "adamw_kahan": adamw_kahan_state_bytes,
    "sgd_kahan": sgd_kahan_state_bytes,
}
