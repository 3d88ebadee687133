"""Choices that live in the URL and come back from it: the Diff page's pair (``?a=&b=``, the
sidebar's run choosers hidden there, the page naming the two runs instead), and the token a Health
finding marks (``token=`` on the Tokens page it opens), which goes when another sequence is chosen.
Each round trip starts a new session on the URL the first one left, as a copied link would."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.toy_traces import (
    TOKENS_PAGE, ToyTokenizer, frame_with, largest_frame_with, start, styled_rows, write_trace)

DIFF_PAGE = "app_pages/diff.py"
HIGHLIGHT = "#ffd54f"  # token_table.HIGHLIGHT_STYLE's background
BUG_STEP, BUG_SEQUENCE, BUG_TOKEN = 1, 0, 3


def keep_bold_after_eos(step: int, inner_step: int, tensors) -> None:
    """Step 1, inner 0, row 0: ``<b>`` (id 8) kept right after the EOS at completion position 3."""
    if (step, inner_step) == (BUG_STEP, 0):
        tensors["completion_ids"][BUG_SEQUENCE, BUG_TOKEN] = 8
        tensors["completion_mask"][BUG_SEQUENCE, BUG_TOKEN] = True


def shift_one_logprob(step: int, inner_step: int, tensors) -> None:
    if (step, inner_step) == (1, 1):
        tensors["policy_logprobs"][2, 1] += 0.5


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("urls")
    write_trace(root / "a_base", tokenizer=ToyTokenizer(), steps=2)
    write_trace(root / "b_changed", tokenizer=ToyTokenizer(), steps=2, edit=shift_one_logprob)
    write_trace(root / "c_buggy", tokenizer=ToyTokenizer(), steps=2, edit=keep_bold_after_eos)
    return root


def _in_url(at) -> dict[str, str]:
    return dict(at.query_params)


def test_the_diff_pair_round_trips_through_the_url(monkeypatch, root):
    at = start(monkeypatch, root, {"a": "b_changed", "b": "a_base"}, page=DIFF_PAGE)
    assert not at.exception, [e.value for e in at.exception]
    assert (at.selectbox(key="diff_a").value, at.selectbox(key="diff_b").value) == (root / "b_changed", root / "a_base")
    assert "Comparing a = b_changed with b = a_base." in [t.value for t in at.text]
    assert at.error[0].value.startswith("different: 1 finding")
    at.selectbox(key="diff_b").select(root / "c_buggy").run()
    assert (_in_url(at)["a"], _in_url(at)["b"]) == ("b_changed", "c_buggy")

    again = start(monkeypatch, root, _in_url(at), page=DIFF_PAGE)  # the copied link
    assert not again.exception, [e.value for e in again.exception]
    assert (again.selectbox(key="diff_a").value, again.selectbox(key="diff_b").value) == (
        root / "b_changed", root / "c_buggy")
    # another page keeps only its own parameters: the pair is not carried to the Tokens page's URL
    again.switch_page(TOKENS_PAGE).run()
    assert "a" not in again.query_params and "b" not in again.query_params


def test_a_diff_url_naming_no_trace_says_so(monkeypatch, root):
    at = start(monkeypatch, root, {"a": "../elsewhere", "b": "a_base"}, page=DIFF_PAGE)
    assert not at.exception, [e.value for e in at.exception]
    assert at.warning[0].value.startswith("The URL's a= names no trace under the root")
    assert "a=../elsewhere" in [t.value for t in at.text]
    assert at.selectbox(key="diff_b").value == root / "a_base"
    assert at.query_params["a"] != "../elsewhere"  # the pair shown is what the URL now says


def test_the_sidebar_run_choosers_are_hidden_on_diff_only(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "c_buggy", "step": "1", "seq": "2"}, page=TOKENS_PAGE)
    assert at.sidebar.selectbox(key="run").value == root / "c_buggy"
    at.switch_page(DIFF_PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    assert [s.key for s in at.sidebar.selectbox] == []  # no Run, Step file or Sequence chooser
    assert at.sidebar.button[0].label == "Reload"  # the root and Reload stay
    at.selectbox(key="diff_b").select(root / "a_base").run()  # a rerun on Diff
    at.query_params.clear()  # the navigation menu opens a page without the query string
    at.switch_page(TOKENS_PAGE).run()  # back: the choice made before Diff is still there
    assert at.sidebar.selectbox(key="run").value == root / "c_buggy"
    assert at.selectbox(key="step_file").value == "step 1 · inner 0 · mb 0 · rank 0"
    assert at.selectbox(key="sequence").value == 2


def _marked_rows(at) -> set[int]:
    tokens = largest_frame_with(at, {"section", "position", "token_text"})
    return styled_rows(tokens.proto.arrow_data.styler.styles, HIGHLIGHT)


def test_the_token_a_finding_marks_round_trips_through_the_url(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "c_buggy"}, page="app_pages/health.py")
    findings = frame_with(at, {"check", "sequence", "token", "token_text"})
    bug = findings.value.index[findings.value["check"] == "masks.after_eos"][0]
    at.session_state[findings.key] = {"selection": {"rows": [int(bug)], "columns": [], "cells": []}}
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Tokens"
    url = _in_url(at)
    assert {k: url[k] for k in ("run", "step", "inner", "mb", "rank", "seq", "token")} == {
        "run": "c_buggy", "step": str(BUG_STEP), "inner": "0", "mb": "0", "rank": "0", "seq": str(BUG_SEQUENCE),
        "token": str(BUG_TOKEN)}
    marked = _marked_rows(at)
    assert len(marked) == 1

    again = start(monkeypatch, root, url, page=TOKENS_PAGE)  # the copied link, in a new session
    assert not again.exception, [e.value for e in again.exception]
    assert again.selectbox(key="step_file").value == f"step {BUG_STEP} · inner 0 · mb 0 · rank 0"
    assert again.selectbox(key="sequence").value == BUG_SEQUENCE
    rows = largest_frame_with(again, {"section", "position", "token_text"}).value
    assert _marked_rows(again) == set(rows.index[(rows["section"] == "completion")
                                                 & (rows["position"] == BUG_TOKEN)]) == marked

    # another sequence: the token belonged to the one before, so it leaves the URL and nothing is marked
    again.selectbox(key="sequence").select(1).run()
    assert "token" not in again.query_params and again.query_params["seq"] == "1"
    assert _marked_rows(again) == set()

    # another run: the token named a place in the other run's sequence
    again = start(monkeypatch, root, url, page=TOKENS_PAGE)
    again.selectbox(key="run").select(root / "a_base").run()
    assert not again.exception, [e.value for e in again.exception]
    assert "token" not in again.query_params and again.query_params["run"] == "a_base"
    assert _marked_rows(again) == set()
