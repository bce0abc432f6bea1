"""A missing Chromium skips the browser tests on a developer's machine and fails them in CI."""

from __future__ import annotations

import pytest

from tests.realtime import browser


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception),
                                         ("", pytest.skip.Exception)])
def test_missing_chromium_fails_in_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(browser.shutil, "which", lambda name: None)
    with pytest.raises(outcome, match="chromium"):
        browser.launch_chromium(playwright=None)


def test_chromium_is_there_in_ci():
    """CI installs Debian's chromium (.ci/run); a machine without it runs no browser test."""
    if browser.shutil.which("chromium") is None:
        browser.missing("Debian's chromium (apt-get install chromium)")
