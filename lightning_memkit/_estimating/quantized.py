"""Quantized weights in a simulated step: bitsandbytes' 4-bit (``Params4bit``) and 8-bit (``Int8Params``)
parameters on fake tensors.

The simulation swaps every parameter for a fake twin (`_estimating.simulate`). A quantized parameter is a
tensor subclass whose forward needs more than its data: ``Linear4bit`` reads ``weight.quant_state`` (the
blocks' absmax, the code table, with double quantization a nested state), ``Linear8bitLt`` its weight's
``CB``/``SCB`` or, after its first forward, its own ``state``. torch cannot turn a FakeTensor into a
``Params4bit`` (the fake already owns the raw tensor: "Creating a new Tensor subclass Params4bit but the raw
Tensor object is already associated to a python object of type FakeTensor"), so the twin is a fake
parameter that carries the quantized one's attributes, its quantization state faked too. bitsandbytes'
layers then run on it as on the real weight: their ops (``torch.ops.bitsandbytes.dequantize_4bit``,
``int8_vectorwise_quant``, ...) have fake kernels of bitsandbytes' own (``register_fake``), so what they
allocate is theirs, not modelled here.

A weight that is not quantized yet (built on the meta device: bitsandbytes quantizes when the weight is
moved to a device) is quantized on fake tensors by bitsandbytes' own ``quantize_4bit`` and
``int8_vectorwise_quant``: the bytes of the packed data, the absmax, the code tables and the nested
state come from the shapes, and nothing is materialised. What is modelled by hand: the one code table
bitsandbytes builds from Python floats for double quantization (``create_dynamic_map``, 256 values) is
built for real once, outside the fake mode, as bitsandbytes itself caches it.

torchao's quantized weights (``quantize_`` with ``Int8WeightOnlyConfig``, ``Int4WeightOnlyConfig``, ...) are
tensor subclasses of another kind: traceable wrappers (``TorchAOBaseTensor``) whose memory is their inner
tensors (an ``Int8Tensor``'s int8 ``qdata`` and its ``scale``), named by ``__tensor_flatten__``. Faking one as
a plain tensor of its logical shape and dtype counts an fp32 weight where an int8 one is held, and runs
``F.linear`` on it as on a plain weight, where torchao's own linear saves an fp32 dequantized copy for the
backward (-1.3 % on a tiny LLaMA's LoRA step). The twin is the same subclass rebuilt by its
``__tensor_unflatten__`` over fake twins of its inner tensors, each in its own dtype: torchao's dispatch
then runs on the fakes as on the real weight, and what its linear and dequantization allocate is its own.
A weight torchao quantized on the meta device has inner tensors of the right shapes, faked the same way.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

#: The parameter classes of bitsandbytes' quantized layers, by name (bitsandbytes is imported only when
#: a model has one).
QUANTIZED_PARAMETERS = ("Params4bit", "Int8Params")


def is_quantized(t: Tensor) -> bool:
    """Whether ``t`` is a bitsandbytes quantized parameter (4-bit or 8-bit)."""
    return type(t).__name__ in QUANTIZED_PARAMETERS


def is_torchao_quantized(t: Tensor) -> bool:
    """Whether ``t`` is a torchao quantized tensor: a traceable wrapper subclass of torchao's
    (``TorchAOBaseTensor``: ``Int8Tensor``, ``Int4Tensor``, ...) whose memory is its inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return type(t).__module__.startswith("torchao.") and is_traceable_wrapper_subclass(t)


class QuantizedTwins:
    """Fake twins of quantized parameters and of the quantization state they hold, one per real tensor
    (a state shared by a weight and its layer, or an ``Int8Params``' data and its ``CB``, stays shared)."""

    def __init__(self, mode: FakeTensorMode, fake: Callable[[Tensor], Tensor]) -> None:
        self.mode = mode
        self.fake = fake  # a real (or meta) tensor -> its fake twin, in the simulation's dtype
        self._twins: dict[Any, Tensor] = {}  # by `_key`
        self._keep: list[Tensor] = []  # the real tensors keyed above, kept alive (an id is not reused)

    def tensor(self, t: Tensor) -> Tensor:
        """The fake twin of a quantization state's tensor: its own dtype, whatever the precision."""
        twin = self._twins.get(_key(t))
        if twin is None:
            with self.mode:
                twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            self._remember(t, twin)
        return twin

    def _remember(self, t: Tensor, twin: Tensor) -> None:
        self._twins[_key(t)] = twin
        self._keep.append(t)

    def state(self, state: Any) -> Any:
        """A copy of a bitsandbytes ``QuantState`` (or ``MatmulLtState``) whose tensors are fake twins."""
        if state is None:
            return None
        twin = copy.copy(state)
        for name, value in vars(state).items():
            if isinstance(value, Tensor):
                setattr(twin, name, self.tensor(value))
            elif type(value).__name__ == "QuantState":
                setattr(twin, name, self.state(value))
        return twin

    def wrapper(self, t: Tensor) -> nn.Parameter:
        """The fake twin of a torchao quantized parameter: the same subclass, rebuilt by its
        ``__tensor_unflatten__`` over fake twins of its inner tensors (each in its own dtype, whatever the
        precision: an int8 ``qdata`` stays int8, and so does its ``scale``'s dtype)."""
        return nn.Parameter(self._unflattened(t), requires_grad=t.requires_grad)

    def _unflattened(self, t: Tensor) -> Tensor:
        """``t``'s subclass over fake twins of its inner tensors (a wrapper inside it rebuilt the same way).
        A subclass that cannot be rebuilt over fakes is refused with torchao's reason, never faked as the
        plain tensor of its shape (which counts 4 bytes a weight and misses what its linear saves)."""
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        names, context = t.__tensor_flatten__()
        inner = {}
        for name in names:
            member = getattr(t, name)
            if is_traceable_wrapper_subclass(member):
                inner[name] = self._unflattened(member)
            else:
                inner[name] = self.tensor(member) if isinstance(member, Tensor) else member
        try:
            return type(t).__tensor_unflatten__(inner, context, t.shape, t.stride())
        except Exception as error:
            raise NotImplementedError(
                f"estimate_memory cannot simulate torchao's {type(t).__name__}: it could not be rebuilt over "
                f"fake tensors ({type(error).__name__}: {error})"
            ) from error

    def parameter(self, t: Tensor) -> nn.Parameter:
        """The fake twin of a quantized parameter: a fake parameter carrying ``t``'s attributes, its
        quantization state faked (or made by quantizing a fake of ``t``, if ``t`` is not quantized yet)."""
        attributes = {k: v for k, v in vars(t).items() if k not in ("quant_state", "CB", "SCB")}
        if type(t).__name__ == "Params4bit":
            data, state = self._four_bit(t)
            extra = {"quant_state": state, "bnb_quantized": True}
        else:
            data, cb, scb = self._eight_bit(t)
            extra = {"CB": cb, "SCB": scb}
        twin = nn.Parameter(data, requires_grad=t.requires_grad)
        for name, value in {**attributes, **extra}.items():
            setattr(twin, name, value)
        return twin

    def _four_bit(self, t: Tensor) -> tuple[Tensor, Any]:
        if t.bnb_quantized:  # a state lost from the weight (FSDP's flat copies) is still its layer's
            state = t.quant_state
            if state is None:
                state = getattr(getattr(t, "module", None), "quant_state", None)
            return self.fake(t), self.state(state)
        import bitsandbytes as bnb

        dynamic = bnb.functional.name2qmap
        if t.compress_statistics and "dynamic" not in dynamic:  # made from Python floats: not on fakes
            dynamic["dynamic"] = bnb.functional.create_dynamic_map()
        weight = self.fake(t)
        with self.mode:
            return bnb.functional.quantize_4bit(
                weight,
                blocksize=t.blocksize,
                compress_statistics=t.compress_statistics,
                quant_type=t.quant_type,
                quant_storage=t.quant_storage,
            )

    def _eight_bit(self, t: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if t.dtype == torch.int8 or getattr(t, "has_fp16_weights", True):  # quantized, or kept in 16 bits
            data = self.fake(t)
            self._remember(t, data)  # its CB, in the parameter or moved to its layer's state, is its data
            cb, scb = getattr(t, "CB", None), getattr(t, "SCB", None)
            return data, None if cb is None else self.tensor(cb), None if scb is None else self.tensor(scb)
        weight = self.fake(t)
        with self.mode:
            cb, scb, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(weight.to(torch.float16))
        return cb, cb, scb


def _key(t: Tensor) -> Any:
    """One twin per stretch of memory: tensors over the same data (an ``Int8Params`` and its ``CB``) share
    theirs. A tensor on the meta device has no address: itself."""
    if t.device.type == "meta" or t.data_ptr() == 0:
        return id(t)
    return t.data_ptr(), t.dtype, tuple(t.shape)


@contextlib.contextmanager
def fake_layer_states(model: nn.Module, twins: QuantizedTwins) -> Iterator[None]:
    """Each bitsandbytes layer's own state swapped for a copy with fake tensors while inside, the real one
    put back: a ``Linear8bitLt``'s ``state`` (its forward moves the weight's ``CB``/``SCB`` there, and reads
    them from there), and a ``Linear4bit``'s ``quant_state``, which its forward gives back to a weight that
    lost it (FSDP2's unsharded copies are plain parameters: `_weight_given_its_layers_state`)."""
    swapped = []
    for module in model.modules():
        for name, kind in (("state", "MatmulLtState"), ("quant_state", "QuantState")):
            state = getattr(module, name, None)
            if type(state).__name__ == kind and not isinstance(module, Tensor):
                swapped.append((module, name, state))
                setattr(module, name, twins.state(state))
    try:
        with _weight_given_its_layers_state() if swapped else contextlib.nullcontext():
            yield
    finally:
        for module, name, state in swapped:
            setattr(module, name, state)


@contextlib.contextmanager
def _weight_given_its_layers_state() -> Iterator[None]:
    """bitsandbytes' ``fix_4bit_weight_quant_state_from_module`` as it runs on fake tensors: a 4-bit layer's
    weight that lost its quantization state (FSDP2 all-gathers a ``Params4bit`` shard into a plain
    parameter) gets the layer's. bitsandbytes wraps the weight in a new ``Params4bit`` for that, which
    torch refuses for a FakeTensor; the state is set on the parameter as it is. Its private name, read here
    only: on a bitsandbytes without it nothing is patched (and such a weight is refused as before)."""
    import bitsandbytes.nn.modules as bnb_modules

    fix = getattr(bnb_modules, "fix_4bit_weight_quant_state_from_module", None)
    if fix is None:
        yield
        return

    def given(module: nn.Module) -> None:
        weight = module.weight
        state = getattr(module, "quant_state", None)
        lost = getattr(weight, "quant_state", None) is None and state is not None
        if lost and isinstance(weight.data, torch._subclasses.FakeTensor):  # a parameter over a fake too
            weight.quant_state = state
            return
        fix(module)

    bnb_modules.fix_4bit_weight_quant_state_from_module = given
    try:
        yield
    finally:
        bnb_modules.fix_4bit_weight_quant_state_from_module = fix
