"""The 24-byte GSF1 header and the three payload formats."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from genserve.entrypoints.realtime.frames import (
    HEADER_SIZE,
    FrameFormat,
    FrameHeader,
    FrameKind,
    decode_frame,
    encode_frame,
)


def test_header_layout_matches_the_contract():
    data = encode_frame(np.zeros((6, 10, 3), np.uint8), FrameKind.FINAL, FrameFormat.RGB, 80,
                        chunk=70000, step=9, frame_index=4)
    assert HEADER_SIZE == 24
    fields = struct.Struct("<4sBBHIHHHHI").unpack_from(data)
    assert fields == (b"GSF1", 1, 0, 0, 70000, 9, 4, 10, 6, 180)
    assert len(data) == 24 + 180


@pytest.mark.parametrize("fmt", list(FrameFormat))
def test_every_format_round_trips(fmt):
    rng = np.random.default_rng(0)
    rgb = np.repeat(np.repeat(rng.integers(0, 255, (3, 4, 3), np.uint8), 8, 0), 8, 1)
    header, out = decode_frame(encode_frame(rgb, FrameKind.PREVIEW, fmt, 95, 0, 1, 0))
    assert header.kind == FrameKind.PREVIEW and header.format == fmt
    assert (header.width, header.height) == (32, 24) and out.shape == rgb.shape
    tolerance = 0 if fmt == FrameFormat.RGB else 12
    assert np.abs(out.astype(int) - rgb.astype(int)).mean() <= tolerance


def test_bad_frames_are_rejected():
    good = encode_frame(np.zeros((4, 4, 3), np.uint8), FrameKind.FINAL, FrameFormat.RGB, 80, 0,
                        1, 0)
    with pytest.raises(ValueError, match="magic"):
        decode_frame(b"XXXX" + good[4:])
    with pytest.raises(ValueError, match="payload"):
        decode_frame(good[:-1])
    with pytest.raises(ValueError, match="16 bits"):
        FrameHeader(FrameKind.FINAL, FrameFormat.RGB, 0, 70000, 0, 4, 4, 48).pack()
    with pytest.raises(ValueError, match="preview_format"):
        FrameFormat.from_name("gif")
