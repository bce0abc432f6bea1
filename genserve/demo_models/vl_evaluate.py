"""Evaluate `shapes-vl` through genserve's runtime on scenes it never saw in training.

    python -m genserve.demo_models.vl_evaluate                  # the committed weights
    python -m genserve.demo_models.vl_evaluate --closed-loop    # and shapes-image -> shapes-vl
    python -m genserve.demo_models.vl_evaluate --json out.json

Held-out accuracy: the 60 scenes of `world.held_out` drawn as perturbed pictures
(`vl_data.perturbed_image`: other sizes, JPEG, blur, colour jitter), each described (the
sentence is parsed with the world's grammar) and asked the four short questions. Closed loop:
`shapes-image` draws each held-out prompt (its serving defaults, upscaled to 128 px as a person
would see it) and `shapes-vl` describes the picture; a prompt counts when all four attributes
of the description match it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from genserve.demo_models import vl_data, world
from genserve.demo_models.vl_model import WEIGHTS_PATH
from genserve.multimodal_gen.encoding import encode_image

ATTRIBUTES = ("colour", "shape", "background", "position")
GREEDY = {"max_new_tokens": 24, "temperature": 0}


def png(image) -> bytes:
    """A PNG file of a picture (uint8 array or PIL image)."""
    return encode_image(np.asarray(image), "png")


def held_out_pictures(
    count: int = 60, seed: int = 0, strength: float = 1.0
) -> tuple[list[world.Scene], list[bytes]]:
    """The first `count` held-out scenes as PNG files of perturbed pictures (seeded)."""
    rng = np.random.default_rng(seed)
    scenes = world.held_out(False)[:count]
    return scenes, [png(vl_data.perturbed_image(s, rng, strength)) for s in scenes]


def load_engine(path: str | Path = WEIGHTS_PATH):
    from genserve.srt.engine import Engine

    return Engine(str(path), dtype="float32", max_total_tokens=8192)


def ask(engine, images: list[bytes], question: str) -> list[str]:
    """The model's answer to `question` about each image (greedy, batched)."""
    text = engine.tokenizer.apply_chat_template(
        vl_data.messages(question), tokenize=False, add_generation_prompt=True
    )
    outs = engine.generate([text] * len(images), GREEDY, image_data=[[b] for b in images])
    return [o["text"].strip() for o in outs]


def describe_scores(scenes: list[world.Scene], answers: list[str]) -> dict[str, float]:
    """Share of descriptions whose parsed attribute matches, per attribute and all four."""
    parsed = [world.parse_prompt(a) for a in answers]
    scores = {
        a: float(
            np.mean(
                [p is not None and getattr(p, a) == getattr(s, a) for p, s in zip(parsed, scenes)]
            )
        )
        for a in ATTRIBUTES
    }
    scores["all"] = float(np.mean([p == s for p, s in zip(parsed, scenes)]))
    return scores


def accuracy(engine, scenes: list[world.Scene], images: list[bytes]) -> dict[str, object]:
    """Description scores and the accuracy of each short question."""
    descriptions = ask(engine, images, "Describe the image.")
    questions = {}
    for attr in ATTRIBUTES:
        answers = ask(engine, images, vl_data.QUESTIONS[attr][0])
        questions[attr] = float(
            np.mean(
                [vl_data.parse_answer(attr, a) == getattr(s, attr) for a, s in zip(answers, scenes)]
            )
        )
    wrong = [(s.prompt(), d) for s, d in zip(scenes, descriptions) if world.parse_prompt(d) != s]
    return {
        "describe": describe_scores(scenes, descriptions),
        "questions": questions,
        "wrong_descriptions": wrong,
    }


def closed_loop(engine, count: int = 60, seed: int = 0, size: int = 128) -> dict[str, object]:
    """shapes-image draws each held-out prompt; shapes-vl describes it."""
    from PIL import Image

    from genserve.demo_models.evaluate import generate, load
    from genserve.demo_models.models import DEFAULT_GUIDANCE, DEFAULT_STEPS

    scenes = world.held_out(False)[:count]
    pictures = generate(load("image"), scenes, DEFAULT_STEPS, DEFAULT_GUIDANCE["image"], seed)
    images = [png(Image.fromarray(p).resize((size, size), Image.BILINEAR)) for p in pictures]
    descriptions = ask(engine, images, "Describe the image.")
    wrong = [(s.prompt(), d) for s, d in zip(scenes, descriptions) if world.parse_prompt(d) != s]
    return {"describe": describe_scores(scenes, descriptions), "wrong_descriptions": wrong}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--path", default=str(WEIGHTS_PATH), help="exported shapes-vl folder")
    p.add_argument("--count", type=int, default=60, help="held-out scenes (at most 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clean", action="store_true", help="also score clean 32 px renders")
    p.add_argument("--closed-loop", action="store_true", help="shapes-image -> shapes-vl too")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    engine = load_engine(args.path)
    report: dict[str, object] = {}
    scenes, images = held_out_pictures(args.count, args.seed)
    report["held_out"] = accuracy(engine, scenes, images)
    if args.clean:
        scenes, images = held_out_pictures(args.count, args.seed, strength=0.0)
        report["held_out_clean"] = accuracy(engine, scenes, images)
    if args.closed_loop:
        report["closed_loop"] = closed_loop(engine, args.count, args.seed)
    engine.shutdown()
    for name, part in report.items():
        print(f"{name}: describe " + ", ".join(f"{k} {v:.1%}" for k, v in part["describe"].items()))
        if "questions" in part:
            print("  questions " + ", ".join(f"{k} {v:.1%}" for k, v in part["questions"].items()))
        for want, got in part["wrong_descriptions"][:10]:
            print(f"  wanted {want!r}, got {got!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
