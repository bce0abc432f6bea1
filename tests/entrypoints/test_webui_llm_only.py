"""The web UI on an LLM-only server (`genserve serve --no-diffusion`, the embedded SmolLM2):
`/` serves the page, which opens on the chat panel alone (no realtime controls, no socket) and
answers a question through /v1/chat/completions, in headless Chromium."""

from __future__ import annotations

import httpx
import pytest
from playwright import sync_api

from tests.realtime.browser import launch_chromium

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def server(server_url: str) -> str:
    return server_url  # the session's SmolLM2-only server (tests/conftest.py)


def test_the_page_and_its_files_are_served(server):
    page = httpx.get(server + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="chat-panel"' in page.text
    for name in ("app.js", "chat.js", "styles.css"):
        assert httpx.get(f"{server}/ui/{name}").status_code == 200, name
    assert httpx.get(server + "/ui/nothing.js").status_code == 404


def test_the_page_opens_on_the_chat_panel(server):
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page()
            page.goto(server + "/")
            page.wait_for_function("document.body.dataset.panel === 'chat'", timeout=20_000)
            assert page.is_visible("#chat-panel") and page.is_hidden("#controls")
            assert page.is_hidden("#viewer") and page.is_hidden("#gallery-panel")
            assert page.text_content("#connection") == "chat only"
            assert page.evaluate("window.genserveRealtime.state.ws") is None
            page.wait_for_function(
                "document.getElementById('chat-model').value !== ''", timeout=20_000)
            page.fill("#chat-max-tokens", "12")
            page.fill("#chat-input", "What is the capital of France?")
            page.click("#chat-send")
            page.wait_for_function("window.genserveChat.stats.answers.length === 1",
                                   timeout=60_000)
            assert "Paris" in page.evaluate("window.genserveChat.stats.answers[0]")
            assert page.is_hidden("#chat-error")
        finally:
            browser.close()
