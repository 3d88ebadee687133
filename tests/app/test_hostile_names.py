"""A step file whose name is not valid UTF-8 is set aside and named with escapes; the app keeps
working (it used to fail to encode the name)."""

import os

from tests.fixtures.toy_traces import TOKENS_PAGE, start, write_trace


def test_a_non_utf8_step_file_name_does_not_take_the_app_down(tmp_path, monkeypatch):
    run = write_trace(tmp_path / "root" / "run")
    with open(os.path.join(os.fsencode(run / "steps"), b"\xff.safetensors"), "wb") as fh:
        fh.write(b"x" * 10)
    at = start(monkeypatch, tmp_path / "root", page=TOKENS_PAGE)
    assert not at.exception
    shown = "\n".join(t.value for t in at.sidebar.text)
    assert "\\xff.safetensors" in shown  # named, with the odd byte escaped


def test_a_run_directory_whose_name_is_not_utf8_does_not_take_the_app_down(tmp_path, monkeypatch):
    """A root holding a run named ``run\\xff`` (not valid UTF-8): the Run list shows it with U+FFFD and
    the other runs stay usable (the sidebar used to raise UnicodeEncodeError for the whole page)."""
    write_trace(tmp_path / "root" / "good")
    write_trace(os.fsdecode(os.path.join(os.fsencode(tmp_path / "root"), b"run\xff")))
    at = start(monkeypatch, tmp_path / "root", page=TOKENS_PAGE)
    assert not at.exception, [e.value for e in at.exception]
    options = at.selectbox(key="run").options
    assert "good" in options and "run\ufffd" in options
