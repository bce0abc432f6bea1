"""Encode generated frames: PNG / JPEG / WebP images and H.264 MP4 videos (no torch).

MP4s are made by the ffmpeg binary that imageio-ffmpeg bundles: raw RGB frames are piped in,
encoded as H.264 in yuv420p (plays everywhere) with the index at the front (`+faststart`, so a
browser can start playing before the whole file arrives).

PNGs are written here rather than by Pillow, which filters every row adaptively and then deflates
with zlib, on the gateway's CPU for every image served. `encode_png` picks one filter per image
from a sample of its rows and deflates with ISA-L (the `isal` package, part of
genserve[diffusion]), which is faster than zlib's fastest settings. Textured pictures come
out a little smaller than Pillow's, noise the same size, and flat gradients (a few KB either way)
larger. Without ISA-L it falls back to zlib, choosing the strategy on the sample. Timings and
sizes: docs/benchmarks.md.
"""

from __future__ import annotations

import io
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import numpy as np

try:
    from isal import isal_zlib as _isal_zlib
except ImportError:  # not a diffusion install: zlib is slower, the PNGs are the same pictures
    _isal_zlib = None

IMAGE_FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
MP4_MEDIA_TYPE = "video/mp4"


def encode_image(frame: np.ndarray, fmt: str = "png", quality: int = 90, *,
                 webp_method: int = 4) -> bytes:
    """uint8 [H, W, 3] -> encoded bytes. PNG is lossless (same pixels -> same bytes).
    `webp_method`: Pillow's WebP effort, 0 (fastest: realtime previews) to 6; 4 is its default.
    The one image encoder of genserve: the HTTP APIs, `generate` and the realtime frames."""
    from PIL import Image

    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"output_format must be one of {sorted(IMAGE_FORMATS)}, got {fmt!r}")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be between 1 and 100, got {quality}")
    if fmt == "png":
        return encode_png(frame)
    buf = io.BytesIO()
    image = Image.fromarray(np.ascontiguousarray(frame), mode="RGB")
    if fmt == "jpeg":
        image.save(buf, format="JPEG", quality=quality)
    else:
        image.save(buf, format="WEBP", quality=quality, method=webp_method)
    return buf.getvalue()


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_COLOR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> grey, grey+alpha, RGB, RGBA
_PNG_SAMPLE_ROWS = 32  # rows that choose the filter and the deflate strategy
# Deflate output above this share of its input: the picture is noise; store it uncompressed.
_PNG_STORE_RATIO = 0.97


def encode_png(pixels: np.ndarray) -> bytes:
    """uint8 [H, W] or [H, W, C] (C = 1-4) -> PNG bytes, 8 bits per sample, lossless.

    One filter for the whole image (none, sub, up or average: the one whose filtered sample
    rows have the smallest sum of absolute values, the PNG spec's heuristic), then deflate at
    the fastest level. Same pixels -> same bytes.
    """
    if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3):
        raise ValueError(f"PNG needs uint8 [H, W] or [H, W, C] pixels, got {pixels.dtype} "
                         f"{pixels.shape}")
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    height, width, channels = pixels.shape
    if channels not in _PNG_COLOR_TYPES or height == 0 or width == 0:
        raise ValueError(f"PNG needs 1-4 channels and a non-empty picture, got {pixels.shape}")
    rows = np.ascontiguousarray(pixels).reshape(height, width * channels)
    sample = np.arange(0, height, max(1, height // _PNG_SAMPLE_ROWS))
    kind = min(range(4), key=lambda k: _filter_cost(_png_filter(rows, channels, k, sample)))
    filtered = np.empty((height, 1 + rows.shape[1]), dtype=np.uint8)
    filtered[:, 0] = kind
    filtered[:, 1:] = _png_filter(rows, channels, kind)
    header = struct.pack(">IIBBBBB", width, height, 8, _PNG_COLOR_TYPES[channels], 0, 0, 0)
    return b"".join((_PNG_SIGNATURE, _png_chunk(b"IHDR", header),
                     _png_chunk(b"IDAT", _png_deflate(filtered, sample)),
                     _png_chunk(b"IEND", b"")))


def _png_filter(rows: np.ndarray, bpp: int, kind: int,
                which: np.ndarray | None = None) -> np.ndarray:
    """PNG filter `kind` (0 none, 1 sub, 2 up, 3 average) of `rows` (or of rows `which`);
    uint8 arithmetic wraps modulo 256 as the spec's does."""
    cur = rows if which is None else rows[which]
    if kind == 0:
        return cur
    left = np.zeros_like(cur)
    left[:, bpp:] = cur[:, :-bpp]
    if kind == 1:
        return cur - left
    if which is None:
        up = np.zeros_like(rows)
        up[1:] = rows[:-1]
    else:
        up = np.where((which > 0)[:, None], rows[np.maximum(which - 1, 0)], 0).astype(np.uint8)
    if kind == 2:
        return cur - up
    return cur - ((left.astype(np.uint16) + up) >> 1).astype(np.uint8)


def _png_deflate(filtered: np.ndarray, sample: np.ndarray) -> bytes:
    """The zlib stream of the filtered rows: ISA-L at level 1 when installed; otherwise zlib at
    level 1 with the strategy (default, or run-length only: faster, and smaller on textured
    pictures) that packs the sample rows smaller, and no compression when the sample does not
    shrink (noise)."""
    data = filtered.tobytes()
    if _isal_zlib is not None:
        return _isal_zlib.compress(data, 1)
    sample_bytes = filtered[sample].tobytes()
    packed, strategy = min((len(_deflate(sample_bytes, 1, s)), s)
                           for s in (zlib.Z_DEFAULT_STRATEGY, zlib.Z_RLE))
    level = 0 if packed > _PNG_STORE_RATIO * len(sample_bytes) else 1
    return _deflate(data, level, strategy)


def _filter_cost(filtered: np.ndarray) -> int:
    return int(np.abs(filtered.view(np.int8).astype(np.int16)).sum())


def _deflate(data: bytes, level: int, strategy: int) -> bytes:
    compressor = zlib.compressobj(level, zlib.DEFLATED, 15, 8, strategy)
    return compressor.compress(data) + compressor.flush()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(data, zlib.crc32(kind))
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def ffmpeg_exe() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


def encode_mp4(frames: np.ndarray, fps: int, crf: int = 18) -> bytes:
    """uint8 [F, H, W, 3] -> H.264 yuv420p faststart MP4 bytes."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    num, height, width, _ = frames.shape
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "video.mp4"
        cmd = [
            ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-y",
            "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(fps),
            "-i", "-",
            # yuv420p needs even sides; pad by one pixel if a side is odd.
            "-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2",
            "-c:v", "libx264", "-preset", "veryfast", "-crf", str(crf), "-pix_fmt", "yuv420p",
            "-movflags", "+faststart", "-frames:v", str(num), str(out),
        ]
        proc = subprocess.run(cmd, input=np.ascontiguousarray(frames).tobytes(),
                              capture_output=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"ffmpeg failed: {proc.stderr.decode(errors='replace')[-500:]}")
        return out.read_bytes()


def probe_mp4(path: str | Path) -> dict:
    """{faststart, codec, pix_fmt, fps, num_frames, width, height} of an MP4 (bundled ffmpeg)."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    num = sum(1 for _ in reader)
    info = subprocess.run([ffmpeg_exe(), "-hide_banner", "-i", str(path)],
                          capture_output=True, text=True).stderr
    video_line = next((ln for ln in info.splitlines() if "Video:" in ln), "")
    head = Path(path).read_bytes()
    return {
        # faststart: the index (moov box) comes before the media data (mdat box).
        "faststart": 0 <= head.find(b"moov") < head.find(b"mdat"),
        "codec": video_line.split("Video:")[1].split()[0] if video_line else None,
        "pix_fmt": "yuv420p" if "yuv420p" in video_line else None,
        "fps": meta.get("fps"),
        "num_frames": num,
        "width": meta["size"][0],
        "height": meta["size"][1],
    }
