"""The Rollouts page in a real browser (headless Chromium through Playwright, tests/fixtures/browser.py) on
the bundled grpo-tiny trace: sorting by reward puts the highest rewards of the step files first, a
full-text search keeps only rows whose text holds the query, both land in the URL, and ticking a row's
selection box opens that row on the Tokens page (the URL its link names). The table is
read through the data grid's accessible DOM (glide-data-grid mirrors its visible cells into a
``role=grid`` table). Screenshots go to $TRACER_TEST_OUTPUT or tmp_path.

Skipped without Chromium or playwright, except under CI, where it fails (as in tests/fixtures/browser.py)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest
from safetensors import safe_open

from tests.fixtures.browser import SAMPLES, check_no_error, choose, chromium_page, screenshot_dir, serve, wait_idle

RUN = "grpo-tiny"


@pytest.fixture(scope="module")
def samples_server(tmp_path_factory, sync_playwright):
    if not (SAMPLES / RUN).is_dir():
        pytest.skip("sample_traces/ is not in this checkout")
    with serve(SAMPLES, tmp_path_factory.mktemp("rollouts") / "server.log") as url:
        yield url


def rollouts_grid(page):
    """The rollouts table's accessible DOM (the grid with a ``reward`` column; only the columns in view
    are mirrored)."""
    return page.locator("[data-testid=stDataFrame]").filter(
        has=page.locator("th", has_text="reward")).last.locator("table[role=grid]")


def grid_rows(page) -> list[dict[str, str]]:
    grid = rollouts_grid(page)
    headers = grid.locator("thead th").all_inner_texts()
    return [dict(zip(headers, row.locator("td").all_inner_texts())) for row in grid.locator("tbody tr").all()]


def rewards_on_disk() -> list[float]:
    """Every reward of the run's step files, highest first (read with safetensors, not the app's reader)."""
    rewards = []
    for path in (SAMPLES / RUN / "steps").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            rewards += f.get_tensor("rewards").tolist()
    return sorted(rewards, reverse=True)


def test_rollouts_sort_and_search_in_chromium(sync_playwright, samples_server, tmp_path):
    from playwright.sync_api import expect

    shots, dialogs = screenshot_dir(tmp_path), []
    with chromium_page(sync_playwright, dialogs) as page:
        page.goto(f"{samples_server}/rollouts?run={RUN}")
        expect(page.get_by_role("heading", name="Rollouts", exact=True)).to_be_visible()
        wait_idle(page)
        check_no_error(page)
        choose(page, "Sort by", "reward")
        wait_idle(page)
        page.get_by_text("Descending", exact=True).click()
        wait_idle(page)
        check_no_error(page)
        rows = grid_rows(page)
        assert len(rows) >= 5, rows
        shown = [float(r["reward"]) for r in rows]
        # the cells show rounded numbers: compare with the file's rewards to 3 significant digits
        assert shown == pytest.approx(rewards_on_disk()[:len(shown)], rel=2e-3)
        query = parse_qs(urlsplit(page.url).query)
        assert query["sort"] == ["reward"] and query["dir"] == ["desc"]
        page.screenshot(path=str(shots / "rollouts_sorted.png"), full_page=True)

        word = rows[0]["text"].split()[0]  # a word of the best completion
        box = page.get_by_role("textbox", name="Search the text")
        box.fill(word)
        box.press("Enter")
        wait_idle(page)
        check_no_error(page)
        found = grid_rows(page)
        assert found and all(word.lower() in r["text"].lower() for r in found), (word, found)
        assert parse_qs(urlsplit(page.url).query)["search"] == [word]
        page.screenshot(path=str(shots / "rollouts_search.png"), full_page=True)

        # the first row's "open" link resolves next to /rollouts: /tokens on that row (a new tab)
        first = found[0]
        # the grid draws on a canvas: tick the first row's selection box (the 33-px column at the left;
        # header and rows 35 px high): the row opens on the Tokens page in this tab
        first = found[0]
        grid = page.locator("[data-testid=stDataFrame] canvas").first.bounding_box()
        page.mouse.click(grid["x"] + 16, grid["y"] + 35 + 17)
        expect(page.get_by_role("heading", name="Tokens", exact=True)).to_be_visible()
        wait_idle(page)
        check_no_error(page)
        target = urlsplit(page.url)
        assert target.path == "/tokens"
        assert {k: v[0] for k, v in parse_qs(target.query).items() if k != "colour"} == {
            k: v[0] for k, v in parse_qs(urlsplit(first["tokens"]).query).items()}
        page.screenshot(path=str(shots / "rollouts_opened_row.png"), full_page=True)
    assert not dialogs
