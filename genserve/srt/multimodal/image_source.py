"""Image inputs of vision-language requests: data URLs, raw base64, and http(s) URLs fetched
only from an explicit allow-list. No torch here: the gateway runs it.

A URL fetch never reaches a loopback, private, link-local, multicast or reserved address (the
resolved IP is checked and then connected to, so a DNS answer cannot change between the check
and the connection), follows a redirect only after checking the new location the same way,
stops reading past `max_bytes`, and gives up after `timeout_s`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # ~8k x 8k; decoded RGB would be 192 MiB
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

Resolver = Callable[[str, int], Awaitable[list[str]]]


class ImageInputError(ValueError):
    """A bad image input (the message says what to fix); answered with 400."""


@dataclass(frozen=True)
class ImageFetchPolicy:
    # Hosts whose http(s) image URLs may be fetched: "example.com" also allows its subdomains;
    # "*" allows any public host. Empty = URLs are refused (data URLs and base64 still work).
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    timeout_s: float = 10.0
    max_redirects: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.allowed_domains, tuple):
            raise ValueError("allowed_domains must be a tuple of host names")
        if self.max_bytes < 1024:
            raise ValueError(f"max_bytes must be >= 1024, got {self.max_bytes}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for entry in self.allowed_domains:
            entry = entry.lower().strip().lstrip(".").rstrip(".")
            if entry == "*" or host == entry or host.endswith("." + entry):
                return True
        return False


def is_public_address(ip: str) -> bool:
    """False for loopback, private, link-local (cloud metadata), multicast, reserved,
    unspecified and shared (CGNAT) addresses, also when written as IPv4-mapped IPv6."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_global and not addr.is_multicast


def decode_inline(source: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes | None:
    """Bytes of a data URL or raw base64 string; None when `source` is an http(s) URL."""
    text = source.strip()
    if text.lower().startswith(("http://", "https://")):
        return None
    if text.lower().startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or not header.lower().endswith(";base64"):
            raise ImageInputError("an image data URL must look like data:image/png;base64,<data>")
        mime = header[5:].split(";", 1)[0].lower()
        if mime and not mime.startswith("image/"):
            raise ImageInputError(f"data URL has media type {mime!r}; an image/* type is needed")
        text = payload
    elif "://" in text[:16]:
        scheme = text.split("://", 1)[0]
        raise ImageInputError(f"image URL scheme {scheme!r} is not supported (use https or data)")
    if len(text) > max_bytes * 4 // 3 + 8:
        raise ImageInputError(f"the image is larger than the {max_bytes} byte limit")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(
            "the image is neither an http(s) URL, a data URL nor valid base64"
        ) from None
    if not data:
        raise ImageInputError("the image data is empty")
    return data


async def _default_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


async def load_image_bytes(
    source: str,
    policy: ImageFetchPolicy,
    resolver: Resolver | None = None,
    transport: Any = None,
) -> bytes:
    """Encoded bytes of one image source. `resolver` and `transport` (an httpx transport)
    replace DNS and the network, for tests that must not leave the machine."""
    if not isinstance(source, str) or not source.strip():
        raise ImageInputError("an image must be a non-empty string (URL, data URL or base64)")
    inline = decode_inline(source, policy.max_bytes)
    if inline is not None:
        return inline
    if not policy.allowed_domains:
        raise ImageInputError(
            "image URLs are not fetched by this server: send the image as a base64 data URL, "
            "or start the server with --allowed-image-domains HOST[,HOST...]"
        )
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _fetch(source.strip(), policy, resolver or _default_resolver, transport)
    except TimeoutError:
        raise ImageInputError(
            f"fetching the image took longer than {policy.timeout_s:g} s"
        ) from None


async def _fetch(url: str, policy: ImageFetchPolicy, resolver: Resolver, transport: Any) -> bytes:
    import httpx

    async with httpx.AsyncClient(
        transport=transport, follow_redirects=False, trust_env=False
    ) as client:
        for _ in range(policy.max_redirects + 1):
            target, host, ip_url = await _checked_target(url, policy, resolver)
            extensions = {"sni_hostname": host} if target.scheme == "https" else {}
            request = client.build_request(
                "GET",
                ip_url,
                headers={"Host": target.netloc, "Accept-Encoding": "identity"},
                extensions=extensions,
            )
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise ImageInputError(f"could not fetch the image from {host}: {exc}") from None
            try:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise ImageInputError("the image URL redirected without a location")
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise ImageInputError(
                        f"fetching the image from {host} returned HTTP {response.status_code}"
                    )
                return await _read_capped(response, policy.max_bytes)
            finally:
                await response.aclose()
    raise ImageInputError(f"the image URL redirected more than {policy.max_redirects} times")


async def _checked_target(url: str, policy: ImageFetchPolicy, resolver: Resolver):
    target = urlsplit(url)
    if target.scheme not in ("http", "https"):
        raise ImageInputError(f"image URL scheme {target.scheme!r} is not supported")
    host = (target.hostname or "").lower()
    if not host:
        raise ImageInputError("the image URL has no host")
    if target.username or target.password:
        raise ImageInputError("image URLs with credentials are not fetched")
    if not policy.allows(host):
        raise ImageInputError(
            f"image host {host!r} is not in this server's --allowed-image-domains"
        )
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        ipaddress.ip_address(host)
        addresses = [host]  # an IP literal is checked as written
    except ValueError:
        addresses = None
    try:
        addresses = addresses or await resolver(host, port)
    except OSError as exc:
        raise ImageInputError(f"cannot resolve image host {host!r}: {exc}") from None
    if not addresses:
        raise ImageInputError(f"cannot resolve image host {host!r}")
    for ip in addresses:
        if not is_public_address(ip):
            raise ImageInputError(
                f"image host {host!r} resolves to a non-public address; it is not fetched"
            )
    ip = addresses[0]
    ip_host = f"[{ip}]" if ":" in ip else ip
    ip_url = target._replace(netloc=f"{ip_host}:{port}").geturl()
    return target, host, ip_url


async def _read_capped(response: Any, max_bytes: int) -> bytes:
    length = response.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise ImageInputError(f"the image ({length} bytes) exceeds the {max_bytes} byte limit")
    buf = bytearray()
    async for chunk in response.aiter_bytes():  # decoded: the cap holds for gzip too
        buf.extend(chunk)
        if len(buf) > max_bytes:
            raise ImageInputError(f"the image exceeds the {max_bytes} byte limit")
    if not buf:
        raise ImageInputError("the image URL returned no data")
    return bytes(buf)


def open_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Any:
    """Decode encoded image bytes into an RGB PIL image, refusing unknown formats, truncated
    files and decompression bombs (the pixel count is checked before anything is decoded)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.format not in ALLOWED_FORMATS:
                raise ImageInputError(
                    f"image format {img.format} is not supported (use {', '.join(ALLOWED_FORMATS)})"
                )
            width, height = img.size
            if width < 1 or height < 1:
                raise ImageInputError("the image has no pixels")
            if width * height > max_pixels:
                raise ImageInputError(
                    f"the image is {width}x{height} pixels, more than the {max_pixels} allowed"
                )
            img.load()
            return img.convert("RGB")
    except ImageInputError:
        raise
    except UnidentifiedImageError:
        raise ImageInputError("the image cannot be decoded (unknown or corrupt format)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageInputError("the image has more pixels than this server decodes") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageInputError(f"the image cannot be decoded: {exc}") from None
