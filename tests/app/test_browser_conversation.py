"""The Conversation page in a real browser (headless Chromium through Playwright, as in
tests/fixtures/browser.py), on a packed multi-turn agent trace written by ``TraceWriter``: opened by
its URL (``/conversation?run=…&step=…&seq=…``), it shows the role labels, the tool call and the tool
result as blocks of their own, and the per-turn table; no request leaves 127.0.0.1. A screenshot
goes to $TRACER_TEST_OUTPUT (tests/output/ under .ci/run) or tmp_path.

Skipped without Chromium or playwright, except under CI, where it fails (as in tests/fixtures/browser.py)."""

from __future__ import annotations

import pytest

from tests.fixtures.agent_traces import write_agent_trace
from tests.fixtures.browser import check_no_error, chromium_page, screenshot_dir, serve, wait_idle


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory, sync_playwright):
    root = tmp_path_factory.mktemp("agent_runs")
    write_agent_trace(root / "agent")
    with serve(root, root / "server.log") as url:
        yield url


def test_conversation_opens_by_url_with_roles_and_a_tool_block(sync_playwright, agent_server, tmp_path):
    from playwright.sync_api import expect

    dialogs: list[str] = []
    outside: list[str] = []
    with chromium_page(sync_playwright, dialogs, outside=outside) as page:
        page.goto(agent_server + "/conversation?run=agent&step=0&seq=1")
        expect(page.get_by_role("heading", name="Conversation", exact=True)).to_be_visible()
        main = page.locator("[data-testid=stMain]")
        expect(main.get_by_text("tool · tool result · not trained: tool output", exact=True)).to_be_visible()
        wait_idle(page)
        check_no_error(page)
        text = main.inner_text()
        for label in ("system · not trained: prompt", "user · not trained: prompt", "assistant · tool call",
                      "turn 1", "turn 2"):
            assert label in text, label
        assert "sequence 1 · 2 assistant turn(s)" in text
        # the tool call's text is shown literally, in its own block, apart from the tool's result
        call = main.get_by_text("assistant · tool call", exact=True).locator("xpath=..")
        assert "<tool_call> calc</tool_call>" in call.inner_text()
        result = main.get_by_text("tool · tool result · not trained: tool output", exact=True).locator("xpath=..")
        assert "42" in result.inner_text() and "tool_call" not in result.inner_text()
        assert " no idea" in text  # sequence 1's second turn
        expect(main.get_by_role("heading", name="Turns")).to_be_visible()
        page.screenshot(path=str(screenshot_dir(tmp_path) / "conversation.png"), full_page=True)
    assert not dialogs and not outside, (dialogs, outside)
