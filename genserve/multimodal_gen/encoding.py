"""Encode generated frames: PNG / JPEG / WebP images and H.264 MP4 videos (no torch).

MP4s are made by the ffmpeg binary that imageio-ffmpeg bundles: raw RGB frames are piped in,
encoded as H.264 in yuv420p (plays everywhere) with the index at the front (`+faststart`, so a
browser can start playing before the whole file arrives).
"""

from __future__ import annotations

import io
import subprocess
import tempfile
from pathlib import Path

import numpy as np

IMAGE_FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
MP4_MEDIA_TYPE = "video/mp4"


def encode_image(frame: np.ndarray, fmt: str = "png", quality: int = 90) -> bytes:
    """uint8 [H, W, 3] -> encoded bytes. PNG is lossless (same pixels -> same bytes)."""
    from PIL import Image

    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"output_format must be one of {sorted(IMAGE_FORMATS)}, got {fmt!r}")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be between 1 and 100, got {quality}")
    buf = io.BytesIO()
    image = Image.fromarray(np.ascontiguousarray(frame), mode="RGB")
    if fmt == "png":
        image.save(buf, format="PNG", compress_level=1)  # fast; still lossless
    elif fmt == "jpeg":
        image.save(buf, format="JPEG", quality=quality)
    else:
        image.save(buf, format="WEBP", quality=quality)
    return buf.getvalue()


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
