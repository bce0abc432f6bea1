"""Latency of `shapes-vl` describing a picture over HTTP, image to full answer (issue 20).

    python benchmarks/bench_shapes_vl.py            # prints a JSON summary at the end
    python benchmarks/bench_shapes_vl.py --smoke    # 1 picture, 2 at once: checks the script
    python benchmarks/bench_shapes_vl.py --url URL  # a running server is the radix side

A real `genserve serve --model-path <shapes-vl>` (float32, no diffusion) is started twice, with
the radix cache and with --disable-radix-cache (`--url`: a running server that serves shapes-vl
with the radix cache takes the first one's place), and each is sent, through
/v1/chat/completions with a base64 PNG (a held-out scene, 128 px) and "Describe the image.":
 1. batch 1: requests one after another, each with a new picture (nothing cached);
 2. batch 1, the same picture again (its tokens come from the prefix cache);
 3. 16 concurrent requests with a picture not seen yet: the latency of each and the wall time.
Every answer is checked against the scene (all four attributes).
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from genserve.demo_models import vl_evaluate, world  # noqa: E402
from genserve.demo_models.vl_model import WEIGHTS_PATH  # noqa: E402
from tests.serve_process import serve_process  # noqa: E402


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def describe(url: str, png: bytes) -> tuple[float, str]:
    t = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "shapes-vl",
            "temperature": 0,
            "max_tokens": 32,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(png)}},
                        {"type": "text", "text": "Describe the image."},
                    ],
                }
            ],
        },
    )
    r.raise_for_status()
    return time.perf_counter() - t, r.json()["choices"][0]["message"]["content"]


def ms(xs: list[float]) -> dict[str, float]:
    return {"median_ms": round(1000 * statistics.median(xs), 1), "max_ms": round(1000 * max(xs), 1)}


def run(flags: list[str], scenes: list[world.Scene], pictures: list[bytes],
        batch1: int = 8, burst_size: int = 16, url: str | None = None) -> dict:
    """The three parts on a server started with `flags`, or on the running server `url`."""
    server = (contextlib.nullcontext(url) if url
              else serve_process("--model-path", str(WEIGHTS_PATH), *flags))
    with server as url:
        describe(url, pictures[9])  # warm-up (not one of the measured pictures)
        fresh = [describe(url, p) for p in pictures[:batch1]]
        again = [describe(url, pictures[0]) for _ in range(batch1)]
        with concurrent.futures.ThreadPoolExecutor(burst_size) as pool:  # a new picture
            t = time.perf_counter()
            burst = list(pool.map(lambda _: describe(url, pictures[8]), range(burst_size)))
            wall = time.perf_counter() - t
    right = [world.parse_prompt(a) == s for (_, a), s in zip(fresh, scenes)]
    right += [world.parse_prompt(a) == scenes[0] for _, a in again]
    right += [world.parse_prompt(a) == scenes[8] for _, a in burst]
    return {
        "batch1_new_picture": ms([s for s, _ in fresh]),
        "batch1_same_picture": ms([s for s, _ in again]),
        f"concurrent{burst_size}_same_picture": {
            **ms([s for s, _ in burst]),
            "wall_ms": round(1000 * wall, 1),
        },
        "answers_right": f"{sum(right)}/{len(right)}",
    }


def main() -> None:
    import argparse

    from PIL import Image

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="1 picture at batch 1 and 2 at once on each server: checks the script")
    ap.add_argument("--url", default=None,
                    help="a running server (shapes-vl, radix cache) as the radix-cache side")
    args = ap.parse_args()
    sizes = (1, 2) if args.smoke else (8, 16)

    scenes, pictures = vl_evaluate.held_out_pictures(10, seed=3, strength=0.0)
    big = [
        vl_evaluate.png(Image.open(io.BytesIO(p)).resize((128, 128), Image.BICUBIC))
        for p in pictures
    ]  # 128 px, as a pasted picture would be
    summary = {
        "radix_cache": run([], scenes, big, *sizes, url=args.url),
        "no_radix_cache": run(["--disable-radix-cache"], scenes, big, *sizes),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
