"""The endless world of the streaming demo model (`shapes-stream`): one shape travelling on a
torus.

The prompt is the video grammar (`world.VIDEO_GRAMMAR`): "a red circle moving right on a black
background". The shape moves `SPEED` pixels a frame (at the native 64x64) in the prompt's
direction and wraps around at the border: it leaves on one side and re-enters on the other, drawn
on both sides while it crosses (the frame is a torus, so its position is always continuous
modulo the frame). A prompt switch keeps the position and the shape's size and changes colour,
shape, direction and background from the next frame on.

`render` draws a schedule of prompts (a scene per frame) from a start state;
`circular_centroid` reads a position back from a frame on the torus. Pure numpy: the gateway
may import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from genserve.demo_models import world

SIZE = 64  # native resolution of shapes-stream
SPEED = 2.0  # pixels a frame at SIZE (1/32 of the width: a crossing takes 32 frames)
RADIUS = SIZE * 0.15  # the shape's half-extent before jitter
SUPERSAMPLE = 2  # anti-aliasing (64x64 needs less than the 32x32 models' 4x)


def _torus_mask(shape: str, cx: np.ndarray, cy: np.ndarray, r: np.ndarray | float,
                size: int) -> np.ndarray:
    """Coverage [N, size, size] of shapes centred at (cx, cy) on a size x size torus: the
    shape drawn at its centre and at the eight wrapped copies, combined by max."""
    cx = np.asarray(cx, np.float32) % size
    cy = np.asarray(cy, np.float32) % size
    out = np.zeros(cx.shape + (size, size), np.float32)
    for ox in (-size, 0, size):
        for oy in (-size, 0, size):
            # Only copies that can touch the frame are drawn.
            near = (cx + ox > -2 * size / 3) & (cx + ox < size + 2 * size / 3) \
                & (cy + oy > -2 * size / 3) & (cy + oy < size + 2 * size / 3)
            if not near.any():
                continue
            idx = np.nonzero(near)[0]
            mask = world._shape_mask(shape, cx[idx] + ox, cy[idx] + oy, float(r), size,
                                    SUPERSAMPLE)
            out[idx] = np.maximum(out[idx], mask)
    return out


@dataclass
class StreamState:
    """Where the shape is (pixels at `SIZE`, any real number: positions wrap) and its size
    (the same in every video: a prompt does not name a size)."""

    cx: float
    cy: float
    r: float = RADIUS

    @classmethod
    def start(cls) -> StreamState:
        """Where every video starts: the shape enters at the centre of the frame. A fixed
        start makes the first chunk (which has no history to continue) a function of the
        prompt alone, so a few-step sampler draws it whole instead of averaging over places."""
        return cls(SIZE / 2, SIZE / 2)

    @classmethod
    def random(cls, rng: np.random.Generator) -> StreamState:
        """Anywhere on the torus: the middle of a video that started long ago."""
        return cls(float(rng.uniform(0, SIZE)), float(rng.uniform(0, SIZE)))


def render(scenes: list[world.Scene], state: StreamState,
           size: int = SIZE) -> tuple[np.ndarray, StreamState]:
    """Frames uint8 [len(scenes), size, size, 3]: frame i draws `scenes[i]` one step after
    frame i - 1 (the first frame is one step after `state`), and the state after the last."""
    n = len(scenes)
    dxs = np.array([world.DIRECTIONS[s.direction][0] for s in scenes], np.float32)
    dys = np.array([world.DIRECTIONS[s.direction][1] for s in scenes], np.float32)
    step = SPEED * size / SIZE
    cx = state.cx * size / SIZE + step * np.cumsum(dxs)
    cy = state.cy * size / SIZE + step * np.cumsum(dys)
    r = state.r * size / SIZE
    frames = np.empty((n, size, size, 3), np.uint8)
    # Runs of one scene render together (one mask call per run).
    start = 0
    while start < n:
        end = start
        while end < n and scenes[end] == scenes[start]:
            end += 1
        s = scenes[start]
        mask = _torus_mask(s.shape, cx[start:end], cy[start:end], r, size)
        frames[start:end] = world._compose(mask, s.colour, s.background)
        start = end
    after = StreamState(float(cx[-1] * SIZE / size), float(cy[-1] * SIZE / size), state.r)
    return frames, after


def circular_centroid(mask: np.ndarray) -> tuple[float, float] | None:
    """The centre (x, y) of a mask on the torus (circular mean of each axis), or None for an
    empty mask. A shape drawn across the border reads as one shape at the border."""
    total = float(mask.sum())
    if total <= 0:
        return None
    h, w = mask.shape
    out = []
    for axis, n in ((0, w), (1, h)):  # x: sum over rows; y: sum over columns
        weights = mask.sum(axis=axis)
        angles = 2 * np.pi * (np.arange(n) + 0.5) / n
        c, s = (weights * np.cos(angles)).sum(), (weights * np.sin(angles)).sum()
        out.append(float(np.arctan2(s, c) % (2 * np.pi) * n / (2 * np.pi)))
    return out[0], out[1]


CONTRAST_REF = 150.0  # RGB distance of a colour from its background under which a frame is faint


def contrast_weight(scene: world.Scene, power: float) -> float:
    """How much more a training frame of `scene` weighs when its colour is close to its
    background: (CONTRAST_REF / distance) ** power, at least 1 (1 for power 0). A blur that a
    bright shape survives erases the corners and tips of a faint one (purple on gray, RGB
    distance 86; the next faintest is 123), so the trainers weigh faint frames up."""
    if power <= 0:
        return 1.0
    distance = float(np.linalg.norm(np.subtract(world.COLOURS[scene.colour],
                                                world.BACKGROUNDS[scene.background])))
    return max(1.0, (CONTRAST_REF / distance) ** power)


def torus_delta(a: float, b: float, n: float) -> float:
    """The signed shortest step from a to b on a circle of length n."""
    return float((b - a + n / 2) % n - n / 2)
