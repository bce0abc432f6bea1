"""The package layering of `genserve` (docs/architecture.md), read from every module's imports.

Each subpackage has a layer and imports only packages of lower layers, so the package graph has
no cycle; the runtimes (srt, multimodal_gen, entrypoints, kernels) never import the demo models,
which they load through their named-model tables' dotted paths instead (`importlib` at run
time, not an import statement). Imports inside functions count as much as top-level ones.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import genserve

ROOT = Path(genserve.__file__).parent
# Lower imports nothing of higher; one layer's packages do not import each other.
LAYERS = {
    "kernels": 1,  # Triton kernels and their torch references
    "srt": 2,  # the LLM runtime
    "multimodal_gen": 2,  # the diffusion runtime
    "lang": 3,  # the frontend language, over srt
    "bench": 3,  # load generators and benchmark drivers, over srt
    "entrypoints": 4,  # CLI and HTTP gateway, over both runtimes
    "demo_models": 5,  # training and evaluation of the demo models, over everything
}
RUNTIME_PACKAGES = ("srt", "multimodal_gen", "entrypoints", "kernels")


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in the module, relative ones made absolute; for
    `from package import name` both the package and `package.name` (a submodule or not)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield node.lineno, source
            for alias in node.names:
                yield node.lineno, f"{source}.{alias.name}"


def _subpackage(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[0] != "genserve" or len(parts) < 2 or not (ROOT / parts[1]).is_dir():
        return None
    return parts[1]


def _package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) subpackage -> the "module:line" of each such import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in _modules():
        own = _subpackage(module)
        for line, name in _imports(module, path):
            target = _subpackage(name)
            where = edges.setdefault((own or "genserve", target), []) if (
                target is not None and target != own) else None
            if where is not None and f"{module}:{line}" not in where:
                where.append(f"{module}:{line}")
    return edges


def test_every_subpackage_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYERS)


def test_runtime_packages_never_import_the_demo_models():
    offenders = [
        f"{module}:{line} imports {name}"
        for module, path in _modules() if _subpackage(module) in RUNTIME_PACKAGES
        for line, name in _imports(module, path) if _subpackage(name) == "demo_models"
    ]
    assert not offenders, offenders


def test_packages_import_only_lower_layers():
    offenders = [
        f"{importer} (layer {LAYERS.get(importer)}) imports {imported} (layer "
        f"{LAYERS[imported]}) at {', '.join(where)}"
        for (importer, imported), where in _package_edges().items()
        # `genserve/__init__.py` re-exports `Engine` lazily (PEP 562): the front door, no layer.
        if importer != "genserve" and LAYERS[imported] >= LAYERS[importer]
    ]
    assert not offenders, offenders


def test_top_level_modules_import_no_subpackage():
    # envs, supervision, named_models, word_tokenizer: below every subpackage.
    offenders = [where for (importer, _), where in _package_edges().items()
                 if importer == "genserve"]
    lazy_front_door = [w for where in offenders for w in where if w.startswith("genserve:")]
    assert [w for where in offenders for w in where] == lazy_front_door


def test_package_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for importer, imported in _package_edges():
        if importer != "genserve":
            graph.setdefault(importer, set()).add(imported)
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        assert node not in stack, f"import cycle: {' -> '.join(stack + [node])}"
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, stack + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
