"""docs/development.md's layering, held to the code: each stage of the package's layout imports only the
stages listed above it (or itself), except the reaches below the page names. Lazy imports inside
functions count: an import is a dependency wherever it is written."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "lightning_memkit"

#: The imports of a stage listed below the importer that docs/development.md names and explains:
#: (importing module, imported module), both without the package prefix.
REACHES_BELOW = {
    ("_estimating.repeated", "_checkpointing.blocks"),
    ("_estimating.repeated", "_checkpointing.policies"),
    ("_estimating.fake_model", "_checkpointing.blocks"),
    ("_estimating.fake_optimizers", "_optimizers.swap"),
    ("_estimating.fake_step", "_checkpointing.policies"),
    ("_estimating.simulate", "_checkpointing.policies"),
    ("_fitting.plan", "_diagnosis.report"),
}


def _stages() -> list[str]:
    """The layout block's stages in order: the values (the top-level ``.py`` files) first as one stage,
    then each folder, as the page lists them."""
    text = (REPO / "docs" / "development.md").read_text(encoding="utf-8")
    block = re.search(r"^lightning_memkit/\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL).group(1)
    return [m.group(1) for m in re.finditer(r"^  (\w+)/", block, flags=re.MULTILINE)]


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, anywhere in it, without the package prefix."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n.removeprefix("lightning_memkit.") for n in names if n.startswith("lightning_memkit.")}
    return {n for n in found if (PACKAGE / n.replace(".", "/")).with_suffix(".py").exists()}


def test_each_stage_imports_only_the_stages_above_it():
    order = {stage: rank for rank, stage in enumerate(_stages(), start=1)}  # the top-level values: 0
    assert {"_measuring", "_estimating", "callbacks", "cli"} <= set(order), order

    def rank(module: str) -> int:
        return order.get(module.split(".")[0], 0) if "." in module else 0

    upward = set()
    for path in PACKAGE.rglob("*.py"):
        importer = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        if "." not in importer:
            continue  # the top-level modules: __init__ gathers the public names, testing reads them all
        upward |= {(importer, m) for m in _imports(path) if rank(m) > rank(importer)}
    assert upward <= REACHES_BELOW, (
        f"imports of a stage listed below, not in the page: {upward - REACHES_BELOW}"
    )
    assert upward == REACHES_BELOW, f"listed reaches no longer made: {REACHES_BELOW - upward}"
