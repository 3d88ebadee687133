"""The single-step pages in a real browser (headless Chromium through Playwright, as in
tests/fixtures/browser.py) on the bundled sample traces: the token table is as tall as its rows; the
per-token chart names the tokens under its axis, markup shown as text; no legend overlaps a subplot
title (DPO's, in the margin above them); Mismatch's steps are whole numbers. Screenshots go to
$TRACER_TEST_OUTPUT (tests/output/ under .ci/run) or tmp_path.

Skipped without Chromium or playwright, except under CI, where it fails (as in tests/fixtures/browser.py)."""

from __future__ import annotations

import pytest

from app.components.token_table import table_height
from tests.fixtures.browser import (
    SAMPLES,
    check_no_error,
    chromium_page,
    screenshot_dir,
    serve,
    wait_idle,
)

# Every legend and subplot title of every Plotly chart on the page, as [chart, kind, left, top, right, bottom].
_BOXES = """() => [...document.querySelectorAll('.js-plotly-plot')].flatMap((plot, i) =>
  [...plot.querySelectorAll('g.legend, g.annotation')].map(el => {
    const r = el.getBoundingClientRect();
    return [i, el.classList.contains('legend') ? 'legend' : 'title', r.left, r.top, r.right, r.bottom]; }))"""


def overlapping(boxes: list[list]) -> list[tuple]:
    """Pairs (legend, title) of one chart whose boxes intersect."""
    legends = [b for b in boxes if b[1] == "legend"]
    titles = [b for b in boxes if b[1] == "title" and b[4] > b[2]]
    return [(lg, t) for lg in legends for t in titles
            if lg[0] == t[0] and lg[2] < t[4] and t[2] < lg[4] and lg[3] < t[5] and t[3] < lg[5]]


@pytest.fixture(scope="module")
def samples_server(tmp_path_factory, sync_playwright):
    if not (SAMPLES / "dpo-tiny").is_dir():
        pytest.skip("sample_traces/ is not in this checkout")
    with serve(SAMPLES, tmp_path_factory.mktemp("samples") / "server.log") as url:
        yield url


def open_path(page, url: str, heading: str) -> None:
    from playwright.sync_api import expect

    page.goto(url)
    expect(page.get_by_role("heading", name=heading, exact=True)).to_be_visible()
    wait_idle(page)
    page.locator(".js-plotly-plot").first.wait_for()
    check_no_error(page)


def test_single_step_pages_draw_cleanly(sync_playwright, samples_server, tmp_path):
    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    with chromium_page(sync_playwright, dialogs, height=2600, width=1400) as page:
        # Tokens: grpo-tiny step 1, sequence 0 = " ", "4", "<|endoftext|>" then one after-EOS position
        open_path(page, samples_server + "/tokens?run=grpo-tiny&step=1&seq=0", "Tokens")
        grid = page.locator("[data-testid=stDataFrame]").first.bounding_box()
        assert abs(grid["height"] - table_height(4)) <= 2, grid  # 4 rows, no empty grid rows under them
        axis = page.locator(".js-plotly-plot").first.locator(".xaxislayer-above text")  # the bottom panel's axis
        axis.first.wait_for()
        ticks = axis.all_text_contents()
        # the bottom axis: each token over its position, markup as text ("<|endofte…", not a parsed tag)
        assert ["␣0", "41", "<|endofte…2", "<pad>3"] == [t for t in ticks if t][-4:]
        assert overlapping(page.evaluate(_BOXES)) == []
        page.screenshot(path=str(shots / "single_step_tokens.png"), full_page=True)

        open_path(page, samples_server + "/dpo?run=dpo-tiny", "DPO pairs")
        page.locator(".js-plotly-plot").nth(1).wait_for()
        boxes = page.evaluate(_BOXES)
        assert {b[0] for b in boxes if b[1] == "legend"} == {0, 1} and len([b for b in boxes if b[1] == "title"]) >= 5
        assert overlapping(boxes) == []  # the step curves' legend sat on "margin (chosen_rewards − …)"
        page.screenshot(path=str(shots / "single_step_dpo.png"), full_page=True)

        open_path(page, samples_server + "/mismatch?run=grpo-vllm-tiny", "Sampler vs trainer")
        steps_chart = page.locator(".js-plotly-plot").last
        steps_chart.scroll_into_view_if_needed()
        steps_chart.locator(".xaxislayer-above text").first.wait_for()
        labels = [t for t in steps_chart.locator(".xaxislayer-above text").all_text_contents() if t]
        assert labels and all(t.isdigit() for t in labels), labels  # 0 1 2 3, not 0 0.5 1 …
        assert overlapping(page.evaluate(_BOXES)) == []
        page.screenshot(path=str(shots / "single_step_mismatch.png"), full_page=True)

        for path, heading, name in (("/step?run=grpo-tiny&step=1", "Step", "step"),
                                    ("/groups?run=grpo-tiny&step=1", "Groups", "groups")):
            open_path(page, samples_server + path, heading)
            assert overlapping(page.evaluate(_BOXES)) == []
            page.screenshot(path=str(shots / f"single_step_{name}.png"), full_page=True)
    assert dialogs == []
