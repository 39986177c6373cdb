"""The model a command runs on, and how one training step of it is simulated.

``--model`` is a preset of the bundled GPT demo (``tiny``, ``gpt2``, ... ``llama-7b``),
``package.module:factory``, a callable taking no arguments that returns an ``nn.Module`` or a
``LightningModule``, or ``hf:<directory or org/name>``, a Hugging Face architecture built from its
``config.json`` with random weights (`AutoModelForCausalLM`, else `AutoModel` for a family without a
causal-LM head; `cli._hf`). An ``org/name`` is read from the local Hugging Face cache only (``HF_HUB_CACHE``,
``HF_HOME``): planning a run never downloads anything. The factory, and the ``hf:`` model, are built under
``torch.device("meta")``, so a model built the usual way is never allocated; the current directory is
importable.

The example batch, for any model: if the module has a method ``example_batch(batch_size, seq_len)``,
what it returns is the batch (build it on the meta device to keep it free). Otherwise the batch is
``(x, y)``, two int64 token-id tensors of shape ``(batch_size, seq_len)``: what a causal language model's
``training_step`` takes. A ``LightningModule`` runs its own ``training_step`` (and ``configure_optimizers``
unless ``--optimizer`` is given), after its ``configure_model`` (run once, under the meta device, as the
Trainer runs it); a plain ``nn.Module`` is stepped as a language model, ``cross_entropy(model(x), y)`` over
its output's last dimension (the first element of a tuple output). A Hugging Face ``PreTrainedModel`` is
stepped as it trains itself: ``model(input_ids=x, labels=x)`` and the ``loss`` of its ``ModelOutput`` (a
model without ``labels`` in its ``forward``: cross-entropy over its ``logits``, else its first output).
Both run inside `LanguageModelModule`, in Lightning's order (the previous step's gradients alive through
the forward), unless ``--loop plain`` asks for a plain loop's.

The user's own code failing (the factory, ``example_batch``, the model's step) is bad input: a one-line
`UsageError` with what was being done and how to fix it. A preset failing is our bug, and keeps its
traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import reprlib
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_memkit._estimating.adapters import AdapterSetup, adapter_code, apply_adapters
from lightning_memkit._estimating.analytic import TransformerShape, count_parameters
from lightning_memkit._estimating.lightning_step import lightning_stand_ins, optimizers_from
from lightning_memkit._estimating.precision import PRECISION_DTYPES
from lightning_memkit._optimizers.swap import identify
from lightning_memkit.cli._args import UsageError, check_tokens, usage_error
from lightning_memkit.cli._hf import HF_PREFIX, hf_from_config
from lightning_memkit.demos.gpt import PRESETS, GPTConfig, GPTLightningModule


def load_model(spec: str, loop: str = "lightning", adapters: AdapterSetup | None = None) -> nn.Module:
    """A preset's GPTLightningModule, what ``package.module:factory`` returns, or the Hugging Face model
    ``hf:<directory or org/name>`` describes, built on meta. A plain ``nn.Module`` (a Hugging Face one too)
    comes back inside `LanguageModelModule`, stepped in Lightning's order, unless ``loop`` is ``"plain"``
    (``HFLanguageModel`` or the module itself: zero_grad, forward, backward, step). With ``adapters``
    (``--lora``, ``--quantize``) its base is quantized and given LoRA adapters first (`with_adapters`)."""
    model, targets = _user_model(spec), None
    if adapters is not None:
        model, targets = with_adapters(model, adapters)
    if isinstance(model, LightningModule):
        if loop == "plain":
            raise UsageError(
                f"--loop plain steps a plain nn.Module; --model {spec} is a LightningModule "
                f"({type(model).__name__}), whose training_step runs in Lightning's order: leave --loop out"
            )
    elif loop == "lightning":
        model = LanguageModelModule(model)
    elif _is_hf(model):
        model = HFLanguageModel(model)
    if targets is not None:
        model.lora_targets = targets  # type: ignore[assignment]  # for the summary and the code
    return model


def _user_model(spec: str) -> nn.Module:
    """The model ``spec`` names, as built: a preset's GPTLightningModule, what the factory returns, or the
    ``hf:`` model, checked to be trainable."""
    if spec.startswith(HF_PREFIX):
        model = hf_from_config(spec)
        _check_trainable(model, spec)
        return model
    if ":" not in spec:
        if spec not in PRESETS:
            module_name, _, attr = spec.rpartition(".")
            hint = f" (a factory is named with a colon: {module_name}:{attr})" if module_name else ""
            if "/" in spec:  # org/name, as the Hub spells a model
                hint = f" (a Hugging Face model is named with hf:, read from its config.json: hf:{spec})"
            raise UsageError(
                f"unknown preset {spec!r} for --model; valid: {', '.join(PRESETS)}, package.module:factory "
                "or hf:<directory or org/name>" + hint
            )
        with torch.device("meta"):
            return GPTLightningModule(spec)
    factory = _factory(spec)
    name = f"{spec.partition(':')[2]}()"
    called = "it is called with no arguments under torch.device('meta'); call it in Python for the traceback"
    with usage_error(context=f"--model {spec}: calling {name} failed", fix=called), torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        got = f"{reprlib.repr(model)} ({type(model).__name__})"
        got = "None (does it return the model?)" if model is None else got
        raise UsageError(f"--model {spec}: {name} returned {got}, not an nn.Module or LightningModule")
    _configure(model, spec)
    _check_trainable(model, spec)
    return model


def with_adapters(model: nn.Module, adapters: AdapterSetup) -> tuple[nn.Module, tuple[str, ...] | str]:
    """``model`` as ``--lora``/``--quantize`` set it up (`apply_adapters`: quantized as transformers'
    ``BitsAndBytesConfig`` loads it, then peft's LoRA), on the meta device, and the LoRA targets used. A
    target not in the model, or a missing package, is a usage error."""
    missing = [name for name in ("peft", "bitsandbytes") if importlib.util.find_spec(name) is None]
    if adapters.quantize == "none":
        missing = [name for name in missing if name != "bitsandbytes"]
    if importlib.util.find_spec("transformers") is None and adapters.quantize != "none":
        missing.append("transformers")  # BitsAndBytesConfig and its replacement of the linear layers
    if missing:
        raise UsageError(
            f"--lora and --quantize build the set-up with {' and '.join(missing)}, not installed here; "
            f"pip install {' '.join(missing)}"
        )
    with usage_error(ValueError):
        return apply_adapters(model, adapters)


def setup_code(model: nn.Module, adapters: AdapterSetup) -> str:
    """``--lora``/``--quantize``'s set-up as the lines a user pastes (`adapter_code`): a Hugging Face
    model loaded with its ``BitsAndBytesConfig`` and wrapped by peft, any other its LoRA as peft adds it."""
    lightning = isinstance(model, LightningModule) and not isinstance(model, LanguageModelModule)
    return adapter_code(adapters, model.lora_targets, hf=_hf_model(model) is not None, lightning=lightning)


def _configure(model: nn.Module, spec: str) -> None:
    """A LightningModule's ``configure_model``, run as the Trainer runs it before the first step (under the
    meta device here), so that the layers it builds or compiles are the ones simulated."""
    if not isinstance(model, LightningModule) or not is_overridden("configure_model", model):
        return
    with (
        usage_error(
            context=f"--model {spec}: its configure_model() failed",
            fix="it runs under torch.device('meta') before the simulated step, as a Trainer runs it before "
            "the first one",
        ),
        torch.device("meta"),
        lightning_stand_ins(model, torch.device("meta")),
    ):
        model.configure_model()
    # Run once, as the Trainer would: the hook is now LightningModule's own (nothing left to configure).
    model.configure_model = types.MethodType(LightningModule.configure_model, model)  # type: ignore[method-assign]


def analytic_precision(model: nn.Module, precision: str) -> str:
    """The precision the analytic arithmetic reads for ``model`` trained at ``precision``: a precision that
    keeps the weights as built (``32-true``, the mixed ones) over 16-bit weights is the 16-bit ``-true``
    one (16-bit parameters, gradients and optimizer state)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if PRECISION_DTYPES[precision][0] is not None or len(dtypes) != 1:
        return precision
    return {torch.bfloat16: "bf16-true", torch.float16: "16-true"}.get(dtypes.pop(), precision)


def weights_note(model: nn.Module, spec: str, precision: str) -> str:
    """One line: the dtype the weights are built in (for ``hf:``, where it comes from) and what
    ``precision`` makes of them, so that a plan never silently assumes fp32 weights."""
    dtypes = sorted(
        {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    )
    source = (
        "config.json's dtype (fp32 where it records none), as from_pretrained and from_config load them"
        if spec.startswith(HF_PREFIX)
        else "as the model builds them"
    )
    converted = PRECISION_DTYPES[precision][0]
    what = (
        f"{precision} converts them to {str(converted).removeprefix('torch.')}"
        if converted is not None
        else f"{precision} trains them as they are"
    )
    return f"weights: {'/'.join(dtypes)}, {source}; {what}"


def _factory(spec: str) -> Callable[[], Any]:
    """The callable ``package.module:factory`` names, checked to be callable with no arguments."""
    module_name, _, attr = spec.partition(":")
    for part, where, what in ((module_name, "before", "package.module"), (attr, "after", "factory")):
        if not part.strip():
            raise UsageError(
                f"--model {spec!r} has no {what} {where} the ':'; give package.module:factory, e.g. "
                "mypkg.models:build"
            )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's own package is found
    with usage_error(
        context=f"cannot load --model {spec}: importing {module_name!r} failed",
        fix=f"the current directory is on the path; try python -c 'import {module_name}'",
    ):
        module = importlib.import_module(module_name)
    first = attr.split(".")[0]
    close = [] if hasattr(module, first) else difflib.get_close_matches(first, dir(module), n=3)
    with usage_error(
        AttributeError,
        context=f"cannot load --model {spec}",
        fix=f"did you mean {' or '.join(close)}?" if close else "",
    ):
        factory = functools.reduce(getattr, attr.split("."), module)
    if not callable(factory):
        raise UsageError(f"--model {spec} is a {type(factory).__name__}, not a callable returning a model")
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        parameters = []
    required = [
        p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise UsageError(
            f"--model {spec}: {attr}() needs arguments ({', '.join(required)}) but is called with none; "
            f"write a factory without arguments, e.g. def build(): return {attr}({required[0]}=...), "
            "and give --model module:build"
        )
    return factory


def _check_trainable(model: nn.Module, spec: str) -> None:
    """A model memkit can step has parameters, of a known shape, some of which train, and an optimization
    it runs without a Trainer (Lightning's automatic one)."""
    params = list(model.parameters())
    name = type(model).__name__
    if not params:
        raise UsageError(
            f"--model {spec} ({name}) has no parameters, so there is nothing to train; return the model "
            "that holds them"
        )
    lazy = [m for m in model.modules() if isinstance(m, nn.modules.lazy.LazyModuleMixin)]
    if lazy:
        raise UsageError(
            f"--model {spec} ({name}) has lazy modules ({type(lazy[0]).__name__}), whose parameters have no "
            "shape until a first forward; give their sizes (nn.Linear(in_features, ...) for nn.LazyLinear)"
        )
    if not any(p.requires_grad for p in params):
        raise UsageError(
            f"--model {spec} ({name}) has no trainable parameters: all {len(params)} have "
            "requires_grad=False; unfreeze those the run trains"
        )
    if not getattr(model, "automatic_optimization", True):
        raise UsageError(
            f"--model {spec} ({name}) uses manual optimization, whose steps only a running Trainer drives; "
            "give a factory of the nn.Module it trains (stepped as a language model, or by example_batch)"
        )


def _is_hf(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face ``PreTrainedModel``, or peft's adapters over one."""
    # transformers is optional and slow to import: it is imported here, and only once the user's code has
    # imported it (a model of its classes cannot exist before).
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(_peft_base(model), PreTrainedModel)


def _peft_base(model: nn.Module) -> nn.Module:
    """The model a peft ``PeftModel`` wraps (its ``get_base_model()``), else ``model`` itself."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) and "peft" in sys.modules else model


def _language_model_forward(model: nn.Module, x: torch.Tensor) -> Any:
    """``model`` on token ids ``x``: a Hugging Face model (or peft's adapters over one) as it trains itself,
    ``model(input_ids=x, labels=x)`` (the collator's ``labels`` are the input ids; a causal LM shifts them
    itself; a ``forward`` without ``labels`` gets ``input_ids`` alone), any other module ``model(x)``."""
    if not _is_hf(model):
        return model(x)
    if "labels" in inspect.signature(_peft_base(model).forward).parameters:
        return model(input_ids=x, labels=x)
    return model(input_ids=x)


class HFLanguageModel(nn.Module):
    """A Hugging Face model stepped on token ids as it trains itself (`_language_model_forward`), the loss
    its own ``.loss`` or from its logits (`lm_loss`), in a plain loop (``--loop plain``). Its parameters,
    blocks and ``config`` are the wrapped model's."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids: torch.Tensor) -> Any:
        return _language_model_forward(self.model, input_ids)


class LanguageModelModule(LightningModule):
    """A plain ``nn.Module`` (a Hugging Face model too) in the LightningModule a user writes around it, so
    that the step simulated is the one a Trainer runs: ``training_step`` (the forward on the batch's ``x``
    and `lm_loss` against its ``y``), then Lightning's ``zero_grad``, backward and step, the previous
    step's gradients alive through the forward; AdamW from ``configure_optimizers``. Parameters and blocks
    are the wrapped model's, under ``model.``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = getattr(model, "config", None)  # the analytic column's architecture

    def forward(self, x: torch.Tensor) -> Any:
        return _language_model_forward(self.model, x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        return lm_loss(self(inputs), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p for p in self.parameters() if p.requires_grad)  # LoRA: the adapters


def user_model(model: nn.Module) -> nn.Module:
    """The module the user's ``--model`` built: inside `LanguageModelModule`, the wrapped one."""
    return model.model if isinstance(model, LanguageModelModule) else model


def step_options(model: nn.Module, optimizer: str | None) -> dict[str, Any]:
    """`estimate_memory`'s ``optimizer`` and ``loss_fn`` for ``model``'s step: a user's LightningModule
    its own (``configure_optimizers`` unless ``optimizer`` names one, its ``training_step``), any other
    model ``optimizer`` or AdamW, and `lm_loss` for a plain loop."""
    own = isinstance(model, LightningModule) and not isinstance(model, LanguageModelModule)
    return {
        "optimizer": optimizer if own else optimizer or "adamw",
        "loss_fn": None if isinstance(model, LightningModule) else lm_loss,
    }


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The model's own loss when its output has one (a Hugging Face ``ModelOutput`` given ``labels``),
    else cross-entropy over the logits (``.logits``, a mapping's first tensor, a tuple's first element)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        if isinstance(output, Mapping):
            logits = next(v for v in output.values() if isinstance(v, torch.Tensor))
        else:
            logits = output[0] if isinstance(output, (tuple, list)) else output  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _gpt_config(model: nn.Module) -> GPTConfig | None:
    """The model's ``GPTConfig`` if it has one (the analytic column needs the architecture's numbers)."""
    config = getattr(model, "config", None)
    return config if isinstance(config, GPTConfig) else None


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face ``PreTrainedModel`` ``model`` is or holds (a LightningModule around one)."""
    if "transformers" not in sys.modules:
        return None
    return next((m for m in model.modules() if _is_hf(m)), None)


def analytic_shape(model: nn.Module) -> tuple[TransformerShape | None, str | None]:
    """The architecture's numbers for the analytic column, or ``None`` and the note that says why not.

    From a ``GPTConfig`` (the presets, nanoGPT-style models), or from a Hugging Face model's ``.config``
    when the numbers it maps to give exactly the model's parameter count: a variant with extra norms,
    biases or heads is not described by the analytic model.
    """
    config = _gpt_config(model)
    if config is not None:
        return TransformerShape.from_config(config), None
    hf = _hf_model(model)
    if hf is None:
        return None, (
            "analytic: not available: it needs the architecture's numbers, from a preset, a model with a "
            "GPTConfig (.config) or a Hugging Face model (.config)"
        )
    name = type(hf).__name__
    try:
        shape = TransformerShape.from_hf_config(hf.config)
    except ValueError as e:
        return None, f"analytic: not available for {name}: {e}"
    n_model = sum(p.numel() for p in model.parameters())
    n_shape = count_parameters(shape)
    if n_model != n_shape:
        return None, (
            f"analytic: not available for {name}: its config maps to {n_shape:,} parameters, the model has "
            f"{n_model:,} (a layout the analytic model does not describe: other norms, biases or heads)"
        )
    kv = f", {shape.n_kv_head} K/V heads" if shape.n_kv_head not in (None, shape.n_head) else ""
    return shape, (
        f"analytic: from {name}'s config: d_model {shape.d_model}, {shape.n_layer} layers, {shape.n_head} "
        f"heads{kv}, d_ff {shape.d_ff}, {shape.mlp}, {shape.norm}; activations per Korthikanti et al."
    )


def block_size(model: nn.Module, shape: TransformerShape | None) -> int | None:
    """The longest sequence ``model`` takes: a GPT preset's ``block_size`` or a learned position table's
    size; ``None`` where neither says."""
    config = _gpt_config(model)
    block = config.block_size if config is not None else None
    if shape is not None and shape.position == "learned":
        block = shape.block_size
    return block


def check_seq_len(model: nn.Module, shape: TransformerShape | None, seq_len: int) -> None:
    block = block_size(model, shape)
    if block is not None and seq_len > block:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's block_size of {block}")


def optimizer_used(model: nn.Module, optimizer: str | None) -> tuple[str, str | None]:
    """(what the header names, its catalogue name or ``None``) of the optimizer the simulation steps."""
    if optimizer is not None:
        return optimizer, optimizer
    if not isinstance(model, LightningModule) or isinstance(model, LanguageModelModule):
        return "adamw", "adamw"
    try:
        with lightning_stand_ins(model, torch.device("cpu")), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizers = optimizers_from(model.configure_optimizers())
    except Exception:  # the simulated step reports the user's error; the header only names the optimizer
        return "configure_optimizers", None
    if not optimizers:
        return "configure_optimizers (no optimizer)", None
    names = [identify(o) or type(o).__name__ for o in optimizers]
    return f"{' + '.join(names)} (configure_optimizers)", names[0] if len(names) == 1 else None


def example_batch(model: nn.Module, spec: str, batch_size: int, seq_len: int) -> Any:
    check_tokens(batch_size, seq_len)
    if callable(getattr(user_model(model), "example_batch", None)):
        with usage_error(
            context=f"--model {spec}: its example_batch({batch_size}, {seq_len}) failed",
            fix="it is called as example_batch(batch_size, seq_len) and returns the batch its step takes",
        ):
            return user_model(model).example_batch(batch_size, seq_len)
    x = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")  # (B, T) token ids
    return x, x.clone()


@contextlib.contextmanager
def step_errors(model: nn.Module, spec: str, batch_size: int, seq_len: int) -> Iterator[None]:
    """Where the user's model's simulated step runs: its failure is a one-line error that says which
    batch it was given and how to give another. A preset failing is our bug: it keeps its traceback."""
    if ":" not in spec:
        yield
        return
    if callable(getattr(user_model(model), "example_batch", None)):
        batch = f"the batch was its example_batch({batch_size}, {seq_len})"
    else:
        how = (
            "model(input_ids=x, labels=x)"
            if _is_hf(user_model(model)) or isinstance(model, HFLanguageModel)
            else "its training_step"
            if isinstance(model, LightningModule) and model is user_model(model)
            else "cross_entropy(model(x), y)"
        )
        batch = (
            f"the batch was (x, y), int64 token ids of shape ({batch_size}, {seq_len}), stepped as {how}; "
            "a model that takes other inputs (images, features) defines example_batch(batch_size, seq_len) "
            "returning its batch"
        )
    # torch logs a failing meta kernel's traceback before raising: the one line says what went wrong.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, log.disabled = log.disabled, True
    try:
        with usage_error(context=f"--model {spec}: the simulated training step failed", fix=batch):
            yield
    finally:
        log.disabled = disabled
