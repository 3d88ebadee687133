"""What the real-browser tests share: ``python -m tracer view`` on a free port of 127.0.0.1 (:func:`serve`),
driven by headless Chromium (Debian's /usr/bin/chromium) through Playwright (:func:`open_page`,
:func:`chromium_page`), and the waits and checks every page needs. Screenshots go under
$TRACER_TEST_OUTPUT (set by .ci/run to tests/output/) or tmp_path (:func:`screenshot_dir`).

Without Chromium or the playwright package a browser test is skipped, except under CI (CI set),
where it fails: CI installs both (.ci/run). The tests: tests/test_browser_*.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlsplit
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
START_TIMEOUT_S = 90
UI_TIMEOUT_MS = 60_000


def _browser_or_skip():
    """Playwright's sync API; skip (fail under CI) when it or Chromium is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as err:
        missing = f"the playwright package is not installed ({err})"
    else:
        if CHROMIUM.is_file():
            return sync_playwright
        missing = f"{CHROMIUM} is missing (apt-get install -y chromium)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the browser test, but {missing}; .ci/run installs both")
    pytest.skip(f"real-browser test needs Chromium and playwright: {missing}")


def screenshot_dir(tmp_path: Path) -> Path:
    """Where a browser test saves its screenshots: $TRACER_TEST_OUTPUT/browser (tests/output/ under
    .ci/run), else tmp_path/browser."""
    shots = Path(os.environ.get("TRACER_TEST_OUTPUT") or tmp_path) / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    return shots


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(root: Path, log_path: Path):
    """``python -m tracer view root`` on a free port of 127.0.0.1; yields the URL, stops the server after."""
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "tracer", "view", str(root), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tracer view exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tracer view did not answer in {START_TIMEOUT_S} s")
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the CLI and the streamlit process it started
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def choose(page, label: str, option: str) -> None:
    """Pick the option that starts with ``option`` in the sidebar selectbox labelled ``label``."""
    page.get_by_role("combobox", name=label).click()
    page.get_by_role("option").filter(has_text=option).first.click()


def leaves_localhost(url: str) -> bool:
    """Whether a request goes beyond 127.0.0.1 (data:, blob: and about: URLs stay in the page)."""
    parts = urlsplit(url)
    return parts.scheme not in ("data", "blob", "about") and parts.hostname != "127.0.0.1"


def open_page(pw, dialogs: list[str], outside: list[str] | None = None, height: int = 1200, width: int = 1600):
    """A Chromium page; dialogs are recorded and dismissed, requests beyond 127.0.0.1 recorded in
    ``outside`` (a request listener sees every request the page makes: scripts, fonts, icons)."""
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(UI_TIMEOUT_MS)
    from playwright.sync_api import expect

    # expect()'s own default is 5 s, which a cold first page of the app passes on a quiet machine only
    # (a slow host ran past it): the checks wait as long as the page's actions do
    expect.set_options(timeout=UI_TIMEOUT_MS)
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    if outside is not None:
        page.on("request", lambda request: outside.append(request.url) if leaves_localhost(request.url) else None)
    return browser, page


@contextlib.contextmanager
def chromium_page(sync_playwright, dialogs: list[str], **kwargs):
    """:func:`open_page` in a Playwright session, the browser closed on the way out."""
    with sync_playwright() as pw:
        browser, page = open_page(pw, dialogs, **kwargs)
        try:
            yield page
        finally:
            browser.close()


def check_no_error(page) -> None:
    from playwright.sync_api import expect

    expect(page.locator("[data-stale=true]")).to_have_count(0)
    assert page.locator("[data-testid=stException]").count() == 0
    assert "Traceback" not in page.locator("body").inner_text()


def wait_idle(page) -> None:
    """Until the app has finished running (no status widget, nothing stale)."""
    from playwright.sync_api import expect

    for _ in range(2):  # twice: a rerun may start just after the first wait
        page.wait_for_timeout(500)
        page.wait_for_function("!document.querySelector('[data-testid=stStatusWidget]')")
        expect(page.locator("[data-stale=true]")).to_have_count(0)
