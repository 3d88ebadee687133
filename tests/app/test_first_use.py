"""What a new user meets first in the web UI: the empty-root message gives commands that work (they
parse with the real CLI parser and open the traces it talks about), a run whose writer was killed
reads as ``tracer info`` says it, a whitespace-only token is visible, no project jargon ("the
seed"), and the note on hidden pages is shown once, collapsed, under the page list."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1.element_tree import Block

from app.components.groups import advantage_rule_text
from app.components.sidebar import resolve_root
from app.components.token_table import visible_token
from tracer.cli import _parser
from tracer.read.trace_info import trace_info

from tests.fixtures.toy_traces import REPO, TOKENS_PAGE, VOCAB, ToyTokenizer, start, write_trace


needs_symlinks = pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="needs POSIX symlinks")


def code_spans(markdown: str) -> list[str]:
    return re.findall(r"`([^`]+)`", markdown)


def tracer_commands(message: str) -> list[argparse.Namespace]:
    """Each ``python -m tracer ...`` command of ``message``, parsed by tracer's own CLI parser (an
    unknown option or a missing required one raises SystemExit: the test fails)."""
    out = []
    for span in code_spans(message):
        words = shlex.split(span)
        if words[:3] == ["python", "-m", "tracer"]:
            out.append(_parser().parse_args(words[3:]))
    return out


def main_warning(at) -> str:
    return next(w.value for w in at.main.warning)


# -- 1. the empty-root message -----------------------------------------------------------------------


@pytest.mark.parametrize("make", ["empty", "missing"])
def test_empty_root_message_gives_commands_that_parse(monkeypatch, tmp_path, make):
    root = tmp_path / "nothing here"
    if make == "empty":
        (root / "unrelated").mkdir(parents=True)
    at = start(monkeypatch, root)
    assert not at.exception
    message = main_warning(at)
    parsed = tracer_commands(message)
    assert [a.command for a in parsed] == ["demo", "view"]
    assert parsed[0].out == "DIR" and parsed[1].path == "DIR"
    # the app's own option: what follows `--` in `streamlit run app/streamlit_app.py -- --root DIR`
    streamlit = [s for s in code_spans(message) if s.startswith("streamlit run")]
    assert len(streamlit) == 1
    words = shlex.split(streamlit[0])
    assert words[:3] == ["streamlit", "run", "app/streamlit_app.py"] and (REPO / words[2]).is_file()
    assert resolve_root(words[words.index("--") + 1:], {}) == Path("DIR")
    # no bare option the user would have to guess where to put
    assert "--root DIR" not in code_spans(message)


@needs_symlinks
def test_root_holding_only_links_out_says_so_and_how_to_open_them(monkeypatch, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    for name in ("run_a", "run_b"):
        write_trace(outside / name, tokenizer=ToyTokenizer(), steps=1)
        (root / f"link_{name}").parent.mkdir(parents=True, exist_ok=True)
        (root / f"link_{name}").symlink_to(outside / name, target_is_directory=True)
    at = start(monkeypatch, root)
    assert not at.exception
    sidebar = at.sidebar.warning[0].value
    assert sidebar.startswith("2 trace(s) under the root are links that leave it")
    message = main_warning(at)
    assert "holds no trace" not in message  # the sidebar has just said it found two
    assert "2 trace(s)" in message and "links that leave it" in message
    [view] = tracer_commands(message)
    assert view.command == "view" and Path(view.path) == outside.resolve()
    # and that command opens them: `tracer view PATH` starts the app with --root PATH
    at = start(monkeypatch, Path(view.path), page=TOKENS_PAGE)
    assert not at.exception
    assert at.selectbox(key="run").options == ["run_a", "run_b"]


# -- 2. a crashed writer -----------------------------------------------------------------------------


CRASH = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from tests.fixtures.toy_traces import ToyTokenizer, HYPERPARAMETERS, healthy_step_tensors
from tracer.record.writer import TraceWriter
writer = TraceWriter({out!r}, "grpo", tokenizer=ToyTokenizer(), hyperparameters=HYPERPARAMETERS, async_write=False)
writer.record(0, healthy_step_tensors(0, 0))
writer.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_writer_reads_as_tracer_info_says(monkeypatch, tmp_path):
    out = tmp_path / "crashed"
    proc = subprocess.run([sys.executable, "-c", CRASH.format(repo=str(REPO), out=str(out))],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    expected = trace_info(out)["status_text"]
    assert expected.startswith("unfinished")
    at = start(monkeypatch, out, page=TOKENS_PAGE)
    assert not at.exception
    line = next(t.value for t in at.sidebar.text if "step files" in t.value)
    assert line == f"grpo · {expected} · 1 step files"
    caption = " ".join(c.value for c in at.sidebar.caption)
    assert "crashed" in caption and "still writing" in caption
    at.switch_page("app_pages/overview.py").run()
    assert not at.exception
    facts = next(df.value for df in at.dataframe if "status" in set(df.value.get("key", [])))
    assert facts.set_index("key").loc["status", "value"] == expected


# -- 3. whitespace-only tokens -----------------------------------------------------------------------


def test_visible_token_marks_whitespace_only_tokens():
    assert visible_token(" ") == "␣" and visible_token("\n") == "⏎" and visible_token("\t") == "⇥"
    assert visible_token(" \n\t\r") == "␣⏎⇥␍" and visible_token("\u00a0") == "·" and visible_token("") == "∅"
    for text in (" world", "a b", "\n4", "<b>", "<id 7>"):  # anything with a visible character: as is
        assert visible_token(text) == text
    assert visible_token(None) is None


def test_tokens_page_shows_whitespace_tokens_with_markers(monkeypatch, tmp_path):
    vocab = list(VOCAB)
    vocab[7], vocab[6], vocab[9] = " ", "\n", "\t"  # sequence 0 starts with id 7; sequence 1 has id 6 at 1
    write_trace(tmp_path / "run", tokenizer=ToyTokenizer(vocab), steps=1)
    at = start(monkeypatch, tmp_path / "run", page=TOKENS_PAGE)
    assert not at.exception
    table = next(df.value for df in at.dataframe if "token_text" in df.value.columns)
    completion = table[table["section"] == "completion"] if "section" in table else table
    assert completion.loc[completion["position"] == 0, "token_text"].tolist() == ["␣"]
    body = next(str(el.proto.body) for el in at.get("html") if "title=" in str(el.proto.body))
    assert ">␣</span>" in body
    assert "token 7: &#x27; &#x27;" in body  # the hover keeps the real string
    assert not re.search(r">\s+</span>", body)  # no span whose text is only whitespace
    at.selectbox(key="sequence").select(1).run()
    table = next(df.value for df in at.dataframe if "token_text" in df.value.columns)
    completion = table[table["section"] == "completion"] if "section" in table else table
    assert completion.loc[completion["position"] == 1, "token_text"].tolist() == ["⏎"]
    body = next(str(el.proto.body) for el in at.get("html") if "title=" in str(el.proto.body))
    assert ">⏎</span>" in body and "token 6: &#x27;\\n&#x27;" in body


# -- 4. no jargon ------------------------------------------------------------------------------------


def test_no_seed_jargon_in_the_app():
    hits = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "app").rglob("*.py"))
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"\bthe seed\b|\bseed's\b", line, re.IGNORECASE)]
    assert hits == []
    assert advantage_rule_text("grpo", {}, "population").endswith("(unbiased=False, as MiniMind's train_grpo.py)")


# -- 5. the hidden-pages note ------------------------------------------------------------------------


def hidden_notes(at) -> list[str]:
    values = []
    for kind in ("text", "markdown", "caption", "warning", "info"):
        values += [str(el.value) for el in at.get(kind) if "Hidden for" in str(el.value)]
    return values


def test_hidden_pages_note_is_shown_once_collapsed_in_the_sidebar(monkeypatch, tmp_path):
    def drop_sampler(step, inner, tensors):  # no sampler_logprobs: the Mismatch page is hidden too
        tensors.pop("sampler_logprobs")

    write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=1, edit=drop_sampler)
    at = start(monkeypatch, tmp_path / "run", page=TOKENS_PAGE)
    for page in (None, "steps", "overview"):
        if page is not None:
            at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception
        [note] = hidden_notes(at)  # once in the whole app, not once per page
        [expander] = [e for e in at.sidebar.expander if "not offered" in e.label]
        # a grpo run: PPO and DPO pairs are for other algorithms, Mismatch needs sampler_logprobs
        assert expander.label == "3 page(s) not offered for this run"
        assert not expander.proto.expanded
        assert [t.value for t in expander.text] == [note]
        assert "PPO: GAE and early stop, DPO pairs" in note and "Mismatch (no sampler_logprobs" in note
        # first in the sidebar (right under the page list), before the run choosers
        assert sidebar_index(at, expander) < sidebar_index(at, at.sidebar.title[0])


def sidebar_index(at, element) -> int:
    """The position among the sidebar's top-level children of the one that is or holds ``element``."""
    for i, child in enumerate(at.sidebar.children.values()):
        if child is element or (isinstance(child, Block) and any(e is element for e in child.get(element.type))):
            return i
    raise AssertionError("not in the sidebar")
