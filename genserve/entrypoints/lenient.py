"""Request models that accept fields they do not know, as vLLM and SGLang do.

Real clients send fields a server may not know (`user`, `store`, `metadata`,
`reasoning_effort`, SGLang's `return_routed_experts`...). They are accepted and ignored; each
ignored field name is logged once per request model so an operator can see what clients send.
Fields genserve knows but cannot honour are declared in the models and answered with a 400.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger(__name__)

_logged: set[str] = set()
_lock = threading.Lock()


def _note_ignored(model: str, names: list[str]) -> None:
    with _lock:
        fresh = [n for n in names if f"{model}.{n}" not in _logged]
        _logged.update(f"{model}.{n}" for n in fresh)
    for name in fresh:
        logger.info("ignoring unknown field %r in %s requests (logged once)", name, model)


class LenientModel(BaseModel):
    """Ignores (and logs once per name) the fields it does not declare."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known.update(f.alias for f in cls.model_fields.values() if f.alias)
            unknown = [str(k) for k in data if k not in known]
            if unknown:
                _note_ignored(cls.__name__, unknown)
        return data
