"""What `shapes-vl` is taught: pictures of the shapes world, questions about them and their
answers, and the perturbations that make it cope with pictures unlike its clean renders.

A picture is a `world.render_image` scene drawn at 32 to 128 px, then (each with some chance)
colour-jittered and noised, blurred, stored as a JPEG and resized to 32 to 256 px, as pasted
pictures and the upscaled outputs of `shapes-image` are. Questions come in five kinds; the
answer to "describe" is the world's own grammar sentence, the others one or two words.
Pure numpy and PIL: no torch.
"""

from __future__ import annotations

import io
import random

import numpy as np

from genserve.demo_models import world

QUESTIONS: dict[str, tuple[str, ...]] = {
    "describe": (
        "Describe the image.",
        "Describe this image.",
        "Describe the picture.",
        "Describe this picture.",
        "What is in the image?",
        "What is in this picture?",
        "What do you see?",
        "Describe it.",
        "Caption this image.",
        "Describe the image in one sentence.",
        "What is this?",
        "",
    ),
    "colour": (
        "What colour is the shape?",
        "What color is the shape?",
        "What colour is it?",
        "What color is it?",
        "Which colour is the shape?",
        "What is the colour of the shape?",
    ),
    "shape": (
        "What shape is it?",
        "What shape is this?",
        "Which shape is it?",
        "What is the shape?",
        "What kind of shape is it?",
        "What shape is in the image?",
    ),
    "position": (
        "Where is the shape?",
        "Where is it?",
        "Where is the shape in the image?",
        "Where is the shape placed?",
        "Where is the shape in the picture?",
    ),
    "background": (
        "What colour is the background?",
        "What color is the background?",
        "Which colour is the background?",
        "What is the colour of the background?",
        "What is the background colour?",
    ),
}
# Share of each kind in training: the sentence carries all four attributes; the shape (the
# last attribute the model picks up) gets its own question more often.
KIND_WEIGHTS = {
    "describe": 0.4,
    "colour": 0.1,
    "shape": 0.3,
    "position": 0.1,
    "background": 0.1,
}


def answer(scene: world.Scene, kind: str) -> str:
    if kind == "describe":
        return scene.prompt()
    return {
        "colour": scene.colour,
        "shape": scene.shape,
        "position": scene.position,
        "background": scene.background,
    }[kind]


def messages(question: str, image_first: bool = True) -> list[dict]:
    """One user turn with an image part and the question, in the OpenAI content shape the
    chat template renders."""
    parts: list[dict] = [{"type": "image"}]
    if question:
        parts.insert(len(parts) if image_first else 0, {"type": "text", "text": question})
    return [{"role": "user", "content": parts}]


def perturbed_image(scene: world.Scene, rng: np.random.Generator, strength: float = 1.0):
    """A PIL picture of `scene` a little unlike a clean render (strength 0 = a clean 32 px
    render with the world's usual jitter)."""
    from PIL import Image, ImageFilter

    size = int(rng.integers(32, 129)) if rng.random() < 0.5 * strength else world.SIZE
    supersample = 4 if size <= 64 else 2
    r = size * 0.15
    cx, cy = world.cell_centre(scene.position, size)
    r *= rng.uniform(0.8, 1.15)
    jitter = 1.0 + strength  # pixels at 32 px
    cx += rng.uniform(-jitter, jitter) * size / 32
    cy += rng.uniform(-jitter, jitter) * size / 32
    cx = float(np.clip(cx, r + 0.5, size - r - 0.5))
    cy = float(np.clip(cy, r + 0.5, size - r - 0.5))
    mask = world._shape_mask(scene.shape, cx, cy, r, size, supersample)
    arr = world._compose(mask, scene.colour, scene.background).astype(np.float32)
    if rng.random() < 0.5 * strength:  # colour jitter: gain and offset per channel, noise
        arr = arr * rng.uniform(0.93, 1.07, 3) + rng.uniform(-8, 8, 3)
        arr += rng.normal(0, rng.uniform(0, 4), arr.shape)
    img = Image.fromarray(np.clip(np.round(arr), 0, 255).astype(np.uint8))
    if rng.random() < 0.25 * strength:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 0.8) * size / 32))
    if rng.random() < 0.5 * strength:
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=int(rng.integers(30, 96)))
        img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    if rng.random() < 0.4 * strength:
        out = int(rng.integers(32, 257))
        resample = [Image.NEAREST, Image.BILINEAR, Image.BICUBIC][int(rng.integers(3))]
        img = img.resize((out, out), resample)
    return img


def sample(
    scenes: list[world.Scene], rng: random.Random, nrng: np.random.Generator, strength: float = 1.0
) -> tuple[object, list[dict], str, world.Scene]:
    """(picture, chat messages, answer, scene) for one random scene and question."""
    scene = scenes[rng.randrange(len(scenes))]
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    question = rng.choice(QUESTIONS[kind])
    if question and rng.random() < 0.3:
        question = question.lower() if rng.random() < 0.5 else question.rstrip("?.")
    if question and rng.random() < 0.3:
        question = " " + question  # a text part after the image often starts with a space
    image = perturbed_image(scene, nrng, strength)
    return image, messages(question, image_first=rng.random() < 0.6), answer(scene, kind), scene


def parse_answer(kind: str, text: str) -> str | None:
    """The attribute an answer names (None when it names none)."""
    text = " ".join(text.lower().replace(".", " ").split())
    choices = {
        "colour": world.COLOURS,
        "shape": world.SHAPES,
        "position": world.POSITIONS,
        "background": world.BACKGROUNDS,
    }[kind]
    return text if text in choices else None
