"""The Rollouts page through ``streamlit.testing.v1.AppTest`` on GRPO traces written by ``TraceWriter``:
the order of a sort by reward, the rows a search finds, pages, the link a row opens, the findings per
row and the page's state in the URL. Expected values are read from the step files themselves
(``safetensors.safe_open``: rewards, completion ids and masks, decoded with the toy vocabulary), not
from the page's own reader."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from safetensors import safe_open
from streamlit.testing.v1 import AppTest

from app.components.rollouts import PAGE_SIZE
from tracer.checks import run_checks

from tests.fixtures.toy_traces import APP, VOCAB, ToyTokenizer, write_trace

PAGE = "app_pages/rollouts.py"
STEPS = 9  # 9 steps x 2 inner steps x 4 rows = 72 completions: two pages of PAGE_SIZE = 50


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rollouts")
    write_trace(root / "run", tokenizer=ToyTokenizer(), steps=STEPS)
    return root


def file_rows(run: Path) -> list[dict]:
    """Every completion of ``run`` read straight from its step files, in file order (step, inner
    step, micro-batch, rank, row): coordinates, reward and the text of its kept tokens."""
    rows = []
    for path in (run / "steps").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            rewards, ids, mask = f.get_tensor("rewards"), f.get_tensor("completion_ids"), f.get_tensor("completion_mask")
        for b in range(rewards.shape[0]):
            rows.append({"step": int(meta["step"]), "inner_step": int(meta["inner_step"]),
                         "micro_batch": int(meta["micro_batch"]), "rank": int(meta["rank"]), "seq": b,
                         "reward": float(rewards[b]),
                         "text": "".join(VOCAB[i] for i, keep in zip(ids[b].tolist(), mask[b].tolist()) if keep)})
    return sorted(rows, key=lambda r: (r["step"], r["inner_step"], r["micro_batch"], r["rank"], r["seq"]))


def open_rollouts(monkeypatch, root: Path, query: dict[str, str]) -> AppTest:
    """A new session opened on ``/rollouts?…`` (the URL a user pastes)."""
    monkeypatch.setenv("TRACER_ROOT", str(root))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update(query)
    at.switch_page(PAGE)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Rollouts"
    return at


def table(at: AppTest):
    frames = [d.value for d in at.dataframe if "tokens" in d.value.columns and "reward" in d.value.columns]
    assert len(frames) == 1, [list(d.value.columns) for d in at.dataframe]
    return frames[0]


def where(frame) -> list[tuple[int, int, int]]:
    return list(zip(frame["step"].tolist(), frame["inner_step"].tolist(), frame["seq"].tolist()))


def test_sort_by_reward_gives_the_order_of_the_step_files_rewards(monkeypatch, root):
    at = open_rollouts(monkeypatch, root, {"run": "run"})
    at.selectbox(key="ro_sort").select("reward").run()
    at.toggle(key="ro_descending").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    # highest reward first; a tie keeps file order (step 7 inner 1 row 0 and step 8 inner 1 row 1: both 108)
    expected = sorted(file_rows(root / "run"), key=lambda r: -r["reward"])  # sorted() is stable
    shown = table(at)
    assert where(shown) == [(r["step"], r["inner_step"], r["seq"]) for r in expected[:PAGE_SIZE]]
    assert shown["reward"].tolist() == [r["reward"] for r in expected[:PAGE_SIZE]]
    assert at.query_params["sort"] == "reward" and at.query_params["dir"] == "desc"


@pytest.mark.parametrize("query", ["NO", "yes", "<b>"])
def test_search_finds_exactly_the_rows_whose_kept_text_contains_it(monkeypatch, root, query):
    at = open_rollouts(monkeypatch, root, {"run": "run"})
    at.text_input(key="ro_search").input(query).run()
    assert not at.exception, [e.value for e in at.exception]
    # " no" of row 3 is masked (tool output): "NO" finds row 1 of each file only, not row 3
    expected = [(r["step"], r["inner_step"], r["seq"]) for r in file_rows(root / "run")
                if query.lower() in r["text"].lower()]
    assert 0 < len(expected) <= PAGE_SIZE
    assert where(table(at)) == expected
    assert at.query_params["search"] == query
    assert at.text[0].value == f"rows 1-{len(expected)} of {len(expected)} shown (72 in the run) · page 1 of 1"


def test_pages_send_fifty_rows_and_a_filter_goes_back_to_page_one(monkeypatch, root):
    rows = file_rows(root / "run")
    at = open_rollouts(monkeypatch, root, {"run": "run"})
    assert where(table(at)) == [(r["step"], r["inner_step"], r["seq"]) for r in rows[:PAGE_SIZE]]
    at.number_input(key="ro_page").set_value(2).run()
    assert where(table(at)) == [(r["step"], r["inner_step"], r["seq"]) for r in rows[PAGE_SIZE:]]
    assert at.query_params["page"] == "2"
    assert at.text[0].value == "rows 51-72 of 72 shown (72 in the run) · page 2 of 2"
    at.number_input(key="ro_step_min").set_value(3).run()  # other rows: page 1 of them
    assert at.number_input(key="ro_page").value == 1 and "page" not in at.query_params
    assert where(table(at)) == [(r["step"], r["inner_step"], r["seq"]) for r in rows if r["step"] >= 3][:PAGE_SIZE]


def test_a_row_link_opens_its_sequence_on_the_tokens_page(monkeypatch, root):
    at = open_rollouts(monkeypatch, root, {"run": "run", "sort": "reward", "dir": "desc"})
    first = table(at).iloc[0]  # step 8, inner 1, row 0: the highest reward
    assert first["tokens"] == "tokens?run=run&step=8&inner=1&mb=0&rank=0&seq=0"
    monkeypatch.setenv("TRACER_ROOT", str(root))
    tokens = AppTest.from_file(str(APP), default_timeout=60)
    tokens.query_params.update({k: v[0] for k, v in parse_qs(urlsplit(first["tokens"]).query).items()})
    tokens.switch_page("app_pages/tokens.py")
    tokens.run()
    assert not tokens.exception, [e.value for e in tokens.exception]
    assert tokens.title[0].value == "Tokens"
    assert tokens.selectbox(key="step_file").value == "step 8 · inner 1 · mb 0 · rank 0"
    assert tokens.selectbox(key="sequence").value == 0


def test_url_state_round_trips_into_the_widgets_and_back(monkeypatch, root):
    query = {"run": "run", "sort": "length", "dir": "desc", "search": "yes", "step_min": "2", "step_max": "5",
             "reward_min": "2.4", "group_id": "1"}
    at = open_rollouts(monkeypatch, root, query)
    assert at.selectbox(key="ro_sort").value == "length" and at.toggle(key="ro_descending").value is True
    assert at.text_input(key="ro_search").value == "yes"
    assert (at.number_input(key="ro_step_min").value, at.number_input(key="ro_step_max").value) == (2, 5)
    assert at.number_input(key="ro_reward_min").value == 2.4 and at.number_input(key="ro_group").value == 1
    assert {k: at.query_params[k] for k in query} == query
    # rows 2 and 3 of each file are group 1 and contain " yes"; reward >= 2.4 drops row 3 of step 2 inner 0 (2.25; 2.5 is
    # kept); sorted by kept length, longest first (row 2: 4 tokens, row 3: 3), ties in file order
    rows = [r for r in file_rows(root / "run") if 2 <= r["step"] <= 5 and r["seq"] in (2, 3) and r["reward"] >= 2.4]
    lengths = {2: 4, 3: 3}
    expected = sorted(rows, key=lambda r: -lengths[r["seq"]])
    assert where(table(at)) == [(r["step"], r["inner_step"], r["seq"]) for r in expected]
    at.selectbox(key="ro_sort").select("advantage").run()
    assert at.query_params["sort"] == "advantage" and at.query_params["search"] == "yes"
    again = open_rollouts(monkeypatch, root, dict(at.query_params))
    assert where(table(again)) == where(table(at))


def test_other_pages_parameters_are_not_read_as_a_search_or_a_group(monkeypatch, root):
    # the Step page's quantity (q) and the Groups page's group, left in the URL by those pages
    at = open_rollouts(monkeypatch, root, {"run": "run", "q": "ratio", "group": "1"})
    assert at.text_input(key="ro_search").value == "" and at.number_input(key="ro_group").value is None
    assert at.text[0].value == "rows 1-50 of 72 shown (72 in the run) · page 1 of 2"


def test_findings_column_counts_tracer_checks_errors_at_each_row(monkeypatch, tmp_path):
    def keep_after_eos(step, inner, tensors):
        if (step, inner) == (1, 0):
            tensors["completion_mask"][0, 3] = True  # row 0 keeps a position after its EOS (position 2)

    write_trace(tmp_path / "buggy", tokenizer=ToyTokenizer(), steps=3, edit=keep_after_eos)
    located = {}
    for f in run_checks(tmp_path / "buggy"):
        if f.severity in ("error", "warning") and f.sequence is not None:
            at_row = (f.step, f.inner_step, f.sequence)
            located[at_row] = located.get(at_row, 0) + 1
    assert located.get((1, 0, 0), 0) >= 1  # the deliberate bug is found there
    at = open_rollouts(monkeypatch, tmp_path, {"run": "buggy"})
    shown = table(at)
    assert [located.get(w, 0) for w in where(shown)] == [int(n) for n in shown["findings"]]
    at.toggle(key="ro_flagged").set_value(True).run()
    assert sorted(where(table(at))) == sorted(located)
    assert at.query_params["flagged"] == "1"


def test_selecting_a_row_opens_its_tokens_in_the_same_tab(monkeypatch, root):
    at = open_rollouts(monkeypatch, root, {"run": "run", "sort": "reward", "dir": "desc"})
    second = table(at).iloc[1]  # step 8, inner 1: rewards 109, 108, 108.5, 108.25 -> row 2 is second
    assert (second["step"], second["inner_step"], second["seq"]) == (8, 1, 2)
    listing = next(d for d in at.dataframe if "tokens" in d.value.columns)
    at.session_state[listing.key] = {"selection": {"rows": [1], "columns": []}}  # the row's selection box
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="step_file").value == "step 8 · inner 1 · mb 0 · rank 0"
    assert at.selectbox(key="sequence").value == 2
    assert {k: at.query_params[k] for k in ("step", "inner", "seq")} == {"step": "8", "inner": "1", "seq": "2"}


def test_a_run_past_the_bound_is_not_checked_until_asked(monkeypatch, root):
    from app.components import runs

    size = sum(p.stat().st_size for p in (root / "run" / "steps").glob("*.safetensors"))  # 18 step files
    monkeypatch.setattr(runs, "MAX_CHECKED_BYTES", size + 18 * runs.FILE_OVERHEAD_BYTES - 1)  # one byte short
    at = open_rollouts(monkeypatch, root, {"run": "run"})
    assert set(table(at)["findings"]) == {"not checked"}
    assert at.toggle(key="ro_flagged").disabled
    budget = (size + 18 * runs.FILE_OVERHEAD_BYTES - 1) / 1e6
    assert (f"Findings: not checked. tracer check reads every step file: this run has 18 ({size / 1e6:.3g} MB); "
            f"runs of up to {budget:g} MB of step files (each file counted {runs.FILE_OVERHEAD_BYTES / 1e3:g} kB "
            "more) are checked without asking.") in [c.value for c in at.caption]
    at.button[0].click().run()
    assert not at.exception, [e.value for e in at.exception]
    located = {}
    for f in run_checks(root / "run"):
        if f.severity in ("error", "warning") and f.sequence is not None:
            located[(f.step, f.inner_step, f.sequence)] = located.get((f.step, f.inner_step, f.sequence), 0) + 1
    shown = table(at)
    assert [str(located.get(w, 0)) for w in where(shown)] == shown["findings"].tolist()
    assert not at.toggle(key="ro_flagged").disabled


def test_another_run_keeps_the_page_working_with_its_own_columns(monkeypatch, root, tmp_path):
    # a run whose rows record sampler_logprobs sorted by |old - sampler|, then a run that does not
    other = tmp_path / "runs"
    write_trace(other / "a_with_sampler", tokenizer=ToyTokenizer(), steps=9)

    def no_sampler(step, inner, tensors):
        del tensors["sampler_logprobs"]

    write_trace(other / "b_without", tokenizer=ToyTokenizer(), steps=2, edit=no_sampler)
    at = open_rollouts(monkeypatch, other, {"run": "a_with_sampler", "sort": "mean_abs_mismatch", "page": "2"})
    assert at.selectbox(key="ro_sort").value == "mean_abs_mismatch" and at.number_input(key="ro_page").value == 2
    at.selectbox(key="run").select(other / "b_without").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "mean_abs_mismatch" not in table(at).columns
    assert at.selectbox(key="ro_sort").value == "file order" and at.number_input(key="ro_page").value == 1
    assert "sort" not in at.query_params and at.query_params["run"] == "b_without"


def test_leaving_the_page_takes_its_parameters_out_of_the_url(monkeypatch, root):
    at = open_rollouts(monkeypatch, root, {"run": "run", "sort": "reward", "dir": "desc", "search": "yes",
                                           "page": "1", "step_min": "1"})
    at.switch_page("app_pages/tokens.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not {"sort", "dir", "search", "step_min"} & set(at.query_params)
    assert at.query_params["run"] == "run"
