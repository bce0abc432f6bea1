"""The procedural world the demo models are trained on: one coloured shape on a plain background.

Prompt grammar (the only prompts the demo models understand):

- image: ``a {colour} {shape} on a {background} background, {position}``
- video: ``a {colour} {shape} moving {direction} on a {background} background``

`render_image` / `render_video` draw a scene (anti-aliased by 4x supersampling) with a little
random jitter of size and placement; `parse_prompt` reads a prompt back into a `Scene`. A fixed
set of attribute combinations is held out of training (`held_out`) so evaluation uses prompts the
models never saw. Pure numpy: the gateway may import it.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 180),
    "orange": (240, 140, 30),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "gray": (128, 128, 128),
}
SHAPES = ("circle", "square", "triangle")
# Row-major 3x3 grid cells: (row, col).
POSITIONS: dict[str, tuple[int, int]] = {
    "top left": (0, 0), "top": (0, 1), "top right": (0, 2),
    "left": (1, 0), "center": (1, 1), "right": (1, 2),
    "bottom left": (2, 0), "bottom": (2, 1), "bottom right": (2, 2),
}
DIRECTIONS: dict[str, tuple[int, int]] = {  # unit motion (dx, dy) in image coordinates
    "left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1),
}

SIZE = 32  # native resolution of both demo models
NUM_FRAMES = 16  # frames of a demo video
SUPERSAMPLE = 4

IMAGE_GRAMMAR = "a {colour} {shape} on a {background} background, {position}"
VIDEO_GRAMMAR = "a {colour} {shape} moving {direction} on a {background} background"

# Every word either grammar uses, for the word-level tokenizer.
VOCAB = sorted(
    set(COLOURS) | set(BACKGROUNDS) | set(SHAPES) | set(DIRECTIONS)
    | {w for p in POSITIONS for w in p.split()} | {"a", "on", "background", "moving", ","}
)


@dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    background: str
    position: str | None = None  # images
    direction: str | None = None  # videos

    @property
    def is_video(self) -> bool:
        return self.direction is not None

    def prompt(self) -> str:
        if self.is_video:
            return VIDEO_GRAMMAR.format(colour=self.colour, shape=self.shape,
                                        direction=self.direction, background=self.background)
        return IMAGE_GRAMMAR.format(colour=self.colour, shape=self.shape,
                                    background=self.background, position=self.position)


def all_scenes(video: bool) -> list[Scene]:
    if video:
        return [Scene(c, s, b, direction=d) for c, s, d, b in
                itertools.product(COLOURS, SHAPES, DIRECTIONS, BACKGROUNDS)]
    return [Scene(c, s, b, position=p) for c, s, b, p in
            itertools.product(COLOURS, SHAPES, BACKGROUNDS, POSITIONS)]


def held_out(video: bool, count: int = 60) -> list[Scene]:
    """The `count` scenes never used in training (a fixed, seeded choice)."""
    scenes = all_scenes(video)
    return random.Random(1234 if video else 4321).sample(scenes, count)


def training_scenes(video: bool) -> list[Scene]:
    excluded = set(held_out(video))
    return [s for s in all_scenes(video) if s not in excluded]


_IMAGE_RE = re.compile(
    r"^\s*an?\s+(\w+)\s+(\w+)\s+on\s+an?\s+(\w+)\s+background\s*,?\s*([a-z ]+?)\s*\.?\s*$")
_VIDEO_RE = re.compile(
    r"^\s*an?\s+(\w+)\s+(\w+)\s+moving\s+(\w+)\s+on\s+an?\s+(\w+)\s+background\s*\.?\s*$")


def parse_prompt(prompt: str) -> Scene | None:
    """The scene a grammar prompt describes, or None when it does not follow the grammar."""
    text = prompt.lower()
    m = _VIDEO_RE.match(text)
    if m:
        colour, shape, direction, background = m.groups()
        scene = Scene(colour, shape, background, direction=direction)
    else:
        m = _IMAGE_RE.match(text)
        if not m:
            return None
        colour, shape, background, position = m.groups()
        scene = Scene(colour, shape, background, position=" ".join(position.split()))
    ok = (scene.colour in COLOURS and scene.shape in SHAPES and scene.background in BACKGROUNDS
          and (scene.position in POSITIONS if not scene.is_video
               else scene.direction in DIRECTIONS))
    return scene if ok else None


# ---- drawing ----

def _shape_mask(shape: str, cx, cy, r: float, size: int,
                supersample: int = SUPERSAMPLE) -> np.ndarray:
    """Coverage in [0, 1] of a shape of half-extent `r` centred at (cx, cy): [size, size], or
    [N, size, size] when cx and cy are arrays of N centres."""
    n = size * supersample
    coords = (np.arange(n, dtype=np.float32) + 0.5) / supersample
    cx = np.asarray(cx, np.float32)
    cy = np.asarray(cy, np.float32)
    x = coords[None, :] - cx[..., None, None]  # [..., 1, n]: offset from the centre
    y = coords[:, None] - cy[..., None, None]  # [..., n, 1]
    if shape == "circle":
        inside = x * x + y * y <= r * r
    elif shape == "square":
        s = r * 0.9  # same visual weight as the circle
        inside = (np.abs(x) <= s) & (np.abs(y) <= s)
    elif shape == "triangle":  # apex up, base at the bottom of the box
        t = np.clip((y + r) / (2 * r), 0.0, None)
        inside = (y >= -r) & (y <= r) & (np.abs(x) <= t * r)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    inside = np.broadcast_to(inside, cx.shape + (n, n)).astype(np.float32)
    return inside.reshape(cx.shape + (size, supersample, size, supersample)).mean(axis=(-3, -1))


def _compose(mask: np.ndarray, colour: str, background: str) -> np.ndarray:
    fg = np.array(COLOURS[colour], dtype=np.float32)
    bg = np.array(BACKGROUNDS[background], dtype=np.float32)
    img = bg + mask[..., None] * (fg - bg)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def cell_centre(position: str, size: int = SIZE) -> tuple[float, float]:
    row, col = POSITIONS[position]
    cell = size / 3
    return (col + 0.5) * cell, (row + 0.5) * cell


def render_image(scene: Scene, rng: np.random.Generator | None = None,
                 size: int = SIZE) -> np.ndarray:
    """uint8 [size, size, 3]; `rng` jitters size and placement (None = canonical)."""
    r = size * 0.15
    cx, cy = cell_centre(scene.position, size)
    if rng is not None:
        r *= rng.uniform(0.85, 1.1)
        cx += rng.uniform(-1.0, 1.0) * size / 32
        cy += rng.uniform(-1.0, 1.0) * size / 32
    cx = float(np.clip(cx, r + 0.5, size - r - 0.5))
    cy = float(np.clip(cy, r + 0.5, size - r - 0.5))
    return _compose(_shape_mask(scene.shape, cx, cy, r, size), scene.colour, scene.background)


def render_video(scene: Scene, rng: np.random.Generator | None = None,
                 num_frames: int = NUM_FRAMES, size: int = SIZE) -> np.ndarray:
    """uint8 [num_frames, size, size, 3]: the shape crosses the frame in its direction."""
    r = size * 0.15
    dx, dy = DIRECTIONS[scene.direction]
    lo, hi = r + 1.0, size - r - 1.0
    # The path runs through the middle, jittered by up to 2 pixels (at 32x32) across it.
    cross = size / 2 + (rng.uniform(-1.0, 1.0) * size / 16 if rng is not None else 0.0)
    if rng is not None:
        r *= rng.uniform(0.85, 1.1)
        start = rng.uniform(0.0, 0.1)
        end = rng.uniform(0.9, 1.0)
    else:
        start, end = 0.0, 1.0
    t = start + (end - start) * np.arange(num_frames) / max(num_frames - 1, 1)
    along = lo + (hi - lo) * t
    if dx:
        cx, cy = (along if dx > 0 else size - along), np.full(num_frames, cross)
    else:
        cx, cy = np.full(num_frames, cross), (along if dy > 0 else size - along)
    return _compose(_shape_mask(scene.shape, cx, cy, r, size), scene.colour, scene.background)


def grammar_words(video: bool) -> str:
    """The choices of each slot of a grammar, for docs and /v1/models."""
    slots = {"colour": list(COLOURS), "shape": list(SHAPES), "background": list(BACKGROUNDS)}
    if video:
        slots["direction"] = list(DIRECTIONS)
    else:
        slots["position"] = list(POSITIONS)
    return "; ".join(f"{name}: {' | '.join(words)}" for name, words in slots.items())
