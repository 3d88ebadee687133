"""The web UI in a real browser: ``python -m tracer view`` on a free port of 127.0.0.1, driven by
headless Chromium (Debian's /usr/bin/chromium) through Playwright.

Picks a step and a sequence in the sidebar, reads the token table through the data grid's
accessible DOM (glide-data-grid draws on a canvas and mirrors the visible cells into a
``role=grid`` table), checks masked positions are marked, and that tokens ``<script>alert(1)</script>``
and ``<b>`` show as literal text: no dialog opens, no element is injected. Saves screenshots under
$TRACER_TEST_OUTPUT (set by .ci/run to tests/output/) or tmp_path.

Without Chromium or the playwright package the test is skipped, except under CI (CI set), where
it fails: CI installs both (.ci/run).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests import toy_traces
from tracer import TraceWriter

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SCRIPT = "<script>alert(1)</script>"
VOCAB = ["<pad>", "<eos>", "Hello", " world", SCRIPT, "<b>", " yes", " no", "=", "4"]
PAD, EOS = 0, 1
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


def ToyTokenizer():  # noqa: N802  (the shared toy tokenizer, over this file's vocabulary)
    return toy_traces.ToyTokenizer(VOCAB)


def step_tensors(step: int) -> dict[str, torch.Tensor]:
    """GRPO, B = 4, L = 3, T = 5. Row 0: ``4 <script>… <eos>`` then 2 after EOS; row 2:
    ``yes <b> <eos>`` then 2 after EOS; row 1 and 3 end in padding."""
    prompt_ids = torch.tensor([[PAD, 2, 3], [PAD, 2, 3], [2, 3, 8], [2, 3, 8]])  # (B, L)
    completion_ids = torch.tensor([[9, 4, EOS, PAD, PAD], [7, 8, PAD, PAD, PAD],
                                   [6, 5, EOS, PAD, PAD], [7, 9, 5, EOS, PAD]])  # (B, T)
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]],
                                   dtype=torch.bool)
    policy = -0.1 * (torch.arange(20, dtype=torch.float32).reshape(4, 5) + 1) - step  # (B, T) nats
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_ids != PAD, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "policy_logprobs": policy, "old_logprobs": policy.clone(),
            "rewards": rewards, "advantages": torch.tensor([1.0, -1.0, 1.0, -1.0]),
            "group_ids": torch.tensor([0, 0, 1, 1])}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_toy_trace(path: Path) -> None:
    with TraceWriter(path, "grpo", tokenizer=ToyTokenizer(), hyperparameters={"num_generations": 2}) as writer:
        for step in range(2):
            writer.record(step, step_tensors(step))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``python -m tracer view`` on a root holding a trace of 2 steps (``toy-run``) and a copy of
    the corrupt corpus trace (``mixed``); a trace lies outside the root (``outside``). Yields the
    URL; stops the server after."""
    tmp_path = tmp_path_factory.mktemp("view")
    root = tmp_path / "traces"
    write_toy_trace(root / "toy-run")
    write_toy_trace(tmp_path / "outside")
    shutil.copytree(Path(__file__).parent / "data" / "bad_traces" / "mixed", root / "mixed")
    yield from serve(root, tmp_path / "server.log")


@pytest.fixture(scope="module")
def samples_server(tmp_path_factory):
    """``python -m tracer view sample_traces``, what ``make app`` opens. Yields the URL."""
    yield from serve(toy_traces.SAMPLES, tmp_path_factory.mktemp("samples") / "server.log")


def serve(root: Path, log_path: Path):
    """Run ``python -m tracer view ROOT`` on a free port until the generator is closed; yields the URL."""
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


def token_grid(page):
    """The token table's accessible DOM (the grid holding a ``token text`` column)."""
    return page.locator("[data-testid=stDataFrame]").filter(
        has=page.locator("th", has_text="token text")).last.locator("table[role=grid]")


def grid_rows(page) -> list[dict[str, str]]:
    """The token table's visible rows, ``{column header: cell text}``, from its accessible DOM."""
    grid = token_grid(page)
    headers = grid.locator("thead th").all_inner_texts()
    return [dict(zip(headers, row.locator("td").all_inner_texts())) for row in grid.locator("tbody tr").all()]


@pytest.fixture(scope="module")
def sync_playwright():
    """Playwright's entry point; skip (fail under CI) before the server starts when the browser is missing."""
    return _browser_or_skip()


def open_page(pw, dialogs: list[str]):
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1600, "height": 1200})
    page.set_default_timeout(UI_TIMEOUT_MS)
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    return browser, page


def test_tokens_page_in_chromium(sync_playwright, server, tmp_path):
    from playwright.sync_api import expect

    shots = Path(os.environ.get("TRACER_TEST_OUTPUT") or tmp_path) / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    dialogs: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, dialogs)
        try:
            page.goto(f"{server}/?run=toy-run")
            expect(page.get_by_role("heading", name="Tokens")).to_be_visible()

            main = page.locator("[data-testid=stMain]")
            choose(page, "Step file", "step 1 · inner 0 · mb 0 · rank 0")
            expect(main).to_contain_text("step 1 · inner 0 · mb 0 · rank 0 · sequence 0")
            choose(page, "Sequence", "seq 0")
            check_sequence(page, main, SCRIPT, "4" + SCRIPT + "<eos>", -1.1)  # step 1, row 0: -0.1 - 1
            page.screenshot(path=str(shots / "tokens_step1_seq0.png"), full_page=True)

            choose(page, "Sequence", "seq 2")
            expect(main).to_contain_text("step 1 · inner 0 · mb 0 · rank 0 · sequence 2")
            check_sequence(page, main, "<b>", " yes<b><eos>", -2.1)  # step 1, row 2: -0.1 * 11 - 1
            page.screenshot(path=str(shots / "tokens_step1_seq2.png"), full_page=True)
        finally:
            browser.close()
    assert dialogs == [], f"a token ran as script: {dialogs}"
    assert (shots / "tokens_step1_seq2.png").stat().st_size > 10_000


def check_sequence(page, main, token: str, completion_text: str, first_policy: float) -> None:
    """The completion shows ``token`` literally, in the code block and in the token table, which
    marks masked positions (after_eos) apart from kept ones; the first completion token's
    policy logprob is ``first_policy`` (the table is that of the chosen step and sequence)."""
    from playwright.sync_api import expect

    code = main.locator("[data-testid=stCode]").last
    expect(code).to_contain_text(completion_text)
    expect(token_grid(page)).to_contain_text(token)  # the grid is redrawn after the rerun
    expect(page.locator("[data-stale=true]")).to_have_count(0)
    assert code.locator("script, b").count() == 0  # text, not markup
    check_no_error(page)
    assert page.locator("script", has_text="alert(1)").count() == 0
    expect(main.locator("[data-testid=stText]").filter(has_text="kept: 3")).to_contain_text("after_eos: 2")
    rows = grid_rows(page)
    completion = [r for r in rows if r.get("section") == "completion"]
    assert [r["mask_reason"] for r in completion] == ["kept", "kept", "kept", "after_eos", "after_eos"], rows
    assert completion[1]["token text"] == token
    assert float(completion[0]["policy_logprobs"]) == pytest.approx(first_policy, abs=1e-5)  # float32 as stored
    assert [r["mask_reason"] for r in rows if r.get("section") == "prompt"][:1] in (["prompt"], ["prompt_padding"])


def test_a_missing_browser_skips_locally_and_fails_under_ci(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "CHROMIUM", Path("/nonexistent/chromium"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs Chromium and playwright: /nonexistent/chromium is missing"):
        _browser_or_skip()
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI must run the browser test"):
        _browser_or_skip()


def test_hostile_root_in_chromium(sync_playwright, server, tmp_path):
    """A URL naming a run outside the root is refused; in a trace with corrupt step files the
    readable steps are served and a bad one is named with the reason; nothing raises."""
    from playwright.sync_api import expect

    shots = Path(os.environ.get("TRACER_TEST_OUTPUT") or tmp_path) / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    dialogs: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, dialogs)
        try:
            page.goto(f"{server}/?run=../outside")
            expect(page.locator("[data-testid=stMain]")).to_contain_text("refused to open '../outside'")
            assert "outside" not in page.get_by_role("combobox", name="Run").input_value()
            page.screenshot(path=str(shots / "refused_outside_root.png"), full_page=True)

            page.goto(f"{server}/?run=mixed")
            expect(page.locator("[data-testid=stSidebar]")).to_contain_text("running · 7 step files")
            choose(page, "Step file", "step 30 · inner 0")  # a good step after 13 unreadable ones
            check_no_error(page)
            expect(page.locator("[data-testid=stMain]")).to_contain_text("step 30 · inner 0 · mb 0 · rank 0")
            choose(page, "Step file", "step 17 · inner 0")  # header fine, mask data 0.5
            expect(page.locator("[data-testid=stMain]")).to_contain_text(
                "step_00000017.inner_0.mb_0.rank_0.safetensors: field 'completion_mask' is a mask but holds [0.5]")
            page.screenshot(path=str(shots / "corrupt_step_named.png"), full_page=True)
            assert page.locator("[data-testid=stException]").count() == 0
        finally:
            browser.close()
    assert dialogs == []


def check_no_error(page) -> None:
    from playwright.sync_api import expect

    expect(page.locator("[data-stale=true]")).to_have_count(0)
    assert page.locator("[data-testid=stException]").count() == 0
    assert "Traceback" not in page.locator("body").inner_text()


def test_diff_page_on_the_bundled_pair_in_chromium(sync_playwright, samples_server, tmp_path):
    """``make app``'s Diff page opens on the bundled pair (the GRPO loop and the same loop with the
    scorer clipped at 2), names ``rewards`` as the cause, and takes fields and tolerances."""
    from playwright.sync_api import expect

    from tracer import Trace
    from tracer.demo.diff_pair import BASELINE, VARIANT

    a, b = Trace(toy_traces.SAMPLES / BASELINE), Trace(toy_traces.SAMPLES / VARIANT)
    max_reward_change = max(float((b.load_step(kb)["rewards"] - a.load_step(ka)["rewards"]).abs().max())
                            for ka, kb in zip(a.steps(), b.steps()))
    shots = Path(os.environ.get("TRACER_TEST_OUTPUT") or tmp_path) / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    dialogs: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, dialogs)
        try:
            page.goto(f"{samples_server}/diff")
            main = page.locator("[data-testid=stMain]")
            expect(page.get_by_role("heading", name="Diff")).to_be_visible(timeout=UI_TIMEOUT_MS)
            expect(main.locator("[data-testid=stText]").filter(has_text="first divergence: rewards at step 0")
                   ).to_be_visible(timeout=UI_TIMEOUT_MS)
            check_no_error(page)
            assert BASELINE in page.get_by_role("combobox", name="a: reference").input_value()
            assert VARIANT in page.get_by_role("combobox", name="b: candidate").input_value()
            expect(main).to_contain_text("follows from rewards: reward_components, advantages")
            page.screenshot(path=str(shots / "diff_bundled_pair.png"), full_page=True)

            page.get_by_role("combobox", name="Compare only these fields").click()
            page.keyboard.type("rewards")  # the option list is virtualised: filter it first
            page.get_by_role("option", name="rewards", exact=True).click()
            page.keyboard.press("Escape")
            atol = page.get_by_role("textbox", name="atol")
            atol.fill(f"rewards={max_reward_change}")
            atol.press("Enter")
            expect(main).to_contain_text("equal within tolerance", timeout=UI_TIMEOUT_MS)
            expect(main.locator("[data-testid=stCode]").first).to_contain_text(
                f"--fields rewards --atol rewards={max_reward_change}")
            check_no_error(page)
            page.screenshot(path=str(shots / "diff_bundled_pair_rewards_within_tolerance.png"), full_page=True)
        finally:
            browser.close()
    assert dialogs == []
