"""``streamlit run app/server.py -- --root DIR`` (the app as Streamlit's ASGI ``st.App``, whose
start-up imports the first page's modules while the browser loads) serves the same app as
``streamlit run app/streamlit_app.py``: Streamlit's own discovery takes the file for an ASGI app,
the start-up thread loads pandas' Styler, pyarrow and Plotly (not torch, not the checks), and in
headless Chromium the Tokens page of a toy run shows its step, its sequence and its token table,
a step change included, with no request beyond 127.0.0.1.

Without Chromium or the playwright package the browser test is skipped, except under CI (CI set),
where it fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.fixtures.browser import check_no_error, choose, open_page
from tests.fixtures.ports import free_port
from tests.fixtures.toy_traces import REPO, ToyTokenizer, write_trace

SERVER = REPO / "app" / "server.py"


def test_streamlit_takes_the_file_for_an_asgi_app_serving_the_entry_script():
    from streamlit.web.server.app_discovery import discover_asgi_app

    found = discover_asgi_app(SERVER)
    assert found.is_asgi_app and found.import_string == "server:app"


def test_start_up_imports_load_the_first_page_modules_not_torch():
    code = ("import json, sys; sys.path.insert(0, 'app'); import server; server.import_first_page_modules(); "
            "print(json.dumps({m: m in sys.modules for m in ('pandas.io.formats.style', 'pyarrow', "
            "'plotly.graph_objects', 'app.components.figures', 'torch', 'tracer.checks')}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == {"pandas.io.formats.style": True, "pyarrow": True, "plotly.graph_objects": True,
                      "app.components.figures": True, "torch": False, "tracer.checks": False}


def test_tokens_page_through_the_asgi_entry_in_chromium(sync_playwright, tmp_path):
    from playwright.sync_api import expect

    write_trace(tmp_path / "root" / "toy-run", tokenizer=ToyTokenizer(), steps=2)
    port = free_port()
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115  (closed in the finally below, after the server)
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(SERVER), "--server.headless", "true",
                             "--server.address", "127.0.0.1", "--server.port", str(port),
                             "--browser.gatherUsageStats", "false", "--", "--root", str(tmp_path / "root")],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url, outside, dialogs = f"http://127.0.0.1:{port}", [], []
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, Path(tmp_path / "server.log").read_text()
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "no answer in 90 s"
                time.sleep(0.2)
        with sync_playwright() as pw:
            browser, page = open_page(pw, dialogs, outside)
            try:
                page.goto(f"{url}/tokens?run=toy-run&step=0&seq=1")
                main = page.locator("[data-testid=stMain]")
                expect(main).to_contain_text("step 0 · inner 0 · mb 0 · rank 0 · sequence 1")
                expect(main.locator("[data-testid=stDataFrame]").first).to_be_visible()
                choose(page, "Step file", "step 1 · inner 0 · mb 0 · rank 0")
                expect(main).to_contain_text("step 1 · inner 0 · mb 0 · rank 0 · sequence 1")
                check_no_error(page)
            finally:
                browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    assert outside == [] and dialogs == []
