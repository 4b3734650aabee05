"""A headless chromium for the page's tests and screenshots: the system's browser (Debian's ``chromium``)
driven by playwright, with the flags that keep it from reaching for a network it does not have."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium_path() -> Path | None:
    """The system's chromium (Debian's /usr/bin/chromium, else one on PATH), or None when it is not installed."""
    debian = Path("/usr/bin/chromium")
    if debian.is_file():
        return debian
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    return Path(found) if found else None


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@contextmanager
def chromium() -> Iterator[object]:
    """A launched headless chromium (a playwright ``Browser``); each launch gets a fresh profile directory."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(chromium_path()), args=list(CHROMIUM_FLAGS), headless=True
        )
        try:
            yield browser
        finally:
            browser.close()
