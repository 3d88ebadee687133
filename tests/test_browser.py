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

import contextlib
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import parse_qs, urlsplit
from pathlib import Path

import pytest
import torch

from tests import toy_traces
from tracer import TraceWriter

CHROMIUM = Path("/usr/bin/chromium")
SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
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


def write_toy_trace(path: Path) -> None:
    with TraceWriter(path, "grpo", tokenizer=ToyTokenizer(), hyperparameters={"num_generations": 2}) as writer:
        for step in range(2):
            writer.record(step, step_tensors(step))


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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The app on a root holding a trace of 2 steps (``toy-run``) and a copy of the corrupt corpus
    trace (``mixed``); a trace lies outside the root (``outside``). Yields the URL."""
    tmp_path = tmp_path_factory.mktemp("view")
    root = tmp_path / "traces"
    write_toy_trace(root / "toy-run")
    write_toy_trace(tmp_path / "outside")
    shutil.copytree(Path(__file__).parent / "data" / "bad_traces" / "mixed", root / "mixed")
    with serve(root, tmp_path / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def samples_server(tmp_path_factory):
    """The app on the bundled sample traces (``sample_traces/``). Yields the URL."""
    if not (SAMPLES / "grpo-tiny").is_dir():
        pytest.skip("sample_traces/ is not in this checkout")
    with serve(SAMPLES, tmp_path_factory.mktemp("samples") / "server.log") as url:
        yield url


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


def test_tokens_page_in_chromium(sync_playwright, server, tmp_path):
    from playwright.sync_api import expect

    shots = screenshot_dir(tmp_path)
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
    """The completion shows ``token`` literally, as coloured text and in the token table, which
    marks masked positions (after_eos) apart from kept ones; the first completion token's
    policy logprob is ``first_policy`` (the table is that of the chosen step and sequence)."""
    from playwright.sync_api import expect

    coloured = main.locator("[data-testid=stHtml]").first
    expect(coloured).to_contain_text(completion_text)
    expect(token_grid(page)).to_contain_text(token)  # the grid is redrawn after the rerun
    expect(page.locator("[data-stale=true]")).to_have_count(0)
    assert coloured.locator("script, b").count() == 0  # text, not markup
    assert coloured.locator("span[title]").count() >= 3  # one span per token, hover text in title
    check_no_error(page)
    assert page.locator("script", has_text="alert(1)").count() == 0
    expect(main.locator("[data-testid=stText]").filter(has_text="kept: 3")).to_contain_text("after_eos: 2")
    rows = grid_rows(page)  # completion rows only: prompt rows are collapsed
    assert [r["mask_reason"] for r in rows] == ["kept", "kept", "kept", "after_eos", "after_eos"], rows
    assert rows[1]["token text"] == token
    assert float(rows[0]["policy_logprobs"]) == pytest.approx(first_policy, abs=1e-5)  # float32 as stored
    main.get_by_text("Show prompt rows").click()  # then listed after the completion rows
    expect(token_grid(page)).to_contain_text("prompt")
    reasons = [r["mask_reason"] for r in grid_rows(page)]
    assert reasons[:5] == ["kept", "kept", "kept", "after_eos", "after_eos"] and reasons[5] in ("prompt", "prompt_padding")
    main.get_by_text("Show prompt rows").click()
    expect(token_grid(page)).not_to_contain_text("prompt")  # collapsed again


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

    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, dialogs)
        try:
            page.goto(f"{server}/?run=../outside")
            expect(page.locator("[data-testid=stMain]")).to_contain_text("refused to open '../outside'")
            assert "outside" not in page.get_by_role("combobox", name="Run").input_value()
            page.screenshot(path=str(shots / "refused_outside_root.png"), full_page=True)

            page.goto(f"{server}/?run=mixed")
            expect(page.locator("[data-testid=stSidebar]")).to_contain_text("unfinished (the writer did not close: crashed or still running) · 7 step files")
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
    shots = screenshot_dir(tmp_path)
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


# Every page by URL on the sample traces: (path and query, heading, text the page must show).
PAGES_BY_URL = (
    ("/tokens?run=grpo-tiny&step=1&inner=0&seq=2", "Tokens", "step 1 · inner 0 · mb 0 · rank 0 · sequence 2"),
    ("/step?run=grpo-tiny&step=1", "Step", "step 1 · inner 0 · 1 step file(s)"),
    ("/groups?run=grpo-tiny&step=1&inner=0&seq=5", "Groups", "step 1 · inner 0 · mb 0 · rank 0"),
    ("/steps?run=grpo-tiny", "Steps", "grpo · 6 step files"),
    ("/health?run=grpo-tiny", "Health", "6 step file(s) checked"),
    ("/overview?run=grpo-tiny", "Run overview", "Fields of the chosen step file"),
    ("/diff?run=grpo-tiny", "Diff", "a: reference"),  # its content is the Diff page's (issue 12)
    ("/ppo?run=ppo-tiny&step=1&inner=1", "PPO: GAE and early stop", "step 1 · epoch 1"),
    ("/dpo?run=dpo-tiny&step=2&seq=1", "DPO pairs", "step 2 · inner 0 · mb 0 · rank 0 · pair 1"),
    ("/steps?run=dpo-tiny", "Steps", "dpo · 3 step files"),
    ("/groups?run=rloo-trl-tiny&step=1", "Groups", "step 1 · inner 1 · mb 0 · rank 0"),  # step 1 has inner 1 only
)


def streamlit_base_path_probe(url: str, page_paths: set[str]) -> bool:
    """Whether a failed request is Streamlit's own base-path discovery: opened at ``/groups``, its
    frontend first tries ``/groups/_stcore/health`` and ``/groups/_stcore/host-config`` (in case the
    app is served under a path prefix; ``getPossibleBaseUris`` in its bundle), then ``/_stcore/...``.
    Those 404 answers come from Streamlit's frontend and server, not from the app."""
    parts = urlsplit(url)
    head, _, tail = parts.path.rpartition("/_stcore/")
    return tail in ("health", "host-config") and head in page_paths


def test_every_page_by_url_on_the_samples(sync_playwright, samples_server, tmp_path):
    """Each page opened by its URL shows what the URL names, makes no request beyond 127.0.0.1
    (scripts, fonts, the tab icon), has no Deploy button (a local debugger: toolbar in viewer
    mode), gets no error answer beyond Streamlit's own base-path probes, and is saved as a
    screenshot."""
    from playwright.sync_api import expect

    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    outside: list[str] = []
    failed: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, dialogs, outside, height=2400)
        page.on("response", lambda response: failed.append(f"{response.status} {response.url}")
                if response.status >= 400 else None)
        try:
            for path, heading, text in PAGES_BY_URL:
                page.goto(samples_server + path)
                main = page.locator("[data-testid=stMain]")
                expect(page.get_by_role("heading", name=heading, exact=True)).to_be_visible()
                expect(main).to_contain_text(text)
                wait_idle(page)
                check_no_error(page)
                expect(page.locator("[data-testid=stToolbar]")).to_have_count(1)  # the toolbar is drawn...
                expect(page.locator("[data-testid=stAppDeployButton]")).to_have_count(0)  # ...without Deploy
                expect(page.get_by_role("button", name="Deploy")).to_have_count(0)
                assert urlsplit(page.url).path == urlsplit(path).path, (path, page.url)
                name = urlsplit(path).path.strip("/") + "_" + parse_qs(urlsplit(path).query)["run"][0]
                page.screenshot(path=str(shots / f"url_{name}.png"), full_page=True)
                if path.startswith("/tokens"):
                    check_url_tokens_page(page, main)
                if path.startswith("/step?"):
                    check_url_step_page(page, main)
            page.goto(samples_server + "/steps?run=grpo-tiny")
            click_a_step_point(page)
            page.screenshot(path=str(shots / "steps_click_opened_step.png"), full_page=True)
        finally:
            browser.close()
    assert outside == [], f"requests left 127.0.0.1: {sorted(set(outside))}"
    assert dialogs == []
    page_paths = {urlsplit(path).path for path, _, _ in PAGES_BY_URL} | {"/steps", "/step"}
    ours = [f for f in failed if not streamlit_base_path_probe(f.split(" ", 1)[1], page_paths - {"/"})]
    assert ours == [], f"error answers beyond Streamlit's base-path probes: {ours}"


def is_round_ladder(labels: list[str]) -> bool:
    """Tick labels a reader can use: evenly spaced numbers, the spacing 1, 2 or 5 × 10^k, each tick a
    multiple of it (``-1, -0.5, 0, 0.5`` yes; ``0.904, 0.002, -0.9`` no)."""
    values = [float(t.replace("\u2212", "-").rstrip("%")) for t in labels]
    if len(values) < 2:
        return True
    steps = [b - a for a, b in zip(values, values[1:])]
    step = abs(steps[0])
    if step == 0 or any(abs(abs(d) - step) > 1e-9 * max(1.0, step) for d in steps):
        return False
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5)) and all(
        abs(v / step - round(v / step)) < 1e-6 for v in values)


def test_groups_page_axes_have_round_ticks(sync_playwright, samples_server, tmp_path):
    """The Groups page of both GRPO samples: the reward figure's advantage axis (right) and reward
    axis show round ticks, and the zero-variance figure's step axis whole steps, as drawn by
    plotly.js in the browser (an overlaying axis synced its ticks to the other's grid: 0.904, 0.002...)."""
    from playwright.sync_api import expect

    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, dialogs, height=2400)
        try:
            for run, steps in (("grpo-tiny", ["0", "1", "2"]), ("grpo-trl-tiny", ["0", "1", "2", "3"])):
                page.goto(f"{samples_server}/groups?run={run}")
                expect(page.get_by_role("heading", name="Groups", exact=True)).to_be_visible()
                wait_idle(page)
                check_no_error(page)
                plots = page.locator(".js-plotly-plot")
                expect(plots).to_have_count(2)
                rewards, shares = plots.nth(0), plots.nth(1)
                labels = {axis: [t.text_content() for t in rewards.locator(f"g.{axis} text").all()]
                          for axis in ("ytick", "y2tick")}
                assert len(labels["y2tick"]) >= 3 and is_round_ladder(labels["y2tick"]), (run, labels)
                assert is_round_ladder(labels["ytick"]), (run, labels)
                assert [t.text_content() for t in shares.locator("g.xtick text").all()] == steps
                page.screenshot(path=str(shots / f"groups_{run}.png"), full_page=True)
        finally:
            browser.close()
    assert dialogs == []


def wait_idle(page) -> None:
    """Until the app has finished running (no status widget, nothing stale)."""
    from playwright.sync_api import expect

    for _ in range(2):  # twice: a rerun may start just after the first wait
        page.wait_for_timeout(500)
        page.wait_for_function("!document.querySelector('[data-testid=stStatusWidget]')")
        expect(page.locator("[data-stale=true]")).to_have_count(0)


def check_url_tokens_page(page, main) -> None:
    """``/tokens?run=grpo-tiny&step=1&inner=0&seq=2`` opened that sequence; its completion is
    coloured by the chosen quantity, and changing the quantity changes the colours."""
    from playwright.sync_api import expect

    expect(page.get_by_role("combobox", name="Sequence")).to_have_value(re.compile(r"^seq 2 ·"))
    coloured = main.locator("[data-testid=stHtml]").first
    spans = coloured.locator("span[title]")
    assert spans.count() >= 2
    before = [spans.nth(i).get_attribute("style") for i in range(spans.count())]
    assert all("background:" in style for style in before)
    expect(page.get_by_role("combobox", name="Colour tokens by")).to_have_value("ref_kl_k3")  # ratio is 1 here
    choose(page, "Colour tokens by", "ratio")
    wait_idle(page)
    spans = main.locator("[data-testid=stHtml]").first.locator("span[title]")
    after = [spans.nth(i).get_attribute("style") for i in range(spans.count())]
    assert after != before  # k3 differs per token; the ratio of inner step 0 is 1 (white) everywhere
    assert len(set(after)) == 1 and "ratio = 1" in spans.first.get_attribute("title")
    assert "colour=ratio" in page.url  # the choice goes into the URL too


def check_url_step_page(page, main) -> None:
    """``/step?run=grpo-tiny&step=1``: the step table (every kept token, with links), the heatmap
    and the histograms."""
    from playwright.sync_api import expect

    grid = main.locator("[data-testid=stDataFrame]").filter(has=page.locator("th", has_text="token text"))
    expect(grid).to_have_count(1)
    expect(main).to_contain_text("28 tokens match")  # the 28 kept of 32 positions of step 1
    assert main.locator(".js-plotly-plot").count() == 2  # heatmap, histograms
    expect(main.locator(".js-plotly-plot").first.locator(".hm, .heatmaplayer image")).not_to_have_count(0)


def click_a_step_point(page) -> None:
    """Click the point of step 1 on the first Steps curve (inner step 0): the Step page opens on it."""
    from playwright.sync_api import expect

    expect(page.get_by_role("heading", name="Steps", exact=True)).to_be_visible()
    wait_idle(page)
    point = page.locator(".js-plotly-plot .scatterlayer .trace").first.locator(".points path").nth(1)
    box = point.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    expect(page.get_by_role("heading", name="Step", exact=True)).to_be_visible()
    wait_idle(page)
    assert urlsplit(page.url).path == "/step"
    query = parse_qs(urlsplit(page.url).query)
    assert (query["step"], query["inner"]) == (["1"], ["0"]), page.url
    expect(page.locator("[data-testid=stMain]")).to_contain_text("step 1 · inner 0 ·")
