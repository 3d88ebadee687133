"""Safe to open: the app lists and opens only traces under its root (a path
from the URL that leaves it through ``..``, a symlink or an absolute path is refused); corrupt step
files are named with the reason while the other steps are served; a malformed or missing manifest
gets a clear message; token strings are shown literally on every page."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from app.components.safe_trace import OutsideRootError, SafeTrace, inside, resolve_request
from tracer.errors import TraceFormatError
from tracer.format.names import MANIFEST_NAME, step_file_name

from tests.fixtures.toy_traces import (
    BOLD, SCRIPT, TOKENS_PAGE, ToyTokenizer, assert_no_raw_markup, frame_with, largest_frame_with, start, write_trace)


needs_symlinks = pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="needs POSIX symlinks")


def shift_script_logprob(step: int, inner_step: int, tensors) -> None:
    """b_run differs from a_run at the <script> token (sequence 0, token 1): diff messages name it."""
    if inner_step == 1:
        tensors["policy_logprobs"][0, 1] += 1.0


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """``root/`` with two traces and a link to a trace outside it; ``outside/`` next to the root."""
    base = tmp_path_factory.mktemp("safety")
    root, outside = base / "root", base / "outside"
    write_trace(root / "a_run", tokenizer=ToyTokenizer(), steps=1)
    write_trace(root / "b_run", tokenizer=ToyTokenizer(), steps=1, edit=shift_script_logprob)
    write_trace(outside / "secret", tokenizer=ToyTokenizer(), steps=1)
    (root / "link_out").symlink_to(outside / "secret", target_is_directory=True)
    return base


def refusals(at) -> list[str]:
    return [e.value for e in at.error if e.value.startswith("Refused")]


# -- confinement: pure -------------------------------------------------------------------------------


@needs_symlinks
def test_inside_and_resolve_request_follow_dots_and_links(tree):
    root = tree / "root"
    assert inside(root / "a_run", root) and inside(root, root)
    assert not inside(root / ".." / "outside" / "secret", root)
    assert not inside(root / "link_out", root)  # a link under the root that leaves it
    assert resolve_request(root, "a_run") == (root / "a_run").resolve()
    assert resolve_request(root, str(root / "b_run")) == (root / "b_run").resolve()
    for requested in ("../outside/secret", "link_out", str(tree / "outside" / "secret"), "/etc", "a_run/../../outside"):
        with pytest.raises(OutsideRootError, match="outside the root"):
            resolve_request(root, requested)


@needs_symlinks
def test_safe_trace_sets_aside_links_and_corrupt_files(tmp_path):
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=2)
    steps = run / "steps"
    good = sorted(p.name for p in steps.iterdir())
    outside_file = tmp_path / "elsewhere.safetensors"
    shutil.copy(steps / step_file_name(0), outside_file)
    (steps / step_file_name(5)).symlink_to(outside_file)
    truncated = steps / step_file_name(6)
    truncated.write_bytes((steps / step_file_name(0)).read_bytes()[:200])
    save_file({"completion_ids": torch.zeros(4, 6, dtype=torch.int64),  # T = 6 here, 5 in the mask
               "completion_mask": torch.ones(4, 5, dtype=torch.bool)}, str(steps / step_file_name(7)))
    trace = SafeTrace(run)
    assert sorted(k.path.name for k in trace.steps()) == good
    problems = {p.name: reason for p, reason in trace.problems().items()}
    assert set(problems) == {step_file_name(n) for n in (5, 6, 7)}
    assert problems[step_file_name(5)].startswith("outside: ")
    assert problems[step_file_name(6)].startswith("unreadable: ") and str(truncated) in problems[step_file_name(6)]
    assert "truncated" in problems[step_file_name(6)]
    assert problems[step_file_name(7)].startswith("unreadable: ") and "completion_mask" in problems[step_file_name(7)]
    # a manifest that is a link leaving the trace: the trace is refused
    (run / MANIFEST_NAME).rename(tmp_path / "manifest.json")
    (run / MANIFEST_NAME).symlink_to(tmp_path / "manifest.json")
    with pytest.raises(OutsideRootError, match="outside the trace directory"):
        SafeTrace(run)


# -- confinement: pages ------------------------------------------------------------------------------


@needs_symlinks
def test_run_list_holds_only_traces_inside_the_root(monkeypatch, tree):
    root = tree / "root"
    at = start(monkeypatch, root, page=TOKENS_PAGE)
    assert not at.exception
    assert at.selectbox(key="run").options == ["a_run", "b_run"]
    assert "links that leave it" in at.sidebar.warning[0].value


@needs_symlinks
@pytest.mark.parametrize("requested", ["../outside/secret", "link_out", "ABSOLUTE", "a_run/../../outside/secret"])
def test_url_path_leaving_the_root_is_refused(monkeypatch, tree, requested):
    root = tree / "root"
    requested = str(tree / "outside" / "secret") if requested == "ABSOLUTE" else requested
    at = start(monkeypatch, root, query={"run": requested}, page=TOKENS_PAGE)
    assert not at.exception
    assert refusals(at) == ["Refused the run named in the URL: it lies outside the directory this app was "
                            "started with."]
    assert any("outside the root" in t.value for t in at.text)
    assert at.selectbox(key="run").value == root / "a_run"  # nothing outside was opened
    assert all("secret" not in str(t.value) for t in at.text if "step" in t.value)


def test_url_path_inside_the_root_selects_the_run(monkeypatch, tree):
    root = tree / "root"
    at = start(monkeypatch, root, query={"run": "b_run"}, page=TOKENS_PAGE)
    assert not at.exception and not refusals(at)
    assert at.selectbox(key="run").value == root / "b_run"
    at.selectbox(key="run").select(root / "a_run").run()  # a later choice wins, and goes into the URL
    assert at.selectbox(key="run").value == root / "a_run"
    assert at.query_params["run"] == "a_run"


def test_url_naming_no_trace_says_so_literally(monkeypatch, tree):
    at = start(monkeypatch, tree / "root", query={"run": SCRIPT})
    assert not at.exception
    assert at.error[0].value == "The run named in the URL is not a trace under the root."
    assert any(SCRIPT in t.value for t in at.text)  # as plain text
    assert_no_raw_markup(at)


# -- corrupt files -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corrupt_root(tmp_path_factory) -> Path:
    """``corrupt/``: 3 steps x 2 inner steps, step 1 inner 0 truncated, step 2 inner 0 with a garbage
    header; ``good/``: the same run intact; ``bad_manifest/``: a manifest that is not JSON."""
    root = tmp_path_factory.mktemp("corrupt")
    write_trace(root / "good", tokenizer=ToyTokenizer())
    run = write_trace(root / "corrupt", tokenizer=ToyTokenizer())
    truncated = run / "steps" / step_file_name(1)
    truncated.write_bytes(truncated.read_bytes()[:300])
    garbage = run / "steps" / step_file_name(2)
    garbage.write_bytes(b"\xff" * 8 + b"not a header" * 20)
    write_trace(root / "bad_manifest", steps=1)
    (root / "bad_manifest" / MANIFEST_NAME).write_text("{ this is not json", encoding="utf-8")
    return root


def test_corrupt_step_files_are_named_and_the_others_served(monkeypatch, corrupt_root):
    at = start(monkeypatch, corrupt_root, page=TOKENS_PAGE)
    at.selectbox(key="run").select(corrupt_root / "corrupt").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "2 step file(s) set aside" in at.sidebar.warning[0].value
    listed = at.selectbox(key="step_file").options
    assert len(listed) == 4 and not any(label.startswith(("step 1 · inner 0", "step 2 · inner 0")) for label in listed)
    reasons = "\n".join(t.value for t in at.sidebar.text)
    for n in (1, 2):  # each file named, with the reader's reason
        assert str(corrupt_root / "corrupt" / "steps" / step_file_name(n)) in reasons
    assert reasons.count("unreadable: ") == 2 and reasons.count("not a safetensors file") == 2
    assert len(largest_frame_with(at, {"token_text", "mask_reason"}).value) == 6  # T of sequence 0 (prompt rows collapsed)
    for page in ("steps", "groups", "overview"):
        at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, (page, [e.value for e in at.exception])

    at.switch_page("app_pages/health.py").run()
    assert not at.exception
    assert at.error[0].value.startswith("2 step file(s) could not be read")
    unreadable = frame_with(at, {"step file", "reason"}).value
    assert set(unreadable["step file"]) == {step_file_name(1), step_file_name(2)}
    assert any("4 step file(s) checked" in s.value for s in at.success)


def test_diff_with_a_corrupt_trace_names_the_file(monkeypatch, corrupt_root):
    at = start(monkeypatch, corrupt_root, page=TOKENS_PAGE)
    at.selectbox(key="run").select(corrupt_root / "good").run()  # (bad_manifest, listed first, may not open)
    at.switch_page("app_pages/diff.py").run()
    at.selectbox(key="diff_a").select(corrupt_root / "good").run()
    at.selectbox(key="diff_b").select(corrupt_root / "corrupt").run()
    assert not at.exception
    # tracer.diff either refuses the unreadable trace or reports each unreadable step file as a
    # finding; the page says which file either way
    shown = "\n".join([*(t.value for t in at.text), *(c.value for c in at.code)])
    assert at.error[0].value in ("A trace cannot be read; nothing was diffed.",
                                 "different: 2 finding(s) over 6 step pairs.")
    assert step_file_name(1) in shown


def test_malformed_and_missing_manifest_get_a_clear_message(monkeypatch, corrupt_root, tmp_path):
    at = start(monkeypatch, corrupt_root, page=TOKENS_PAGE)
    at.selectbox(key="run").select(corrupt_root / "bad_manifest").run()
    assert not at.exception
    # Depending on the reader, a manifest that is not JSON makes the run unopenable ("Cannot open this
    # run") or is ignored with a note while its step files are served; either way the message names
    # the file and says why.
    detail = "\n".join(t.value for t in [*at.text, *at.sidebar.text])
    assert "trace manifest" in detail and str(corrupt_root / "bad_manifest" / MANIFEST_NAME) in detail
    if at.title[0].value != "Cannot open this run":
        assert any("was ignored" in w.value for w in at.sidebar.warning)
        assert largest_frame_with(at, {"token_text"}).value["token_text"].iloc[0] == "<id 7>"  # first completion token
    at.selectbox(key="run").select(corrupt_root / "good").run()  # the other runs stay usable
    assert not at.exception and at.title[0].value == "Tokens"

    run = write_trace(tmp_path / "no_manifest", tokenizer=ToyTokenizer(), steps=1)
    (run / MANIFEST_NAME).unlink()
    at = start(monkeypatch, run, page=TOKENS_PAGE)
    assert not at.exception
    assert any(f"No {MANIFEST_NAME} in this run" in w.value for w in at.sidebar.warning)
    assert "unknown" in next(t.value for t in at.sidebar.text if "step files" in t.value)
    completion = largest_frame_with(at, {"token_text", "mask_reason"}).value.query("section == 'completion'")
    assert completion["token_text"].tolist()[:3] == ["4", SCRIPT, "<eos>"]  # tokens.json still read
    assert completion["mask_reason"].tolist() == ["kept"] * 3 + ["masked"] * 3  # EOS id unknown


def test_unreadable_single_step_file_is_named(monkeypatch, tmp_path):
    bad = tmp_path / "step.safetensors"
    bad.write_bytes(b"\x00" * 4)
    at = start(monkeypatch, bad, page=TOKENS_PAGE)
    assert not at.exception
    assert "1 step file(s) set aside" in at.sidebar.warning[0].value
    assert any(str(bad) in t.value for t in at.sidebar.text)
    # the page names the file that cannot be read, not "no step files yet" (there is one, unreadable)
    assert at.error[0].value.startswith("None of the 1 step file of this run can be read: nothing to show.")
    assert any(bad.name in t.value for t in at.text) and not at.info
    with pytest.raises(TraceFormatError):
        SafeTrace(tmp_path / "missing")


# -- token text shown literally everywhere ----------------------------------------------------------


def test_markup_tokens_never_become_markup_on_any_page(monkeypatch, tree):
    root = tree / "root"
    at = start(monkeypatch, root, page=TOKENS_PAGE)
    pages = ["tokens", "groups", "steps", "overview", "health", "diff"]
    seen = set()
    for sequence in range(4):  # every sequence: <script> in row 0, <b> in rows 2 and 3
        at.switch_page("app_pages/tokens.py")
        at.selectbox(key="sequence").select(sequence).run()
        assert not at.exception
        seen |= set(largest_frame_with(at, {"token_text"}).value["token_text"])
        assert_no_raw_markup(at)
    assert {SCRIPT, BOLD} <= seen
    for page in pages[1:]:
        at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, (page, [e.value for e in at.exception])
        if page == "health":  # every finding, skipped ones included
            at.multiselect[0].set_value(at.multiselect[0].options).run()
            assert len(frame_with(at, {"check", "token_text"}).value)
        assert_no_raw_markup(at)
    at.switch_page("app_pages/diff.py").run()  # a_run vs b_run: they differ at the <script> token
    assert any(SCRIPT in t.value for t in at.text if t.value.startswith("first divergence"))
    assert SCRIPT in set(frame_with(at, {"token_text_a", "differs"}).value["token_text_a"])
    assert_no_raw_markup(at)


def test_step_file_with_unusable_data_is_named_on_the_page(monkeypatch, tmp_path):
    """A header that opens but a completion_mask of 0.5s (neither keep nor drop): the reader refuses
    the data when it is loaded; the page names the file, the other steps and the Health page work."""
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=2)
    bad = run / "steps" / step_file_name(1)
    with safe_open(str(bad), framework="pt") as fh:
        tensors, metadata = {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()
    tensors["completion_mask"] = torch.full(tensors["completion_mask"].shape, 0.5)
    metadata.pop("content_sha256", None)
    save_file(tensors, str(bad), metadata=metadata)
    at = start(monkeypatch, run, page=TOKENS_PAGE)
    at.selectbox(key="step_file").select("step 1 · inner 0 · mb 0 · rank 0").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.error[0].value.startswith("This view could not read a step file")
    assert any(str(bad) in t.value for t in at.text)
    at.selectbox(key="step_file").select("step 0 · inner 0 · mb 0 · rank 0").run()
    assert not at.error and len(largest_frame_with(at, {"token_text"}).value) == 6  # T (prompt rows collapsed)

    at.switch_page("app_pages/health.py").run()  # run_checks reports the file and checks the others
    assert not at.exception
    assert at.error[0].value == "4 step file(s) checked: 1 error."
    findings = frame_with(at, {"check", "path", "message"}).value
    unreadable = findings[findings["severity"] == "error"]
    assert unreadable["check"].tolist() == ["trace.unreadable"] and unreadable["path"].tolist() == [str(bad)]
    assert "completion_mask" in unreadable["message"].iloc[0]
