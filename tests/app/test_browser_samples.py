"""Pages in a real browser on the bundled sample traces (``sample_traces/``, what ``make app`` opens):
``python -m tracer view`` on a free port of 127.0.0.1, driven by headless Chromium through Playwright
(tests/fixtures/browser.py). The Diff page on the bundled pair names the cause and takes fields and
tolerances; every page opened by its URL shows what the URL names, loads nothing from beyond
127.0.0.1 and has no Deploy button; the Groups page's axes show round ticks. Saves screenshots under
$TRACER_TEST_OUTPUT (set by .ci/run to tests/output/) or tmp_path.

Without Chromium or the playwright package the tests are skipped, except under CI (CI set), where
they fail: CI installs both (.ci/run).
"""

from __future__ import annotations

import math
import re
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.fixtures import toy_traces
from tests.fixtures.browser import (SAMPLES, UI_TIMEOUT_MS, check_no_error, choose, open_page, screenshot_dir, serve,
                                    wait_idle)


@pytest.fixture(scope="module")
def samples_server(tmp_path_factory):
    """The app on the bundled sample traces (``sample_traces/``). Yields the URL."""
    if not (SAMPLES / "grpo-tiny").is_dir():
        pytest.skip("sample_traces/ is not in this checkout")
    with serve(SAMPLES, tmp_path_factory.mktemp("samples") / "server.log") as url:
        yield url


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
    ("/diff?run=grpo-tiny", "Diff", "a: reference"),  # its content is the Diff page's
    ("/ppo?run=ppo-tiny&step=1&inner=1", "PPO: GAE and early stop", "step 1 · epoch 1"),
    ("/dpo?run=dpo-tiny&step=2&seq=1", "DPO pairs", "step 2 · inner 0 · mb 0 · rank 0 · pair 1"),
    ("/steps?run=dpo-tiny", "Steps", "dpo · 3 step files"),
    ("/groups?run=rloo-trl-tiny&step=1", "Groups", "step 1 · inner 1 · mb 0 · rank 0"),  # step 1 has inner 1 only
    # the bundled TRL tools= run: roles, the tool call and the tool's result as blocks of their own
    ("/conversation?run=agent-trl-tiny&step=0&seq=0", "Conversation", "tool · tool result · not trained: tool output"),
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
                if path.startswith("/conversation?"):
                    for label in ("assistant · tool call", "prompt (prompt_ids) · not trained: prompt", "turn 2"):
                        expect(main).to_contain_text(label)
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
    assert (query["run"], query["step"], query["inner"]) == (["grpo-tiny"], ["1"], ["0"]), page.url
    expect(page.locator("[data-testid=stMain]")).to_contain_text("step 1 · inner 0 ·")
