"""`genserve generate` for diffusion models, without a server."""

from __future__ import annotations

import argparse

from PIL import Image

from genserve.multimodal_gen.encoding import probe_mp4
from genserve.multimodal_gen.generate_cli import add_arguments, run


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_image_and_video_files(tmp_path, capsys):
    png = tmp_path / "cat.png"
    assert run(parse("--model", "tiny-flux", "--prompt", "a red cat", "--output", str(png),
                     "--width", "48", "--height", "32", "--num-inference-steps", "2")) == 0
    assert Image.open(png).size == (48, 32)
    mp4 = tmp_path / "bird.mp4"
    assert run(parse("--prompt", "a red circle moving up on a white background", "--output",
                     str(mp4), "--width", "32", "--height", "32", "--num-inference-steps",
                     "2")) == 0
    info = probe_mp4(mp4)
    assert info["num_frames"] == 16 and info["fps"] == 8.0  # shapes-video picked by the .mp4
    err = capsys.readouterr().err
    assert "denoising" in err and "2/2" in err  # the tqdm progress bar


def test_long_video_from_the_streaming_model(tmp_path, capsys):
    """A video longer than shapes-video's 16 frames goes to the default streaming model,
    shapes-stream, which makes it chunk by chunk in one call, upscaled from its 32x32 frames;
    the MP4 decodes to every frame at the model's 24 fps."""
    mp4 = tmp_path / "long.mp4"
    assert run(parse("--prompt", "a yellow square moving left on a gray background",
                     "--output", str(mp4), "--num-frames", "27", "--width", "64",
                     "--height", "64", "--seed", "2")) == 0
    assert "shapes-stream" in capsys.readouterr().err
    info = probe_mp4(mp4)
    assert info["num_frames"] == 27 and info["fps"] == 24.0
    assert (info["width"], info["height"]) == (64, 64)


def test_mismatched_output_and_bad_input(tmp_path, capsys):
    assert run(parse("--model", "tiny-flux", "--prompt", "x", "--output",
                     str(tmp_path / "x.mp4"))) == 2
    assert "makes an image" in capsys.readouterr().err
    assert run(parse("--model", "tiny-wan", "--prompt", "x", "--output", str(tmp_path / "x.mp4"),
                     "--num-frames", "6")) == 2
    assert "4k+1" in capsys.readouterr().err
