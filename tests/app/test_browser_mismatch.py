"""The Mismatch page in a real browser (headless Chromium through Playwright, as in tests/fixtures/browser.py):
``python -m tracer view`` on real vLLM-sampled runs, the healthy sample and the two broken runs of
tests/data/vllm_bugs/. Each run's page shows the ``sampler.mismatch`` verdict and its cause, the
``sampler.is_weights`` verdict on TRL's recorded weights with the raw-ratio-against-weight chart, and
draws its charts. Screenshots go to $TRACER_TEST_OUTPUT (tests/output/ under .ci/run) or tmp_path.

Skipped without Chromium or playwright, except under CI, where it fails (as in tests/fixtures/browser.py)."""

from __future__ import annotations

import shutil

import pytest

from tests.fixtures.browser import open_page, screenshot_dir, serve
from tests.fixtures.paths import REPO

RUNS = {"healthy": REPO / "sample_traces" / "grpo-vllm-tiny",
        "raw-logprobs": REPO / "tests" / "data" / "vllm_bugs" / "raw-logprobs",
        "top-p": REPO / "tests" / "data" / "vllm_bugs" / "top-p"}
EXPECTED = {"healthy": ("sampler.mismatch: info", "noise-level differences"),
            "raw-logprobs": ("sampler.mismatch: error", "temperature applied on one side only"),
            "top-p": ("sampler.mismatch: error", "renormalised over a truncated distribution")}


@pytest.fixture(scope="module")
def server(tmp_path_factory, sync_playwright):
    """``python -m tracer view`` on a root holding the three runs (models left out); yields the URL."""
    tmp = tmp_path_factory.mktemp("mismatch-view")
    root = tmp / "traces"
    for name, path in RUNS.items():
        shutil.copytree(path, root / name, ignore=shutil.ignore_patterns("model"))
    with serve(root, tmp / "server.log") as url:
        yield url


def test_mismatch_page_shows_each_run_in_chromium(sync_playwright, server, tmp_path):
    from playwright.sync_api import expect

    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, dialogs)
        try:
            for run, (verdict, cause) in EXPECTED.items():
                page.goto(f"{server}/tokens?run={run}")
                expect(page.get_by_role("heading", name="Tokens")).to_be_visible()
                page.get_by_role("link", name="Mismatch").click()
                expect(page.get_by_role("heading", name="Sampler vs trainer")).to_be_visible()
                main = page.locator("[data-testid=stMain]")
                expect(main).to_contain_text(verdict)
                expect(main).to_contain_text(cause)
                expect(main).to_contain_text("sampler_engine = vllm")
                # the importance-sampling correction TRL applied: its verdict, raw ratio against the weight applied
                expect(main).to_contain_text("sampler.is_weights: info")
                expect(main).to_contain_text("Weights as the trainer recorded them")
                expect(main).to_contain_text("importance weight applied against the raw ratio")
                expect(main.locator(".js-plotly-plot").first).to_be_visible()
                expect(page.locator("[data-stale=true]")).to_have_count(0)
                # 2 histograms, 2 scatters, weights, steps: drawn one after another, so waited for
                expect(main.locator(".js-plotly-plot").nth(4)).to_be_visible()
                page.screenshot(path=str(shots / f"mismatch_{run}.png"), full_page=True)
        finally:
            browser.close()
    assert dialogs == []
    assert all((shots / f"mismatch_{run}.png").stat().st_size > 10_000 for run in EXPECTED)
