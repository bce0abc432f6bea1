"""Headless Chromium for the web UI tests: Debian's `chromium`, never a downloaded build."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def launch_chromium(playwright):
    """A headless Chromium browser; skips the test when chromium is not installed."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    return playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
