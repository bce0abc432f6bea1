"""Request parameters every diffusion endpoint shares (images, videos): the model, prompt,
size, seed, sampler settings and the per-request step cache, and reading them from a JSON body
or a multipart form."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from genserve.entrypoints.content_types import FORM, JSON, require_media_type
from genserve.entrypoints.errors import bad_request
from genserve.multimodal_gen.messages import StepCacheConfig


class StepCacheParam(BaseModel):
    """Per-request DBCache override; omitted fields take the defaults of `StepCacheConfig`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    enabled: bool = True
    residual_diff_threshold: float | None = None
    fn: int | None = Field(default=None, alias="Fn")
    bn: int | None = Field(default=None, alias="Bn")
    warmup_steps: int | None = None
    max_cached_steps: int | None = None
    taylorseer: bool | None = None


# true/false, "dbcache"/"none", or an object of StepCacheParam fields.
StepCacheField = bool | Literal["none", "dbcache"] | StepCacheParam | None


def step_cache_config(value: Any, server_default: StepCacheConfig | None = None
                      ) -> StepCacheConfig | None:
    """The request's `step_cache` as a StepCacheConfig (None = the server default). Fields the
    request leaves out (and a plain `true`) take the server's settings. 400 when a value is out
    of range."""
    if value is None:
        return None
    base = server_default or StepCacheConfig()
    if isinstance(value, bool) or value in ("none", "dbcache"):
        return dataclasses.replace(base, enabled=value is True or value == "dbcache")
    fields = {k: v for k, v in value.model_dump(by_alias=False).items() if v is not None}
    try:
        return dataclasses.replace(base, **fields)
    except ValueError as exc:
        raise bad_request(str(exc), param="step_cache") from None


class DiffusionParams(BaseModel):
    """The fields of every diffusion request body."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str = Field(min_length=1)
    size: str | None = None  # "WIDTHxHEIGHT" or "auto" (the model's default)
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    step_cache: StepCacheField = None
    # LoRA adapters loaded at start (--lora) and their scales, e.g. {"ink": 0.8}.
    lora: dict[str, float] | None = None
    user: str | None = None  # accepted for OpenAI compatibility, unused

    @field_validator("step_cache", mode="before")
    @classmethod
    def _step_cache_from_form(cls, v: Any) -> Any:
        # Multipart forms carry everything as text: "true", "dbcache" or a JSON object.
        if isinstance(v, str) and v.strip().startswith("{"):
            return json.loads(v)
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        return v

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_from_form(cls, v: Any) -> Any:
        if isinstance(v, str):  # a multipart form carries the object as JSON text
            try:
                return json.loads(v)
            except ValueError:
                raise ValueError('lora must be an object of adapter scales, e.g. '
                                 '{"ink": 0.8}') from None
        return v


_NESTED_KEY = re.compile(r"(\w+)\[(\w+)\]")


async def read_form(request: Request, model: type[BaseModel], file_fields: tuple[str, ...],
                    multi_files: tuple[str, ...] = ()
                    ) -> tuple[BaseModel, dict[str, list[bytes]]]:
    """Parse a multipart (or urlencoded) form into `model` plus the raw bytes of file fields,
    in upload order (`image` and `image[]` are one field). Only the fields of `multi_files` may
    come more than once. Bad fields become the usual 400 envelope; a body that is not a form
    gets 415."""
    require_media_type(request, FORM)
    try:
        form = await request.form()
    except Exception as exc:  # malformed multipart body
        raise bad_request(f"could not read the form body: {exc}") from None
    fields: dict[str, Any] = {}
    files: dict[str, list[bytes]] = {}
    for key, value in form.multi_items():
        name = key[:-2] if key.endswith("[]") else key
        nested = _NESTED_KEY.fullmatch(name)
        if nested and not hasattr(value, "read"):
            # An object field as the openai client writes it in a form: `field[key]=value`.
            outer = fields.setdefault(nested[1], {})
            if not isinstance(outer, dict):
                raise bad_request(f"{nested[1]!r} is given both as a value and as an object",
                                  param=nested[1])
            outer[nested[2]] = value
            continue
        if hasattr(value, "read"):
            if name in files and name not in multi_files:
                raise bad_request(f"only one {name!r} file is accepted", param=name)
            files.setdefault(name, []).append(await value.read())
        elif name in file_fields:
            raise bad_request(f"{name!r} must be uploaded as a file", param=name)
        else:
            fields[name] = value
    try:
        return model.model_validate(fields), files
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


async def read_json_or_form(request: Request, model: type[BaseModel],
                            file_fields: tuple[str, ...] = ()
                            ) -> tuple[BaseModel, dict[str, list[bytes]]]:
    """JSON bodies and multipart forms (the openai client sends /v1/videos as multipart); any
    other content type is refused with 415 (see `content_types`)."""
    if require_media_type(request, JSON, FORM) == FORM:
        return await read_form(request, model, file_fields)
    try:
        data = json.loads(await request.body() or b"null")
    except ValueError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}.") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object.")
    try:
        return model.model_validate(data), {}
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
