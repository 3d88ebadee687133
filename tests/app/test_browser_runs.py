"""The Runs page and the URL state in a real browser (headless Chromium through Playwright,
tests/fixtures/browser.py) on the bundled traces: ``/`` lists every run with its check verdict, a
row's link opens the run at its most informative step (the samples are healthy: the last step),
choosing a row opens it in the same tab, and the Diff page's pair comes from and goes to the URL
with no Run chooser in the sidebar. The tables are read through the data grid's accessible DOM.

Skipped without Chromium or playwright, except under CI, where it fails (as in tests/fixtures/browser.py)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from tests.fixtures.browser import SAMPLES, check_no_error, chromium_page, screenshot_dir, serve, wait_idle


@pytest.fixture(scope="module")
def samples_server(tmp_path_factory, sync_playwright):
    if not (SAMPLES / "grpo-tiny").is_dir():
        pytest.skip("sample_traces/ is not in this checkout")
    with serve(SAMPLES, tmp_path_factory.mktemp("runs") / "server.log") as url:
        yield url


ROW_PX = 35  # the data grid's header and row height (Streamlit's default)


def runs_grid(page):
    """The runs table's accessible DOM (glide-data-grid mirrors its cells into a ``role=grid`` table,
    attached once the grid has drawn)."""
    grid = page.locator("[data-testid=stDataFrame]").first.locator("table[role=grid]")
    grid.locator("thead th").first.wait_for(state="attached")
    return grid


def grid_rows(grid) -> list[dict[str, str]]:
    headers = grid.locator("thead th").all_inner_texts()
    return [dict(zip(headers, row.locator("td").all_inner_texts())) for row in grid.locator("tbody tr").all()]


def sample_runs() -> list[str]:
    return sorted(p.name for p in SAMPLES.iterdir() if (p / "manifest.json").is_file())


def test_the_runs_page_lists_every_run_and_opens_one(sync_playwright, samples_server, tmp_path):
    from playwright.sync_api import expect

    shots, dialogs = screenshot_dir(tmp_path), []
    with chromium_page(sync_playwright, dialogs, height=1600) as page:
        page.goto(samples_server + "/")
        expect(page.get_by_role("heading", name="Runs", exact=True)).to_be_visible()
        wait_idle(page)
        check_no_error(page)
        rows = grid_rows(runs_grid(page))
        assert [r["run"] for r in rows] == sample_runs()
        assert {r["check"] for r in rows} == {"pass"}  # the bundled runs are healthy
        assert {r["run"]: r["algorithm"] for r in rows}["dpo-tiny"] == "dpo"
        page.screenshot(path=str(shots / "runs.png"), full_page=True)

        # choose the grpo-tiny row (the grid's row marker, left of its cells): the Tokens page opens
        # in this tab at the run's last step, step 2 · inner 1
        box = page.locator("[data-testid=stDataFrame]").first.locator("canvas").first.bounding_box()
        row = sample_runs().index("grpo-tiny")
        page.mouse.click(box["x"] + ROW_PX / 2, box["y"] + ROW_PX * (row + 1) + ROW_PX / 2)
        expect(page.get_by_role("heading", name="Tokens", exact=True)).to_be_visible()
        wait_idle(page)
        check_no_error(page)
        query = parse_qs(urlsplit(page.url).query)
        assert urlsplit(page.url).path == "/tokens"
        assert (query["run"], query["step"], query["inner"]) == (["grpo-tiny"], ["2"], ["1"])
        expect(page.locator("[data-testid=stMain]")).to_contain_text("step 2 · inner 1 · mb 0 · rank 0 · sequence 0")
        page.screenshot(path=str(shots / "runs_opened_grpo_tiny.png"), full_page=True)
    assert dialogs == []


def test_the_diff_pair_comes_from_the_url_without_a_run_chooser(sync_playwright, samples_server, tmp_path):
    from playwright.sync_api import expect

    if not (SAMPLES / "grpo-diff-baseline").is_dir():
        pytest.skip("the bundled diff pair is not in this checkout")
    shots, dialogs = screenshot_dir(tmp_path), []
    with chromium_page(sync_playwright, dialogs) as page:
        page.goto(samples_server + "/diff?a=grpo-diff-scorer-clip&b=grpo-diff-baseline")
        expect(page.get_by_role("heading", name="Diff", exact=True)).to_be_visible()
        wait_idle(page)
        check_no_error(page)
        assert "grpo-diff-scorer-clip" in page.get_by_role("combobox", name="a: reference").input_value()
        assert "grpo-diff-baseline" in page.get_by_role("combobox", name="b: candidate").input_value()
        expect(page.locator("[data-testid=stMain]")).to_contain_text(
            "Comparing a = grpo-diff-scorer-clip with b = grpo-diff-baseline.")
        expect(page.locator("[data-testid=stSidebar]").get_by_role("combobox", name="Run")).to_have_count(0)
        page.get_by_role("combobox", name="b: candidate").click()
        page.get_by_role("option").filter(has_text="grpo-tiny").first.click()
        wait_idle(page)
        query = parse_qs(urlsplit(page.url).query)
        assert (query["a"], query["b"]) == (["grpo-diff-scorer-clip"], ["grpo-tiny"])
        page.screenshot(path=str(shots / "diff_pair_from_url.png"), full_page=True)
    assert dialogs == []
