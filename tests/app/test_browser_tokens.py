"""The Tokens page in a real browser, on a toy trace: ``python -m tracer view`` on a free port of
127.0.0.1, driven by headless Chromium (Debian's /usr/bin/chromium) through Playwright (tests/fixtures/browser.py).

Picks a step and a sequence in the sidebar, reads the token table through the data grid's
accessible DOM (glide-data-grid draws on a canvas and mirrors the visible cells into a
``role=grid`` table), checks masked positions are marked, and that tokens ``<script>alert(1)</script>``
and ``<b>`` show as literal text: no dialog opens, no element is injected. On a hostile root: a run
outside the root is refused, a trace with corrupt step files serves its readable steps and names the
bad one. Saves screenshots under $TRACER_TEST_OUTPUT (set by .ci/run to tests/output/) or tmp_path.

Without Chromium or the playwright package the tests are skipped, except under CI (CI set), where
they fail: CI installs both (.ci/run).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tracer import TraceWriter

from tests.fixtures import browser as browser_module
from tests.fixtures import toy_traces
from tests.fixtures.browser import browser_or_skip, check_no_error, choose, open_page, screenshot_dir, serve
from tests.fixtures.paths import DATA


SCRIPT = "<script>alert(1)</script>"
VOCAB = ["<pad>", "<eos>", "Hello", " world", SCRIPT, "<b>", " yes", " no", "=", "4"]
PAD, EOS = 0, 1


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


def write_toy_trace(path: Path) -> None:
    with TraceWriter(path, "grpo", tokenizer=ToyTokenizer(), hyperparameters={"num_generations": 2}) as writer:
        for step in range(2):
            writer.record(step, step_tensors(step))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The app on a root holding a trace of 2 steps (``toy-run``) and a copy of the corrupt corpus
    trace (``mixed``); a trace lies outside the root (``outside``). Yields the URL."""
    tmp_path = tmp_path_factory.mktemp("view")
    root = tmp_path / "traces"
    write_toy_trace(root / "toy-run")
    write_toy_trace(tmp_path / "outside")
    shutil.copytree(DATA / "bad_traces" / "mixed", root / "mixed")
    with serve(root, tmp_path / "server.log") as url:
        yield url


def token_grid(page):
    """The token table's accessible DOM (the grid holding a ``token text`` column)."""
    return page.locator("[data-testid=stDataFrame]").filter(
        has=page.locator("th", has_text="token text")).last.locator("table[role=grid]")


def grid_rows(page) -> list[dict[str, str]]:
    """The token table's visible rows, ``{column header: cell text}``, from its accessible DOM."""
    grid = token_grid(page)
    headers = grid.locator("thead th").all_inner_texts()
    return [dict(zip(headers, row.locator("td").all_inner_texts())) for row in grid.locator("tbody tr").all()]


def test_tokens_page_in_chromium(sync_playwright, server, tmp_path):
    from playwright.sync_api import expect

    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, dialogs)
        try:
            page.goto(f"{server}/tokens?run=toy-run")
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
    monkeypatch.setattr(browser_module, "CHROMIUM", Path("/nonexistent/chromium"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs Chromium and playwright: /nonexistent/chromium is missing"):
        browser_or_skip()
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI must run the browser test"):
        browser_or_skip()


def test_hostile_root_in_chromium(sync_playwright, server, tmp_path):
    """A URL naming a run outside the root is refused; in a trace with corrupt step files the
    readable steps are served and a bad one is named with the reason; nothing raises."""
    from playwright.sync_api import expect

    shots = screenshot_dir(tmp_path)
    dialogs: list[str] = []
    with sync_playwright() as pw:
        # tall enough that the sidebar's Step file chooser (below the set-aside notes) opens its list on screen
        browser, page = open_page(pw, dialogs, height=2000)
        try:
            page.goto(f"{server}/tokens?run=../outside")
            expect(page.locator("[data-testid=stMain]")).to_contain_text("refused to open '../outside'")
            assert "outside" not in page.get_by_role("combobox", name="Run").input_value()
            page.screenshot(path=str(shots / "refused_outside_root.png"), full_page=True)

            page.goto(f"{server}/tokens?run=mixed")
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
