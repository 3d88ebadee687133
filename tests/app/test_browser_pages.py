"""Pages in a real browser (headless Chromium through Playwright, as in tests/fixtures/browser.py), on the
bundled sample traces: a link to a page not offered for the run opens our own page saying which
and why, with links to the pages the run has (not Streamlit's "Page not found"); the Mismatch
page's metrics show whole, neither label nor value cut off, at common window widths. Screenshots go
to $TRACER_TEST_OUTPUT (tests/output/ under .ci/run) or tmp_path.

Skipped without Chromium or playwright, except under CI, where it fails (as in tests/fixtures/browser.py)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from tests.fixtures.browser import SAMPLES, check_no_error, chromium_page, screenshot_dir, serve, wait_idle

# (URL, heading, why, the pages the run has): the reasons follow app/components/navigation.py's PAGES
NOT_OFFERED = (
    ("/groups?run=ppo-tiny&step=1", "Groups: not offered for this run",
     "The Groups page is for grpo, cispo, rloo runs; this run's algorithm is ppo.",
     ["Tokens", "Rollouts", "Conversation", "Step", "PPO: GAE and early stop", "Steps", "Health", "Diff", "Overview"]),
    ("/dpo?run=grpo-tiny", "DPO pairs: not offered for this run",
     "The DPO pairs page is for dpo runs; this run's algorithm is grpo.",
     ["Tokens", "Rollouts", "Conversation", "Step", "Groups", "Steps", "Health", "Diff", "Overview"]),
    ("/mismatch?run=grpo-tiny", "Mismatch: not offered for this run",  # grpo-tiny records no sampler_logprobs
     "The Mismatch page shows sampler_logprobs, which this run does not record (no sampler_logprobs in the "
     "first or the selected step file).",
     ["Tokens", "Rollouts", "Conversation", "Step", "Groups", "Steps", "Health", "Diff", "Overview"]),
)


@pytest.fixture(scope="module")
def samples_server(tmp_path_factory, sync_playwright):
    if not (SAMPLES / "grpo-vllm-tiny").is_dir():
        pytest.skip("sample_traces/ is not in this checkout")
    with serve(SAMPLES, tmp_path_factory.mktemp("samples") / "server.log") as url:
        yield url


def test_a_link_to_a_page_not_offered_says_why_and_links_on(sync_playwright, samples_server, tmp_path):
    from playwright.sync_api import expect

    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    with chromium_page(sync_playwright, dialogs) as page:
        for path, heading, why, links in NOT_OFFERED:
            page.goto(samples_server + path)
            main = page.locator("[data-testid=stMain]")
            expect(page.get_by_role("heading", name=heading, exact=True)).to_be_visible()
            wait_idle(page)
            check_no_error(page)
            text = main.inner_text()
            assert "Page not found" not in page.locator("body").inner_text()
            assert f"/{urlsplit(path).path.strip('/')} is not offered for this run. {why}" in " ".join(text.split())
            labels = main.locator("[data-testid=stPageLink]").all_inner_texts()  # "icon name\nlabel"
            assert [label.split("\n")[-1] for label in labels] == links
            page.screenshot(path=str(shots / f"not_offered_{urlsplit(path).path.strip('/')}.png"), full_page=True)
        # a link opens that page on the same run (the URL's selection kept)
        page.goto(samples_server + NOT_OFFERED[0][0])
        page.locator("[data-testid=stMain] [data-testid=stPageLink]").filter(has_text="PPO: GAE").click()
        expect(page.get_by_role("heading", name="PPO: GAE and early stop", exact=True)).to_be_visible()
        wait_idle(page)
        query = parse_qs(urlsplit(page.url).query)
        assert (urlsplit(page.url).path, query["run"], query["step"]) == ("/ppo", ["ppo-tiny"], ["1"])
    assert dialogs == []


# Whether an element's text is cut (an ellipsis or clipped overflow): its content is wider than its box
# (Streamlit's label cuts with an ellipsis one pixel short: scrollWidth 178, clientWidth 177).
_CUT = """el => { const cut = e => e.scrollWidth > e.clientWidth;
  return [el, ...el.querySelectorAll('*')].some(cut); }"""


@pytest.mark.parametrize("width", [1024, 1280, 1600])
def test_mismatch_metrics_show_whole(sync_playwright, samples_server, tmp_path, width):
    """Each metric of the Mismatch page (vLLM-sampled sample run) shows its whole label and value."""
    from playwright.sync_api import expect

    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    with chromium_page(sync_playwright, dialogs, width=width, height=1000) as page:
        page.goto(f"{samples_server}/mismatch?run=grpo-vllm-tiny")
        expect(page.get_by_role("heading", name="Sampler vs trainer")).to_be_visible()
        wait_idle(page)
        check_no_error(page)
        metrics = page.locator("[data-testid=stMetric]")
        # three in log space, one in probability space, the share the IS correction cut, the mean policy lag
        expect(metrics).to_have_count(6)
        page.screenshot(path=str(shots / f"mismatch_metrics_{width}.png"))
        for i in range(metrics.count()):
            for part in ("stMetricLabel", "stMetricValue"):
                element = metrics.nth(i).locator(f"[data-testid={part}]")
                assert not element.evaluate(_CUT), (width, part, element.inner_text())
    assert dialogs == []
