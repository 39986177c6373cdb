"""Which modules of a model are the blocks to checkpoint.

Checkpointing pays off per block: a unit whose inputs are small next to what its forward saves. Models
say which units those are by repeating them, so the default candidates are the repeated composite layers
of ``nn.ModuleList``/``nn.Sequential`` containers (a GPT's ``Block``, a Hugging Face ``*DecoderLayer``, a
ResNet's ``Bottleneck``); a user who knows better names the layer classes, as FSDPStrategy's
``activation_checkpointing_policy`` takes them. Applying and planning both start here.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["LayerClasses", "find_blocks"]

#: Layer classes as users name them: one class, or a set of them (``{Block}``).
LayerClasses = type[nn.Module] | Iterable[type[nn.Module]]


def find_blocks(model: nn.Module, layer_classes: LayerClasses | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks worth checkpointing, as ``(qualified name, module)`` in registration order.

    With ``layer_classes``, every instance of them (the outermost, where they nest). Otherwise the
    repeated layers: children of ``nn.ModuleList``/``nn.Sequential`` containers grouped by class, two or
    more of a class (a GPT's ``Block``, torch's ``TransformerEncoderLayer``, Hugging Face's
    ``*DecoderLayer``, a ResNet's ``Bottleneck``). The heaviest class (parameters, then instances) is a
    stack, and so is every other class of `_stacks` (both stacks of an encoder-decoder such as Whisper's
    ``WhisperEncoderLayer`` and ``WhisperDecoderLayer``, both towers of a two-tower model), but not a pair
    of small heads or embeddings beside them. Children without submodules (a lone ``Linear``) are not
    candidates: checkpointing one saves nothing, since its input is kept either way.
    """
    if layer_classes is not None:
        classes = block_classes(layer_classes)
        return _outermost([(name, m) for name, m in model.named_modules() if isinstance(m, classes)])
    chosen = {id(m) for group in _stacks(model) for _, m in group}
    return _outermost([(name, m) for name, m in model.named_modules() if id(m) in chosen])


def _stacks(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The groups of `_repeated_groups` that are stacks of layers: the heaviest, and each other with at least
    a quarter of its parameters and half its instances (an encoder of 4 layers beside a decoder of 6 is a
    stack; 2 heads beside 8 layers, or 2 nested containers of 3 layers each, are not)."""
    groups = _repeated_groups(model)
    if not groups:
        return []
    weight, count = _weight(groups[0]), len(groups[0])
    return [g for g in groups if 4 * _weight(g) >= weight and 2 * len(g) >= count]


def block_classes(layer_classes: LayerClasses) -> tuple[type[nn.Module], ...]:
    classes = (layer_classes,) if isinstance(layer_classes, type) else tuple(layer_classes)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"Expected nn.Module subclasses such as {{Block}}, got {layer_classes!r}")
    return classes


def _repeated_groups(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The composite children of ``model``'s ``ModuleList``/``Sequential`` containers, grouped by class,
    for the classes with two or more; the heaviest group (parameters, then instances) first."""
    groups: dict[type, list[tuple[str, nn.Module]]] = {}
    seen: set[int] = set()
    for prefix, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        for child_name, child in container.named_children():
            if id(child) in seen or next(child.children(), None) is None:
                continue
            seen.add(id(child))
            groups.setdefault(type(child), []).append(
                (f"{prefix}.{child_name}" if prefix else child_name, child)
            )

    return sorted(
        (found for found in groups.values() if len(found) >= 2),
        key=lambda g: (_weight(g), len(g)),
        reverse=True,
    )


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
            f"Found no repeated blocks to checkpoint in {type(model).__name__}: no nn.ModuleList or "
            "nn.Sequential holds two or more composite layers of the same class. Name the layer classes to "
            f"checkpoint: {option}."
        )
    asked = " or ".join(c.__name__ for c in block_classes(layer_classes))
    groups = _repeated_groups(model)
    if not groups:
        return (
            f"No module of type {asked} is in {type(model).__name__}, so there is nothing to checkpoint; "
            "it has no repeated layers either (no nn.ModuleList or nn.Sequential holds two or more "
            f"composite layers of one class). Name a layer class the model has: {option}."
        )
    found = ", ".join(
        f"{type(group[0][1]).__name__} (x{len(group)}, {group[0][0]}, ...)" for group in groups[:4]
    )
    return (
        f"No module of type {asked} is in {type(model).__name__}, so there is nothing to checkpoint. "
        f"Its repeated layers: {found}. Name one of those: "
        f"{option.replace('MyBlock', type(groups[0][0][1]).__name__)}."
    )
