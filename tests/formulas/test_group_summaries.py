"""Zero-variance group counts in the step summary (the Groups page's first view read every
step's rewards): ``formulas.zero_variance_groups`` against a plain loop over groups, the writer's
header counts, and ``views.zero_variance_shares`` from the summaries equal to the same view reading
tensors (the summaries hidden), with micro-batches that split groups, files without group_ids, NaN
rewards, B = 0 and traces written before the keys existed."""

from __future__ import annotations

import math
from unittest import mock

import pandas as pd
import pytest
import torch

from tracer import formulas, views
from tracer.format import summary as summary_format
from tracer.read import Trace

from tests.fixtures.paths import REPO
from tests.fixtures.view_traces import grpo_step, write_grpo


def _loop_counts(rewards: list[float], group_ids: list[int]) -> tuple[int, int]:
    """(groups, zero-variance groups) by a plain loop: every reward of a group equals its first."""
    groups: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        groups.setdefault(g, []).append(r)
    return len(groups), sum(all(r == rs[0] for r in rs) for rs in groups.values())


def test_zero_variance_groups_equals_a_loop_over_groups():
    g = torch.Generator().manual_seed(0)
    S, B = 50, 12
    rewards = torch.randint(0, 3, (S, B), generator=g).float()  # few values: many equal groups
    rewards[3, 5] = float("nan")  # a NaN equals nothing: its group never counts
    rewards[7, :] = float("nan")
    group_ids = torch.randint(0, 5, (S, B), generator=g) * 7 - 3  # unsorted, negative, gaps
    groups, zero = formulas.zero_variance_groups(rewards, group_ids)
    expected = [_loop_counts(r, i) for r, i in zip(rewards.tolist(), group_ids.tolist())]
    assert list(zip(groups.tolist(), zero.tolist())) == expected
    assert zero[7].item() == 0 and groups[7].item() > 0


def test_zero_variance_groups_by_hand():
    # groups 2: (1, 1) zero; 0: (0, 1) not; 9: (5) a single reward is zero variance
    rewards = torch.tensor([[1.0, 0.0, 1.0, 5.0, 1.0]])
    ids = torch.tensor([[2, 0, 2, 9, 0]])
    groups, zero = formulas.zero_variance_groups(rewards, ids)
    assert (groups.item(), zero.item()) == (3, 2)
    groups, zero = formulas.zero_variance_groups(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.long))
    assert groups.tolist() == [0, 0] and zero.tolist() == [0, 0]


def test_the_header_summary_counts_groups_from_ids_or_num_generations(tmp_path):
    trace = write_grpo(tmp_path / "g", [
        (0, grpo_step([1.0, 1.0, 1.0, 0.0, 1.0, 2.0], [0, 0, 0, 1, 1, 1]), 0),  # ids: groups 0 (zero), 1
        (1, grpo_step([2.0, 2.0, 2.0, 0.0, 0.0, 1.0]), 0),  # num_generations = 3: rows 0-2 (zero), 3-5
    ])
    first, second = (summary_format.read_summary(trace.metadata(k)) for k in trace.steps())
    assert (first["groups"], first["zero_variance_groups"], first["group_ids_recorded"]) == (2, 1, 1)
    assert (second["groups"], second["zero_variance_groups"], second["group_ids_recorded"]) == (2, 1, 0)


def _steps():
    return [
        (0, grpo_step([1.0, 1.0, 1.0, 0.0, 1.0, 2.0], [0, 0, 0, 1, 1, 1]), 0),
        # step 1: group 5 split over two micro-batches with equal rewards (one zero-variance group),
        # group 6 split with different rewards, group 7 whole and zero variance
        (1, grpo_step([2.0, 2.0, 0.0], [5, 5, 6]), 0),
        (1, grpo_step([2.0, 1.0, 3.0, 3.0, 3.0], [5, 6, 7, 7, 7]), 1),
        (2, grpo_step([4.0, 4.0, 4.0, float("nan"), 1.0, 1.0]), 0),  # no group_ids: G = 3 rows each
        (3, grpo_step([0.5, 0.5, 0.5]), 0),  # two micro-batches without ids: never pooled
        (3, grpo_step([0.5, 0.5, 0.25]), 1),
    ]


def _from_tensors(trace: Trace) -> pd.DataFrame:
    """The view with no summary (what it did before the counts existed)."""
    with mock.patch.object(views.groups, "_summarised_group_counts",
                           lambda keys, summary: ([False] * len(keys), {})):
        return views.zero_variance_shares(trace, pd.DataFrame())


def test_shares_from_summaries_equal_shares_from_tensors_and_read_only_pooled_files(tmp_path):
    trace = write_grpo(tmp_path / "g", _steps())
    expected = _from_tensors(trace)
    # by hand: step 0: 2 groups, 1 zero; step 1: 5, 6, 7 -> 3 groups, 2 zero; step 2: (4,4,4) zero,
    # (nan,1,1) not -> 2, 1; step 3: (0.5 x3) zero, (0.5, 0.5, 0.25) not -> 2, 1
    assert expected["groups"].tolist() == [2, 3, 2, 2] and expected["zero_variance_groups"].tolist() == [1, 2, 1, 1]
    loaded = []
    real = Trace.load_step
    with mock.patch.object(Trace, "load_step", lambda self, key, *a, **k: loaded.append(key.step) or real(self, key, *a, **k)):
        shares = views.zero_variance_shares(trace)
    pd.testing.assert_frame_equal(shares, expected, check_exact=True)
    assert sorted(loaded) == [1, 1]  # only step 1's two files, whose group_ids may span both


def test_traces_without_the_counts_are_read_from_tensors(tmp_path):
    trace = write_grpo(tmp_path / "g", _steps())
    expected = _from_tensors(trace)
    summary = trace.step_summary().drop(columns=list(summary_format.GROUP_KEYS))  # an older trace's summaries
    pd.testing.assert_frame_equal(views.zero_variance_shares(trace, summary), expected, check_exact=True)
    partial = trace.step_summary()
    partial.loc[0, "groups"] = math.nan  # one file whose summary lacks them
    pd.testing.assert_frame_equal(views.zero_variance_shares(trace, partial), expected, check_exact=True)


def test_the_groups_page_first_view_uses_the_summaries(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from app.components import trace_cache

    write_grpo(tmp_path / "root" / "g", [(s, grpo_step([1.0, 1.0, 1.0, 0.0, 1.0, 2.0], [0, 0, 0, 1, 1, 1]), 0)
                                         for s in range(4)])
    monkeypatch.setenv("TRACER_ROOT", str(tmp_path / "root"))
    loaded = []
    real = Trace.load_step
    monkeypatch.setattr(Trace, "load_step", lambda self, key, *a, **k: loaded.append(key.step) or real(self, key, *a, **k))
    at = AppTest.from_file(str(REPO / "app" / "streamlit_app.py"), default_timeout=120)
    # a step in the link: without one the app opens the run at its most informative step, which runs
    # tracer check (reading every step file) to find it: not what this test is about
    at.query_params.update({"run": "g", "step": "0"})
    trace_cache.clear_caches()
    at.switch_page("app_pages/groups.py").run()
    assert not at.exception, [e.value for e in at.exception]
    table = next(d.value for d in at.dataframe if "zero_variance_share" in d.value.columns)
    assert table["zero_variance_share"].tolist() == pytest.approx([0.5] * 4)
    assert set(loaded) <= {0}  # the chosen step's own rows (its group table), never the other steps'
