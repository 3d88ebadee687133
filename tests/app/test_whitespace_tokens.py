"""A token made only of whitespace (a space, a newline, a tab) is visible on every page that shows
token text, through the one helper ``token_table.visible_token`` (``␣``, ``⏎``, ``⇥``): the tables
of the Step, PPO, DPO, Mismatch, Health and Diff pages and the hovers of their figures. Driven with
``AppTest`` on traces written in tmp_path (toy GRPO) or on copies of the sample traces whose
``tokens.json`` maps some ids to whitespace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.fixtures.toy_traces import SAMPLES, VOCAB, ToyTokenizer, frame_with, start, write_trace

MARKERS = {" ": "␣", "\n": "⏎", "\t": "⇥"}
SPACE, NEWLINE = 7, 6  # toy ids made whitespace: row 0 starts with 7, row 1 has 6 at position 1


def whitespace_vocab() -> list[str]:
    vocab = list(VOCAB)
    vocab[SPACE], vocab[NEWLINE] = " ", "\n"
    return vocab


def invisible(text: object) -> bool:
    """True for a cell a reader cannot see: whitespace only, or empty."""
    return isinstance(text, str) and (text == "" or text.isspace())


def hover_texts(at) -> list[str]:
    """Every string in the customdata of every Plotly figure of the page (what the hovers show)."""
    out: list[str] = []

    def walk(value):
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for chart in at.get("plotly_chart"):
        for trace in json.loads(chart.proto.spec)["data"]:
            walk(trace.get("customdata", []))
    return out


def assert_markers_only(cells, hovers=None) -> None:
    """No invisible cell, and the markers are there (so the tokens really were whitespace)."""
    cells = list(cells)
    assert not [c for c in cells if invisible(c)], cells
    assert {"␣", "⏎"} & set(cells), cells
    if hovers is not None:
        assert not [h for h in hovers if invisible(h)], hovers
        assert {"␣", "⏎"} & set(hovers), hovers


def sample_with_whitespace(tmp_path: Path, name: str) -> Path:
    """A copy of sample trace ``name`` whose tokens.json maps every id >= 2 with id % 3 == 0 to a
    space and id % 3 == 1 to a newline (ids 0 and 1, pad and EOS, keep their strings)."""
    run = tmp_path / "runs" / name
    shutil.copytree(SAMPLES / name, run)
    path = run / "tokens.json"
    table = json.loads(path.read_text(encoding="utf-8"))
    table["tokens"] = [t if i < 2 or i % 3 == 2 else (" " if i % 3 == 0 else "\n")
                       for i, t in enumerate(table["tokens"])]
    path.write_text(json.dumps(table), encoding="utf-8")
    return run


needs = pytest.mark.skipif(not all((SAMPLES / n).is_dir() for n in ("ppo-tiny", "dpo-tiny")),
                           reason="the sample traces are not in this checkout")


@pytest.fixture(scope="module")
def toy_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("whitespace")
    write_trace(root / "run", tokenizer=ToyTokenizer(whitespace_vocab()), steps=1)
    return root


def test_step_page_table(monkeypatch, toy_root):
    at = start(monkeypatch, toy_root / "run")
    at.switch_page("app_pages/step.py").run()
    assert not at.exception, [e.value for e in at.exception]
    table = frame_with(at, {"open", "sequence", "position", "token_text"}).value
    cell = table.loc[(table["sequence"] == 0) & (table["position"] == 0), "token_text"]
    assert cell.tolist() == ["␣"]  # row 0 starts with id 7, a space
    assert_markers_only(table["token_text"])


def test_mismatch_page_worst_tokens_and_hovers(monkeypatch, toy_root):
    at = start(monkeypatch, toy_root / "run")
    at.switch_page("app_pages/mismatch.py").run()
    assert not at.exception, [e.value for e in at.exception]
    worst = frame_with(at, {"sequence", "token", "token_text", "log_diff"}).value
    # the toy step keeps 12 tokens (< 20): every kept token is listed; each shows its id's marker
    ids = {(0, 0): SPACE, (1, 1): NEWLINE, (2, 1): SPACE}  # grpo_step_tensors' completion_ids
    for (sequence, token), token_id in ids.items():
        row = worst[(worst["sequence"] == sequence) & (worst["token"] == token)]
        assert row["token_text"].tolist() == [MARKERS[whitespace_vocab()[token_id]]]
    assert_markers_only(worst["token_text"], hover_texts(at))


def test_health_page_findings_table(monkeypatch, tmp_path):
    def space_after_eos(step, inner_step, tensors):  # row 0: 7 <script> <eos> | then a kept space
        if inner_step == 0:
            tensors["completion_ids"][0, 3] = SPACE
            tensors["completion_mask"][0, 3] = True

    write_trace(tmp_path / "run", tokenizer=ToyTokenizer(whitespace_vocab()), steps=1, edit=space_after_eos)
    at = start(monkeypatch, tmp_path / "run")
    at.switch_page("app_pages/health.py").run()
    assert not at.exception, [e.value for e in at.exception]
    findings = frame_with(at, {"check", "sequence", "token", "token_text"}).value
    bug = findings[findings["check"] == "masks.after_eos"]
    assert bug[["sequence", "token", "token_text"]].values.tolist() == [[0, 3, "␣"]]


def test_diff_page_side_by_side(monkeypatch, tmp_path):
    def shift(step, inner_step, tensors):  # row 2 is " yes" 7 "<b>" "<eos>": change token 1, a space
        if inner_step == 1:
            tensors["policy_logprobs"][2, 1] += 0.5

    tokenizer = ToyTokenizer(whitespace_vocab())
    write_trace(tmp_path / "a_base", tokenizer=tokenizer, steps=1)
    write_trace(tmp_path / "b_changed", tokenizer=tokenizer, steps=1, edit=shift)
    at = start(monkeypatch, tmp_path)
    at.switch_page("app_pages/diff.py").run()
    at.selectbox(key="diff_a").select(tmp_path / "a_base").run()
    at.selectbox(key="diff_b").select(tmp_path / "b_changed").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="diff_sequence").value == 2  # opened on the divergence
    view = frame_with(at, {"token_text_a", "token_text_b", "differs"}).value
    row = view[view["position"] == 1]
    assert row[["token_text_a", "token_text_b", "differs"]].values.tolist() == [["␣", "␣", "policy_logprobs"]]
    assert not [c for c in [*view["token_text_a"], *view["token_text_b"]] if invisible(c)]


@needs
def test_ppo_page_table_and_hovers(monkeypatch, tmp_path):
    run = sample_with_whitespace(tmp_path, "ppo-tiny")
    monkeypatch.setenv("TRACER_ROOT", str(run))
    at = start(monkeypatch, run)
    at.switch_page("app_pages/ppo.py").run()
    assert not at.exception, [e.value for e in at.exception]
    table = frame_with(at, {"position", "token_text", "token_rewards"}).value
    assert_markers_only(table["token_text"], hover_texts(at))


@needs
def test_dpo_page_pair_table_and_hovers(monkeypatch, tmp_path):
    run = sample_with_whitespace(tmp_path, "dpo-tiny")
    at = start(monkeypatch, run)
    at.switch_page("app_pages/dpo.py").run()
    assert not at.exception, [e.value for e in at.exception]
    pair = frame_with(at, {"chosen_token_text", "rejected_token_text"}).value
    cells = [c for c in [*pair["chosen_token_text"], *pair["rejected_token_text"]] if isinstance(c, str)]
    assert_markers_only(cells, hover_texts(at))
