"""The Steps page in Chromium on two hand-written GRPO runs, one recording the ratio and one
leaving it to the reader (tests/fixtures/steps_runs.py): the link with a user scalar, smoothing and
the overlay draws both runs in every panel, the derived one named in the title, and the raw line
under the smoothed one (as plotly.js drew them, read from the page's own figure)."""

from __future__ import annotations

import pytest

from tests.fixtures.browser import check_no_error, chromium_page, screenshot_dir, serve, wait_idle
from tests.fixtures.steps_runs import BASELINE, grad_norm, write_steps_root

LINK = "/steps?run=mine&overlay=baseline&y=scalars/grad_norm,mean_ratio&smooth=0.5"


def test_a_user_scalar_smoothed_and_two_hand_written_runs_overlaid(sync_playwright, tmp_path):
    from playwright.sync_api import expect

    if not BASELINE.is_dir():
        pytest.skip("sample_traces/ is not in this checkout")
    root = write_steps_root(tmp_path / "runs")
    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    with serve(root, tmp_path / "server.log") as url, chromium_page(sync_playwright, dialogs) as page:
        page.goto(url + LINK)
        expect(page.get_by_role("heading", name="Steps", exact=True)).to_be_visible()
        wait_idle(page)
        check_no_error(page)
        main = page.locator("[data-testid=stMain]")
        assert "not overlaid" not in main.inner_text()
        plot = main.locator(".js-plotly-plot").first
        titles = plot.evaluate("gd => gd._fullLayout.annotations.map(a => a.text)")
        assert titles == ["scalars/grad_norm", "mean ratio (derived for mine)"]
        # [name, y-axis, opacity, y] of every trace plotly.js drew
        drawn = plot.evaluate("gd => gd._fullData.map(t => [t.name, t.yaxis, t.opacity, Array.from(t.y)])")
        ratio_runs = {name.split(" · ")[0] for name, axis, _, _ in drawn if axis == "y2"}
        assert ratio_runs == {"mine", "baseline"}
        raw = [y for name, axis, opacity, y in drawn if name == "mine · inner step 0" and axis == "y" and opacity < 0.5]
        assert raw == [[grad_norm(s, 0) for s in range(3)]]  # the recorded values, faint under the smoothed line
        smoothed = [y for name, axis, opacity, y in drawn if name == "mine · inner step 0" and axis == "y"
                    and opacity >= 0.5]
        # weight 0.5, debiased: 0.5; (0.5 * 0.5 + 1.5) / 1.5; ...
        assert smoothed[0][0] == pytest.approx(0.5) and smoothed[0][1] == pytest.approx((0.25 + 1.5) / 1.5)
        expect(page.get_by_text("mine: approx_kl_k2, ratio, ref_kl_k3: derived by the reader")).to_be_visible()
        page.screenshot(path=str(shots / "steps_overlay_user_scalar.png"), full_page=True)
    assert dialogs == []
