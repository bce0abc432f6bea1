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
