"""Headless Chromium for the web UI tests: Debian's `chromium`, never a downloaded build."""

from __future__ import annotations

import shutil

from tests.needs import missing

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def launch_chromium(playwright):
    """A headless Chromium browser. Without chromium the test is skipped, or fails in CI."""
    chromium = shutil.which("chromium")
    if chromium is None:
        missing("Debian's chromium (apt-get install chromium)")
    return playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)


def open_ui(browser, base: str, model: str):
    """The web UI at `base` in a new 1100x800 page, connected, with `model` among its models;
    returns the page and the list its uncaught page errors are appended to."""
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(base + "/")
    page.wait_for_selector("#connection[data-status=open]", timeout=30_000)
    page.wait_for_function(
        f"document.querySelector('#model option[value=\"{model}\"]') !== null",
        timeout=30_000)
    return page, errors
