"""The web UI in headless Chromium against a fake engine: error display, and reconnecting
after the server restarts (same port, new process state)."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest
from playwright import sync_api

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from tests.realtime.browser import launch_chromium
from tests.realtime.fake_diffusion import FakeDiffusionClient
from tests.realtime.server import serve

pytestmark = pytest.mark.timeout(180)


def test_web_ui_shows_errors_and_reconnects_after_a_server_restart():
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page()
            app = create_app(GatewayConfig(), [], FakeDiffusionClient())
            with serve(app) as base:
                port = urlparse(base).port
                page.goto(base + "/")
                page.wait_for_selector("#connection[data-status=open]", timeout=20_000)
                page.wait_for_function("document.getElementById('model').value === 'fake-video'")
                # A size the model cannot take: the server's message is shown, and the page
                # is ready for the next try.
                page.fill("#width", "70")
                page.click("#start")
                page.wait_for_selector("#error:not([hidden])", timeout=10_000)
                assert "multiple of 16" in page.text_content("#error")
                page.wait_for_function("!document.getElementById('start').disabled")
            # Server gone: the page says so and keeps retrying.
            page.wait_for_selector("#connection[data-status=closed]", timeout=10_000)
            fake = FakeDiffusionClient()
            app = create_app(GatewayConfig(), [], fake)
            with serve(app, port=port):
                page.wait_for_selector("#connection[data-status=open]", timeout=20_000)
                page.fill("#width", "64")
                page.click("#start")
                page.wait_for_function(
                    "document.body.dataset.state === 'done' && "
                    "window.genserveRealtime.stats.finalsDrawn === 5", timeout=30_000)
                assert page.is_hidden("#error")  # a new start clears the old error

                # Continuous mode: chunks keep coming; a new prompt applies from the next
                # chunk; stop ends it.
                page.check("#continuous")
                page.fill("#prompt", "a blue bird")
                page.click("#start")
                page.wait_for_function("window.genserveRealtime.stats.chunksDone >= 1",
                                       timeout=30_000)
                page.fill("#prompt", "a green tree")
                page.click("#send-prompt")
                page.wait_for_function("window.genserveRealtime.stats.chunksDone >= 3",
                                       timeout=30_000)
                page.click("#stop")
                page.wait_for_function("document.body.dataset.state === 'stopped'",
                                       timeout=10_000)
                assert page.is_hidden("#error")
        finally:
            browser.close()
    prompts = [r.prompt for r in fake.requests]
    default_prompt = "a red circle moving right on a white background"
    assert prompts[:2] == [default_prompt, "a blue bird"], prompts
    assert "a green tree" in prompts[3:], prompts
