"""Binary frames of the realtime video protocol: the 24-byte header and the image payloads.

Wire layout (little-endian), specified in docs/realtime_protocol.md:

    magic b"GSF1" | u8 kind | u8 format | u16 reserved | u32 chunk | u16 step |
    u16 frame_index | u16 width | u16 height | u32 payload_length

followed by `payload_length` bytes: an encoded WebP/JPEG image, or raw RGB24 rows
(`height * width * 3` bytes, top row first).
"""

from __future__ import annotations

import enum
import io
import struct
from dataclasses import dataclass

import numpy as np
from PIL import Image

from genserve.multimodal_gen.encoding import encode_image

MAGIC = b"GSF1"
HEADER = struct.Struct("<4sBBHIHHHHI")
HEADER_SIZE = HEADER.size  # 24
_U16_MAX = 0xFFFF


class FrameKind(enum.IntEnum):
    PREVIEW = 0  # an in-progress look at a denoising step
    FINAL = 1  # a decoded output frame


class FrameFormat(enum.IntEnum):
    RGB = 0  # raw rgb24
    JPEG = 1
    WEBP = 2

    @classmethod
    def from_name(cls, name: str) -> FrameFormat:
        try:
            return _FORMAT_BY_NAME[name]
        except KeyError:
            raise ValueError(
                f"preview_format must be one of {', '.join(_FORMAT_BY_NAME)}, got {name!r}"
            ) from None


_FORMAT_BY_NAME = {"webp": FrameFormat.WEBP, "jpeg": FrameFormat.JPEG, "rgb": FrameFormat.RGB}


@dataclass(frozen=True)
class FrameHeader:
    kind: FrameKind
    format: FrameFormat
    chunk: int  # 0-based chunk of the session
    step: int  # denoising steps done (previews); total steps for final frames
    frame_index: int  # index of the frame inside its chunk
    width: int
    height: int
    payload_length: int

    def pack(self) -> bytes:
        for name in ("step", "frame_index", "width", "height"):
            value = getattr(self, name)
            if not 0 <= value <= _U16_MAX:
                raise ValueError(f"frame header {name} {value} does not fit in 16 bits")
        return HEADER.pack(
            MAGIC, int(self.kind), int(self.format), 0, self.chunk, self.step, self.frame_index,
            self.width, self.height, self.payload_length,
        )

    @classmethod
    def unpack(cls, data: bytes) -> FrameHeader:
        """Parse the first 24 bytes of a binary message; ValueError if it is not a GSF1 frame."""
        if len(data) < HEADER_SIZE:
            raise ValueError(f"frame is {len(data)} bytes, shorter than the 24-byte header")
        magic, kind, fmt, _reserved, chunk, step, index, width, height, length = HEADER.unpack_from(
            data
        )
        if magic != MAGIC:
            raise ValueError(f"bad frame magic {magic!r}")
        return cls(FrameKind(kind), FrameFormat(fmt), chunk, step, index, width, height, length)


def encode_payload(rgb: np.ndarray, fmt: FrameFormat, quality: int) -> bytes:
    """Encode one uint8 [H, W, 3] frame. CPU-bound: call it from a worker thread."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] frame, got {rgb.dtype} {rgb.shape}")
    if fmt == FrameFormat.RGB:
        return np.ascontiguousarray(rgb).tobytes()
    # WebP method 0: the fastest encoder setting; quality still bounds the size.
    return encode_image(rgb, fmt.name.lower(), quality, webp_method=0)


def encode_frame(
    rgb: np.ndarray, kind: FrameKind, fmt: FrameFormat, quality: int, chunk: int, step: int,
    frame_index: int,
) -> bytes:
    """Header + payload of one binary WebSocket message."""
    payload = encode_payload(rgb, fmt, quality)
    height, width = rgb.shape[:2]
    header = FrameHeader(kind, fmt, chunk, step, frame_index, width, height, len(payload))
    return header.pack() + payload


def decode_frame(data: bytes) -> tuple[FrameHeader, np.ndarray]:
    """Inverse of `encode_frame` (used by tests and the benchmark client): uint8 [H, W, 3]."""
    header = FrameHeader.unpack(data)
    payload = data[HEADER_SIZE:]
    if len(payload) != header.payload_length:
        raise ValueError(
            f"payload is {len(payload)} bytes, header announces {header.payload_length}"
        )
    if header.format == FrameFormat.RGB:
        expected = header.width * header.height * 3
        if len(payload) != expected:
            raise ValueError(f"rgb payload is {len(payload)} bytes, expected {expected}")
        rgb = np.frombuffer(payload, dtype=np.uint8).reshape(header.height, header.width, 3)
        return header, rgb
    image = Image.open(io.BytesIO(payload))
    image.load()
    if image.size != (header.width, header.height):
        raise ValueError(
            f"image is {image.size[0]}x{image.size[1]}, header announces "
            f"{header.width}x{header.height}"
        )
    return header, np.asarray(image.convert("RGB"))


def warm_up_encoders() -> None:
    """Encode a tiny frame in every format once: the first WebP encode loads its codec, which
    would otherwise delay a session's first preview."""
    tiny = np.zeros((8, 8, 3), dtype=np.uint8)
    for fmt in FrameFormat:
        encode_payload(tiny, fmt, 80)
