"""Image inputs of LLM requests (OpenAI image_url parts, native image_data): checks the model
takes images, turns each source into encoded bytes under the server's fetch policy, and answers
bad input with a 400 that names the problem. No torch, no decoding here: the engine's processor
decodes the bytes off the event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from genserve.entrypoints.errors import bad_request
from genserve.srt.client import LLMEngineClient
from genserve.srt.multimodal.image_source import ImageFetchPolicy, ImageInputError, load_image_bytes

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState


def fetch_policy(state: GatewayState) -> ImageFetchPolicy:
    cfg = state.config
    return ImageFetchPolicy(cfg.allowed_image_domains, max_bytes=cfg.max_image_bytes)


def require_images(client: LLMEngineClient, param: str) -> None:
    if "image" not in client.modalities:
        raise bad_request(f"Model {client.model_name!r} does not take image inputs.",
                          param=param, code="image_input_not_supported")


async def load_images(state: GatewayState, client: LLMEngineClient, sources: list[Any],
                      param: str) -> list[bytes] | None:
    """Encoded bytes of each image source (data URL, base64 or allowed http(s) URL)."""
    if not sources:
        return None
    require_images(client, param)
    policy = fetch_policy(state)
    images: list[bytes] = []
    for k, source in enumerate(sources):
        if not isinstance(source, str):
            raise bad_request("Each image must be a URL, a data URL or a base64 string.",
                              param=f"{param}.{k}", code="invalid_image")
        try:
            images.append(await load_image_bytes(source, policy))
        except ImageInputError as exc:
            raise bad_request(f"Image {k}: {exc}.", param=f"{param}.{k}",
                              code="invalid_image") from None
    return images


async def process_images(client: LLMEngineClient, ids: list[int], images: list[bytes],
                         param: str) -> tuple[list[int], Any]:
    """The engine's preprocessing (off the event loop): expanded ids and the mm_inputs."""
    try:
        return await client.process_images(ids, images)
    except ValueError as exc:
        raise bad_request(f"{exc}.", param=param, code="invalid_image") from None
