"""Score a generated picture or clip against its prompt, with no model: plain image statistics.

- background: the median colour, nearest of the background palette;
- foreground: pixels more than `FG_DISTANCE` RGB units from that background colour;
- colour: nearest palette colour to the foreground's mean;
- position: the 3x3 grid cell of the foreground centroid;
- shape: best IoU of the foreground against a circle, square and triangle fitted to its box.

For a clip: background and colour over all frames, direction from the centroid's travel between
the first and last quarter of the clip, and whether the frames differ at all. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from genserve.demo_models.world import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, Scene

FG_DISTANCE = 60.0
MIN_FG_PIXELS = 4
MIN_TRAVEL = 0.2  # of the frame size, for a clip to count as moving


def _nearest(rgb: np.ndarray, palette: dict[str, tuple[int, int, int]]) -> str:
    names = list(palette)
    d = np.linalg.norm(np.array([palette[n] for n in names], np.float32) - rgb, axis=1)
    return names[int(d.argmin())]


@dataclass
class Reading:
    """What the scorer sees in one picture."""

    background: str
    colour: str | None  # None: no foreground
    position: str | None
    shape: str | None
    centroid: tuple[float, float] | None  # (x, y) in pixels


def _templates(mask: np.ndarray) -> dict[str, np.ndarray]:
    ys, xs = np.nonzero(mask)
    x0, x1, y0, y1 = xs.min(), xs.max() + 1, ys.min(), ys.max() + 1
    h, w = mask.shape
    y, x = np.mgrid[0:h, 0:w] + 0.5
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    rx, ry = (x1 - x0) / 2, (y1 - y0) / 2
    box = (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)
    t = np.clip((y - y0) / max(y1 - y0, 1e-6), 0.0, 1.0)
    return {
        "circle": ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1.0,
        "square": box,
        "triangle": box & (np.abs(x - cx) <= t * rx),
    }


def read_image(image: np.ndarray) -> Reading:
    """`image`: uint8 [H, W, 3]."""
    img = image.astype(np.float32)
    h, w, _ = img.shape
    median = np.median(img.reshape(-1, 3), axis=0)
    background = _nearest(median, BACKGROUNDS)
    dist = np.linalg.norm(img - np.array(BACKGROUNDS[background], np.float32), axis=-1)
    mask = dist > FG_DISTANCE
    if mask.sum() < MIN_FG_PIXELS:
        return Reading(background, None, None, None, None)
    colour = _nearest(img[mask].mean(axis=0), COLOURS)
    ys, xs = np.nonzero(mask)
    cx, cy = float(xs.mean() + 0.5), float(ys.mean() + 0.5)
    col = min(int(cx / (w / 3)), 2)
    row = min(int(cy / (h / 3)), 2)
    position = next(p for p, rc in POSITIONS.items() if rc == (row, col))
    ious = {}
    for name, tmpl in _templates(mask).items():
        ious[name] = (mask & tmpl).sum() / max((mask | tmpl).sum(), 1)
    shape = max(SHAPES, key=lambda s: ious[s])
    return Reading(background, colour, position, shape, (cx, cy))


def score_image(image: np.ndarray, scene: Scene) -> dict[str, bool]:
    """Per-attribute correctness of `image` (uint8 [H, W, 3]) for an image scene."""
    r = read_image(image)
    result = {
        "colour": r.colour == scene.colour,
        "shape": r.shape == scene.shape,
        "background": r.background == scene.background,
        "position": r.position == scene.position,
    }
    result["all"] = all(result.values())
    return result


def score_video(frames: np.ndarray, scene: Scene) -> dict[str, bool]:
    """Per-attribute correctness of `frames` (uint8 [F, H, W, 3]) for a video scene."""
    readings = [read_image(f) for f in frames]
    n = len(frames)
    backgrounds = [r.background for r in readings]
    colours = [r.colour for r in readings if r.colour is not None]
    background = max(set(backgrounds), key=backgrounds.count)
    colour = max(set(colours), key=colours.count) if colours else None
    quarter = max(n // 4, 1)
    head = [r.centroid for r in readings[:quarter] if r.centroid is not None]
    tail = [r.centroid for r in readings[-quarter:] if r.centroid is not None]
    direction_ok = False
    if head and tail:
        start, end = np.mean(head, axis=0), np.mean(tail, axis=0)
        dx, dy = end - start
        want = {"left": (-dx, dy), "right": (dx, dy), "up": (-dy, dx), "down": (dy, dx)}
        along, across = want[scene.direction]
        size = frames.shape[2]
        direction_ok = bool(along >= MIN_TRAVEL * size and along > 2 * abs(across))
    diffs = np.abs(frames[1:].astype(np.int16) - frames[:-1].astype(np.int16))
    moving = bool(n > 1 and diffs.max(initial=0) > FG_DISTANCE)
    result = {
        "colour": colour == scene.colour,
        "background": background == scene.background,
        "direction": direction_ok,
        "frames_differ": moving,
    }
    result["all"] = all(result.values())
    return result


def summarize(scores: list[dict[str, bool]]) -> dict[str, float]:
    """Fraction right per attribute over many scores."""
    if not scores:
        return {}
    return {k: float(np.mean([s[k] for s in scores])) for k in scores[0]}
