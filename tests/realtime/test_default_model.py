"""Which model a realtime session without `model` runs: a streaming model when one is served
(one continuous video), else the first text-to-video model, else a text-to-image one."""

from __future__ import annotations

import dataclasses

from genserve.entrypoints.realtime.protocol import StartMessage
from genserve.entrypoints.realtime.settings import resolve_settings
from genserve.multimodal_gen.messages import TEXT_TO_IMAGE, ModelSpec
from tests.realtime.fake_diffusion import FAKE_VIDEO, FakeDiffusionClient

STREAMING = dataclasses.replace(FAKE_VIDEO, name="fake-stream", family="helios", streaming=True,
                                frame_rule="5k+0", default_num_frames=5)
IMAGE = dataclasses.replace(FAKE_VIDEO, name="fake-image", task=TEXT_TO_IMAGE,
                            default_num_frames=1, max_num_frames=1, frame_rule="1")


class _Served(FakeDiffusionClient):
    def __init__(self, specs: list[ModelSpec]) -> None:
        super().__init__()
        self._specs = specs

    def specs(self) -> list[ModelSpec]:
        return self._specs


def _picked(specs: list[ModelSpec]) -> str:
    return resolve_settings(_Served(specs), StartMessage(type="start", prompt="a cat")).model


def test_a_streaming_model_comes_first():
    assert _picked([IMAGE, FAKE_VIDEO, STREAMING]) == "fake-stream"
    assert _picked([IMAGE, FAKE_VIDEO]) == "fake-video"
    assert _picked([IMAGE]) == "fake-image"
    # A named model is taken as named.
    named = resolve_settings(_Served([FAKE_VIDEO, STREAMING]),
                             StartMessage(type="start", prompt="a cat", model="fake-video"))
    assert named.model == "fake-video"
