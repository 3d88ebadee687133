"""The token marked on the Tokens page lives in the URL (``token=``) whichever page marked it: a
Health finding or a worst token of the Mismatch page puts it there, so a reload or a copied link
marks it again; "Clear highlight" takes it out of the URL too, so a reload does not bring it back.
Each reload is a new session started on the URL the page left."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.toy_traces import (
    TOKENS_PAGE, ToyTokenizer, frame_with, largest_frame_with, start, styled_rows, write_trace)

HIGHLIGHT = "#ffd54f"  # token_table.HIGHLIGHT_STYLE's background
BUG_STEP, BUG_SEQUENCE, BUG_TOKEN = 1, 0, 3


def keep_bold_after_eos(step: int, inner_step: int, tensors) -> None:
    """Step 1, inner 0, row 0: ``<b>`` (id 8) kept right after the EOS at completion position 3."""
    if (step, inner_step) == (BUG_STEP, 0):
        tensors["completion_ids"][BUG_SEQUENCE, BUG_TOKEN] = 8
        tensors["completion_mask"][BUG_SEQUENCE, BUG_TOKEN] = True


def widen_one_mismatch(step: int, inner_step: int, tensors) -> None:
    """Step 0, inner 0: row 2's completion position 1 is 2 nats off the sampler (the toy's others
    are ~0.01): the Mismatch page's worst token."""
    if (step, inner_step) == (0, 0):
        tensors["sampler_logprobs"][2, 1] = tensors["old_logprobs"][2, 1] - 2.0


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("marked")
    write_trace(root / "buggy", tokenizer=ToyTokenizer(), steps=2, edit=keep_bold_after_eos)
    write_trace(root / "sampled", tokenizer=ToyTokenizer(), steps=1, edit=widen_one_mismatch)
    return root


def marked_positions(at) -> list[tuple[str, int]]:
    """(section, position) of the token table's rows drawn with the highlight."""
    tokens = largest_frame_with(at, {"section", "position", "token_text"})
    rows = styled_rows(tokens.proto.arrow_data.styler.styles, HIGHLIGHT)
    return [(tokens.value.loc[i, "section"], int(tokens.value.loc[i, "position"])) for i in sorted(rows)]


def test_clear_highlight_takes_a_health_findings_token_out_of_the_url(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "buggy"}, page="app_pages/health.py")
    findings = frame_with(at, {"check", "sequence", "token", "token_text"})
    bug = findings.value.index[findings.value["check"] == "masks.after_eos"][0]
    at.session_state[findings.key] = {"selection": {"rows": [int(bug)], "columns": [], "cells": []}}
    at.run()
    assert at.title[0].value == "Tokens" and at.query_params["token"] == str(BUG_TOKEN)
    assert marked_positions(at) == [("completion", BUG_TOKEN)]
    at.switch_page(TOKENS_PAGE)  # (AppTest reruns the page it was switched to, not the page the script switched to)
    at.button(key="clear_highlight").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Tokens"
    assert "token" not in at.query_params and at.query_params["seq"] == str(BUG_SEQUENCE)
    assert marked_positions(at) == []
    reloaded = start(monkeypatch, root, dict(at.query_params), page=TOKENS_PAGE)
    assert not reloaded.exception, [e.value for e in reloaded.exception]
    assert marked_positions(reloaded) == [] and "token" not in reloaded.query_params


def test_clear_highlight_is_offered_for_a_token_a_link_marks(monkeypatch, root):
    # a reload of the page Health opened: the session forgot the finding, the URL still marks the token
    url = {"run": "buggy", "step": str(BUG_STEP), "inner": "0", "mb": "0", "rank": "0",
           "seq": str(BUG_SEQUENCE), "token": str(BUG_TOKEN)}
    at = start(monkeypatch, root, url, page=TOKENS_PAGE)
    assert not at.exception, [e.value for e in at.exception]
    assert marked_positions(at) == [("completion", BUG_TOKEN)]
    assert f"marked by the link: token {BUG_TOKEN}" in [c.value for c in at.caption]
    at.button(key="clear_highlight").click().run()
    assert "token" not in at.query_params and marked_positions(at) == []
    assert not any(c.value.startswith("marked by the link") for c in at.caption)


def test_a_mismatch_worst_token_opens_with_its_token_in_the_url(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "sampled", "step": "0", "inner": "0"}, page="app_pages/mismatch.py")
    assert not at.exception, [e.value for e in at.exception]
    worst = frame_with(at, {"sequence", "token", "token_text", "log_diff"})
    assert (int(worst.value.iloc[0]["sequence"]), int(worst.value.iloc[0]["token"])) == (2, 1)  # 2 nats, the widest
    at.session_state[worst.key] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Tokens"
    url = dict(at.query_params)
    assert {k: url.get(k) for k in ("run", "step", "inner", "mb", "rank", "seq", "token")} == {
        "run": "sampled", "step": "0", "inner": "0", "mb": "0", "rank": "0", "seq": "2", "token": "1"}
    assert marked_positions(at) == [("completion", 1)]
    reloaded = start(monkeypatch, root, url, page=TOKENS_PAGE)  # the reload: a new session on that URL
    assert not reloaded.exception, [e.value for e in reloaded.exception]
    assert reloaded.selectbox(key="sequence").value == 2
    assert marked_positions(reloaded) == [("completion", 1)]
