"""Which modules of a model are the blocks to checkpoint.

Checkpointing pays off per block: a unit whose inputs are small next to what its forward saves. Models
say which units those are by repeating them, so the default candidates are the repeated composite layers:
those of ``nn.ModuleList``/``nn.Sequential`` containers (a GPT's ``Block``, a Hugging Face
``*DecoderLayer``, a ResNet's ``Bottleneck``), and classes repeated as plain attributes outside them (a
diffusion UNet's ``ResBlock`` and ``AttnBlock``, ``self.down1 = ResBlock(...)``); a user who knows better
names the layer classes, as FSDPStrategy's ``activation_checkpointing_policy`` takes them. Applying and
planning both start here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping

from torch import nn

__all__ = ["LayerClasses", "find_blocks"]

#: Layer classes as users name them: one class, or a set of them (``{Block}``).
LayerClasses = type[nn.Module] | Iterable[type[nn.Module]]


def find_blocks(model: nn.Module, layer_classes: LayerClasses | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks worth checkpointing, as ``(qualified name, module)`` in registration order.

    With ``layer_classes``, every instance of them (the outermost, where they nest). Otherwise the
    repeated layers (`_repeated_groups`): composite modules grouped by class, two or more of a class, found
    as children of ``nn.ModuleList``/``nn.Sequential`` containers (a GPT's ``Block``, torch's
    ``TransformerEncoderLayer``, Hugging Face's ``*DecoderLayer``, a ResNet's ``Bottleneck``) or as plain
    attributes anywhere outside them (a UNet's ``ResBlock``, ``self.mid = ResBlock(...)``). The heaviest
    class (parameters, then instances) is a stack, and so is every other class of `_stacks` (both stacks of
    an encoder-decoder such as Whisper's ``WhisperEncoderLayer`` and ``WhisperDecoderLayer``, both towers of
    a two-tower model), but not a pair of small heads or embeddings beside them. Children without
    submodules (a lone ``Linear``) are not candidates: checkpointing one saves nothing, since its input is
    kept either way; nor are adapter wrappers of one layer (peft's ``lora.Linear``), a ``ModuleList`` in a
    list (never called: its layers are the candidates), or, among attributes, torch's own layers (two
    ``nn.MultiheadAttention`` attributes are not a user's blocks; in a list, torch's layers are).
    """
    if layer_classes is not None:
        classes = block_classes(layer_classes)
        return _outermost([(name, m) for name, m in model.named_modules() if isinstance(m, classes)])
    chosen = {id(m) for group in _stacks(model) for _, m in group}
    return _outermost([(name, m) for name, m in model.named_modules() if id(m) in chosen])


def _stacks(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The groups of `_repeated_groups` that are stacks of layers: the heaviest, and each other with at least
    half its instances and a quarter of its parameters, or a sixteenth where it has three or more (an
    encoder of 4 layers beside a decoder of 6 is a stack, and so are a UNet's 3 attention blocks beside its
    6 residual blocks, at an eighth of their parameters; 2 heads beside 8 layers, 2 small heads beside 2
    layers, or 2 nested containers of 3 layers each, are not)."""
    groups = _repeated_groups(model)
    if not groups:
        return []
    weight, count = _weight(groups[0]), len(groups[0])
    return [g for g in groups if (4 if len(g) < 3 else 16) * _weight(g) >= weight and 2 * len(g) >= count]


def block_classes(layer_classes: LayerClasses) -> tuple[type[nn.Module], ...]:
    """``layer_classes`` (``blocks=``) as a tuple of classes; refused, saying what ``blocks=`` takes, where
    it is not one or more ``nn.Module`` subclasses (a class's name, a number, a dict, ``nn.Module``)."""
    takes = (
        "blocks= takes layer classes: an nn.Module subclass or a set of them, such as {ResBlock, AttnBlock}"
    )
    if isinstance(layer_classes, str):
        raise TypeError(f"{takes}; got the name {layer_classes!r}: pass the class itself, not its name")
    if isinstance(layer_classes, Mapping):
        raise TypeError(f"{takes}; got a dict {layer_classes!r}: its modes go in checkpointing=")
    if not isinstance(layer_classes, (type, Iterable)):
        raise TypeError(f"{takes}; got {layer_classes!r} ({type(layer_classes).__name__})")
    classes = (layer_classes,) if isinstance(layer_classes, type) else tuple(layer_classes)
    if instance := next((c for c in classes if isinstance(c, nn.Module)), None):
        raise TypeError(f"{takes}; got a {type(instance).__name__} instance: pass its class")
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"{takes}; got {layer_classes!r}")
    if nn.Module in classes:
        raise ValueError(f"{takes}; nn.Module is every module of the model: name the blocks' own classes")
    return classes


def _repeated_groups(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """``model``'s composite modules grouped by class, for the classes with two or more; the heaviest group
    (parameters, then instances) first. A container's (``ModuleList``/``Sequential``) composite children,
    and the composite modules outside those that hold none of them (a tower holding a stack of layers is
    not a block; a UNet's ``ResBlock`` held as an attribute is), containers themselves left out."""
    groups: dict[type, list[tuple[str, nn.Module]]] = {}
    listed: dict[int, str] = {}  # the containers' composite children: id -> qualified name
    for prefix, container in model.named_modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            for child_name, child in container.named_children():
                if id(child) in listed or not _composite(child) or _uncalled(child) or _adapter(child):
                    continue
                listed[id(child)] = f"{prefix}.{child_name}" if prefix else child_name
    inside = tuple(f"{name}." for name in listed.values())  # a listed block's submodules
    for name, module in model.named_modules(remove_duplicate=True):
        if id(module) in listed:
            groups.setdefault(type(module), []).append((name, module))
            continue
        if not name or name.startswith(inside) or isinstance(module, _CONTAINERS) or not _composite(module):
            continue
        if _library(module):  # nn.MultiheadAttention, a LoRA-wrapped Conv2d: not a user's composite layer
            continue
        if any(id(m) in listed for m in module.modules()):  # it holds listed blocks: their parent
            continue
        groups.setdefault(type(module), []).append((name, module))

    return sorted(
        (found for found in groups.values() if len(found) >= 2),
        key=lambda g: (_weight(g), len(g)),
        reverse=True,
    )


#: Modules that only hold others: never a block themselves (their children may be).
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _uncalled(module: nn.Module) -> bool:
    """Whether ``module`` is a container that cannot be called (``nn.ModuleList``, ``nn.ModuleDict``): one
    nested in a list (Hugging Face PVT's ``ModuleList`` of ``ModuleList`` of layers) is no block, since
    checkpointing a module that is never called does nothing; its children may be blocks."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _adapter(module: nn.Module) -> bool:
    """Whether ``module`` is an adapter or quantization wrapper around one layer (peft's tuner layers such
    as ``lora.Linear``, bitsandbytes' layers): its submodules are the wrapped layer and the adapter's
    weights, so it is a lone layer to checkpoint, which saves nothing."""
    if type(module).__module__.split(".")[0] in ("peft", "bitsandbytes"):
        return True
    if "peft" not in sys.modules:  # no tuner layer without peft (whose import imports bitsandbytes)
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def _library(module: nn.Module) -> bool:
    """Whether ``module`` is a library layer rather than a user's composite one: a class torch defines
    (``nn.MultiheadAttention``, whose recompute the simulation cannot price when it is called as
    ``attn(x, x, x)``, ``nn.TransformerEncoderLayer`` held as an attribute) or an adapter wrapper
    (`_adapter`). Found only among attributes; in a ``ModuleList`` torch's layers are blocks."""
    return type(module).__module__.split(".")[0] == "torch" or _adapter(module)


def _composite(module: nn.Module) -> bool:
    """Whether ``module`` has submodules: checkpointing a lone layer saves nothing (its input is kept)."""
    return next(module.children(), None) is not None


def _weight(group: list[tuple[str, nn.Module]]) -> int:
    return sum(p.numel() for _, m in group for p in m.parameters())


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    kept: list[tuple[str, nn.Module]] = []
    for name, module in found:
        if not any(name.startswith(outer + ".") for outer, _ in kept):
            kept.append((name, module))
    return kept


def no_blocks_message(model: nn.Module, option: str, layer_classes: LayerClasses | None = None) -> str:
    """Why there is nothing to checkpoint, and the option to pass (``option`` names ``MyBlock``)."""
    if layer_classes is None:
        return (
            f"Found no repeated blocks to checkpoint in {type(model).__name__}: no two composite layers of "
            "the same class, in an nn.ModuleList or nn.Sequential or as attributes. Name the layer classes "
            f"to checkpoint: {option}."
        )
    asked = " or ".join(c.__name__ for c in block_classes(layer_classes))
    groups = _repeated_groups(model)
    if not groups:
        return (
            f"No module of type {asked} is in {type(model).__name__}, so there is nothing to checkpoint; "
            "it has no repeated layers either (no two composite layers of one class, in a container or as "
            f"attributes). Name a layer class the model has: {option}."
        )
    found = ", ".join(
        f"{type(group[0][1]).__name__} (x{len(group)}, {group[0][0]}, ...)" for group in groups[:4]
    )
    return (
        f"No module of type {asked} is in {type(model).__name__}, so there is nothing to checkpoint. "
        f"Its repeated layers: {found}. Name one of those: "
        f"{option.replace('MyBlock', type(groups[0][0][1]).__name__)}."
    )
