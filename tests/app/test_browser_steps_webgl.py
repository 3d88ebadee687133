"""The Steps page of a run longer than ``figures.WEBGL_POINTS`` steps, in Chromium: the curves are
drawn by WebGL (canvases, no SVG markers) and clicking a point still opens that step's Step page
(the overview of long runs)."""

from __future__ import annotations

import re
import time

import torch

from app.components.figures import WEBGL_POINTS
from tracer import TraceWriter

from tests.fixtures.browser import CHROMIUM, CHROMIUM_ARGS, UI_TIMEOUT_MS, browser_or_skip, serve


STEPS = WEBGL_POINTS + 50


def _write_long_run(out):
    """GRPO steps whose mean ratio grows with the step (policy - old = 1e-4 * step at every token)."""
    B, T = 2, 3
    with TraceWriter(out, "grpo", hyperparameters={"num_generations": 2, "clip_epsilon_low": 0.2,
                                                   "clip_epsilon_high": 0.2}) as writer:
        for step in range(STEPS):
            old = torch.full((B, T), -1.0)
            writer.record(step, completion_ids=torch.ones(B, T, dtype=torch.long),
                          completion_mask=torch.ones(B, T, dtype=torch.bool), old_logprobs=old,
                          policy_logprobs=old + 1e-4 * step, rewards=torch.tensor([0.0, 1.0]),
                          advantages=torch.tensor([-1.0, 1.0]))


def test_a_long_run_is_drawn_with_webgl_and_a_click_opens_the_step(tmp_path):
    sync_playwright = browser_or_skip()
    root = tmp_path / "traces"
    _write_long_run(root / "long")
    target = int(STEPS * 0.6)
    with serve(root, tmp_path / "server.log") as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1400})
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.goto(f"{url}/steps?run=long")
            page.get_by_role("heading", name="Steps").wait_for()
            plot = page.locator("[data-testid=stMain] .js-plotly-plot").first
            plot.locator("canvas").first.wait_for(state="attached")
            assert plot.locator(".point").count() == 0  # no SVG marker per step
            kinds = plot.evaluate("gd => gd._fullData.map(t => t.type)")
            assert kinds and set(kinds) == {"scattergl"}
            # the pixel of the target step on the first panel (mean ratio), from Plotly's own axes
            xy = plot.evaluate(
                """(gd, step) => { const t = gd._fullData[0], L = gd._fullLayout;
                     const xa = L[t.xaxis.replace('x', 'xaxis')], ya = L[t.yaxis.replace('y', 'yaxis')];
                     const i = t.x.indexOf(step), box = gd.getBoundingClientRect();
                     return [box.left + xa._offset + xa.l2p(t.x[i]), box.top + ya._offset + ya.l2p(t.y[i])]; }""",
                target)
            page.mouse.move(*xy)
            time.sleep(0.5)
            page.mouse.click(*xy)
            page.wait_for_url(re.compile(r"/step\?"))
            opened = int(re.search(r"[?&]step=(\d+)", page.url).group(1))
            assert abs(opened - target) <= 5, (opened, target)  # a pixel holds a few steps at this width
        finally:
            browser.close()
