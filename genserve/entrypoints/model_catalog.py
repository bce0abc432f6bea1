"""`genserve models`: the servable names of both runtimes' named-model tables, and
`genserve models path NAME`, which materializes one as a folder that stock transformers /
diffusers load (`from_pretrained(folder)`).

Listing imports no torch. Materializing does: an embedded diffusion builder is built (seed 0,
the weights `genserve serve` serves) and saved with `save_pretrained` under
`$GENSERVE_CACHE_DIR/models/NAME`, reused while it was made by the same genserve version; the
embedded GGUF is the HF folder the LLM loader converts it into; a weights folder is printed as
it is.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from genserve import __version__, envs
from genserve.multimodal_gen.named_models import DIFFUSION_MODELS
from genserve.named_models import NamedModel, source_path
from genserve.srt.named_models import EMBEDDED, LLM_MODELS

_SOURCES = {"builder": "embedded builder", "folder": "package weights folder", "gguf": "gguf"}
_STAMP = "genserve-model.json"  # written into a materialized builder folder


def all_rows() -> list[NamedModel]:
    return [*LLM_MODELS.rows, *DIFFUSION_MODELS.rows]


def find(name: str) -> NamedModel:
    for table in (LLM_MODELS, DIFFUSION_MODELS):
        row = table.get(name)
        if row is not None:
            return row
    names = ", ".join(row.name for row in all_rows())
    raise ValueError(f"unknown model name {name!r}; servable names: {names}")


def format_table(rows: list[NamedModel]) -> str:
    header = ("NAME", "RUNTIME", "TASK", "SOURCE", "DEFAULT", "ABOUT")
    lines = [(r.name, r.runtime, r.task, _SOURCES[r.kind], "yes" if r.default else "no",
              r.summary) for r in rows]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(line, widths)), line[-1]]).rstrip()
                     for line in [header, *lines])


def materialize(name: str) -> Path:
    """A folder holding model `name` in its library's own format (see the module docstring)."""
    row = find(name)
    if row.kind == "folder":
        return source_path(row)
    if row.kind == "gguf":
        from genserve.srt.model_loader import resolve_model_folder

        return resolve_model_folder(None if row is EMBEDDED else row.name)[0]
    return _saved_builder(row)


def _saved_builder(row: NamedModel) -> Path:
    folder = envs.GENSERVE_CACHE_DIR.get() / "models" / row.name
    stamp = {"name": row.name, "source": row.source, "seed": 0, "genserve": __version__}
    if (folder / _STAMP).is_file() and json.loads((folder / _STAMP).read_text()) == stamp:
        return folder
    from genserve.multimodal_gen.embedded import build_embedded

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".tmp-{row.name}-"))
    try:
        build_embedded(row.name, shared=False).save_pretrained(tmp)
        (tmp / _STAMP).write_text(json.dumps(stamp, indent=2))
        shutil.rmtree(folder, ignore_errors=True)  # a stale one (another genserve version)
        try:
            tmp.rename(folder)
        except OSError:  # another process saved it meanwhile
            if not (folder / _STAMP).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def run_models(args: argparse.Namespace) -> int:
    if getattr(args, "models_command", None) == "path":
        print(materialize(args.name))
        return 0
    sys.stdout.write(format_table(all_rows()) + "\n")
    return 0
