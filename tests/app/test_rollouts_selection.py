"""The Rollouts page's table logic (app.components.rollouts) on hand-built frames: filters, literal
case-insensitive search, a stable sort with NaN last, pages, the URL form of the query, the findings
counted per row, the link to a row's tokens and the columns shown."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from app.components.health import findings_frame
from app.components.rollouts import (
    FINDINGS, NOT_CHECKED, TOKENS_LINK, RolloutQuery, RolloutStore, display_rows, page_count, page_rows,
    row_finding_counts, select_rollouts, shown_columns, summary_text, tokens_link)
from tracer.checks import Finding


def hand_frame() -> pd.DataFrame:
    """Six completions: steps 0..2, two rows each; reward NaN on one row, tied rewards on two."""
    return pd.DataFrame({
        "step": [0, 0, 1, 1, 2, 2], "inner_step": 0, "micro_batch": 0, "rank": 0, "seq": [0, 1, 0, 1, 0, 1],
        "group": [0, 0, 0, 0, 1, 1], "reward": [0.5, 1.0, math.nan, 0.5, 2.0, -1.0],
        "reward/format": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
        "length": [3.0, 5.0, 1.0, 4.0, 2.0, 6.0], "mean_abs_mismatch": math.nan,
        "text": ["The answer is 4", "a.b", "axb", "THE END", None, "no answer"],
        "text_truncated": [False, False, False, True, False, False]})


def keys(frame: pd.DataFrame) -> list[tuple[int, int]]:
    return list(zip(frame["step"], frame["seq"]))


def test_filters_keep_inclusive_ranges_and_drop_nan_rewards_under_a_bound():
    frame = hand_frame()
    assert keys(select_rollouts(frame, RolloutQuery(step_min=1, step_max=1))) == [(1, 0), (1, 1)]
    # reward in [0.5, 2]: 0.5, 1.0, 0.5, 2.0; the NaN reward of (1, 0) is not in any range
    assert keys(select_rollouts(frame, RolloutQuery(reward_min=0.5, reward_max=2.0))) == [(0, 0), (0, 1), (1, 1),
                                                                                          (2, 0)]
    assert keys(select_rollouts(frame, RolloutQuery(group=1))) == [(2, 0), (2, 1)]
    assert keys(select_rollouts(frame, RolloutQuery())) == keys(frame)  # the default shows every row


def test_search_is_a_literal_substring_ignoring_case():
    frame = hand_frame()
    assert keys(select_rollouts(frame, RolloutQuery(search="the"))) == [(0, 0), (1, 1)]  # "The", "THE"
    assert keys(select_rollouts(frame, RolloutQuery(search="a.b"))) == [(0, 1)]  # not the pattern a.b ("axb")
    assert keys(select_rollouts(frame, RolloutQuery(search="answer", step_min=2))) == [(2, 1)]


def test_sort_is_stable_with_nan_last_in_both_directions():
    frame = hand_frame()
    up = select_rollouts(frame, RolloutQuery(sort="reward"))
    # -1, 0.5 (0,0), 0.5 (1,1) in file order, 1, 2, then NaN
    assert keys(up) == [(2, 1), (0, 0), (1, 1), (0, 1), (2, 0), (1, 0)]
    down = select_rollouts(frame, RolloutQuery(sort="reward", descending=True))
    assert keys(down) == [(2, 0), (0, 1), (0, 0), (1, 1), (2, 1), (1, 0)]
    with pytest.raises(KeyError, match="no column 'ratio' to sort by"):
        select_rollouts(frame, RolloutQuery(sort="ratio"))


def test_flagged_keeps_rows_with_findings_only_when_counted():
    frame = hand_frame().assign(**{FINDINGS: [0, 2, 0, 1, 0, 0]})
    assert keys(select_rollouts(frame, RolloutQuery(flagged=True))) == [(0, 1), (1, 1)]
    unchecked = hand_frame().assign(**{FINDINGS: math.nan})
    assert len(select_rollouts(unchecked, RolloutQuery(flagged=True))) == 6


def test_pages_cut_the_rows_and_clamp_the_page_number():
    frame = pd.DataFrame({"n": range(120)})
    assert page_count(120, 50) == 3 and page_count(0, 50) == 1 and page_count(100, 50) == 2
    rows, page = page_rows(frame, 3, 50)
    assert page == 3 and rows["n"].tolist() == list(range(100, 120))
    rows, page = page_rows(frame, 9, 50)  # past the end: the last page
    assert page == 3 and len(rows) == 20
    assert page_rows(frame.iloc[:0], 2, 50)[1] == 1
    assert summary_text(120, 6400, 3, 3, 50) == "rows 101-120 of 120 shown (6,400 in the run) · page 3 of 3"
    assert summary_text(0, 6400, 1, 1, 50) == "no row shown (6,400 in the run) · page 1 of 1"


def test_query_round_trips_through_url_parameters():
    query = RolloutQuery(sort="reward", descending=True, search="x y", page=3, step_min=2, step_max=9,
                         reward_min=-0.5, reward_max=1.25, group=4, flagged=True, first_pass=True)
    params = query.to_params()
    assert params == {"sort": "reward", "dir": "desc", "search": "x y", "page": "3", "step_min": "2", "step_max": "9",
                      "reward_min": "-0.5", "reward_max": "1.25", "group_id": "4", "flagged": "1", "first_pass": "1"}
    assert RolloutQuery.from_params(params) == query
    # the defaults write nothing (None removes the parameter)
    assert set(RolloutQuery().to_params().values()) == {None}
    # malformed values are left at their defaults
    assert RolloutQuery.from_params({"page": "0", "step_min": "x", "reward_max": "nan", "dir": "up"}) == RolloutQuery()
    assert query.filters() == RolloutQuery(search="x y", step_min=2, step_max=9, reward_min=-0.5, reward_max=1.25,
                                           group=4, flagged=True, first_pass=True)


def test_findings_are_counted_at_their_row_errors_and_warnings_only():
    frame = hand_frame()
    where = {"inner_step": 0, "micro_batch": 0, "rank": 0}
    findings = findings_frame([
        Finding("masks.after_eos", "error", "m", step=1, sequence=1, token=3, **where),
        Finding("masks.after_eos", "error", "m", step=1, sequence=1, token=4, **where),
        Finding("identity.first_step", "warning", "m", step=0, sequence=0, **where),
        Finding("health.clip_fraction", "info", "m", step=2, sequence=0, **where),  # info: not counted
        Finding("recompute.loss", "error", "m", step=2, **where),  # about the whole step file
        Finding("trace.unfinished", "info", "m"),  # about the whole trace
        Finding("masks.after_eos", "error", "m", step=0, sequence=1, inner_step=1, micro_batch=0, rank=0),  # other file
    ])
    assert row_finding_counts(frame, findings).tolist() == [1, 0, 0, 2, 0, 0]
    assert row_finding_counts(frame, findings.iloc[:0]).tolist() == [0] * 6


def test_a_row_links_to_its_tokens_with_the_sidebar_selection():
    row = {"step": 12, "inner_step": 1, "micro_batch": 2, "rank": 3, "seq": 7}
    assert tokens_link("runs/a b", row) == "tokens?run=runs%2Fa+b&step=12&inner=1&mb=2&rank=3&seq=7"


def test_shown_columns_leave_out_what_no_row_records():
    frame = hand_frame().assign(**{FINDINGS: 0})
    # mean_abs_mismatch is NaN everywhere; one micro-batch and one rank: not shown
    assert shown_columns(frame) == ["step", "inner_step", "seq", "group", "reward", "reward/format", "length",
                                    FINDINGS, "text"]
    table = display_rows(frame.iloc[2:4], shown_columns(frame), "r", checked=False)
    assert table[FINDINGS].tolist() == [NOT_CHECKED, NOT_CHECKED]
    assert table["text"].tolist() == ["axb", "THE END…"]  # a cut text ends in an ellipsis
    assert table[TOKENS_LINK].tolist() == ["tokens?run=r&step=1&inner=0&mb=0&rank=0&seq=0",
                                           "tokens?run=r&step=1&inner=0&mb=0&rank=0&seq=1"]
    assert display_rows(frame.iloc[:1], shown_columns(frame), "r", checked=True)[FINDINGS].tolist() == ["0"]
    ppo = frame.assign(group=-1, micro_batch=[0, 1, 0, 1, 0, 1])  # no groups, two micro-batches
    assert shown_columns(ppo)[:4] == ["step", "inner_step", "micro_batch", "seq"] and "group" not in shown_columns(ppo)


def test_store_keeps_the_most_recently_used_frames():
    store = RolloutStore(max_entries=2)
    a, b, c = (pd.DataFrame({"n": [i]}) for i in range(3))
    store.put(("a",), a)
    store.put(("b",), b)
    assert store.get(("a",)) is a  # a is now the most recent
    store.put(("c",), c)
    assert store.get(("b",)) is None and store.get(("a",)) is a and store.get(("c",)) is c
