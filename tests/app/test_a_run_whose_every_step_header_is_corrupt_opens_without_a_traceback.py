"""A run every step file of which has a corrupt header (the right size, its JSON damaged), opened by
its Runs-page link (``?run=`` and no step): the sidebar looks for the run's most informative step,
which runs ``tracer check``, which raises "none of its step files can be read"; every page showed that
uncaught error with a traceback. Now the run's status counts each file as unreadable and the page
opens, saying the step file cannot be read."""

from __future__ import annotations

import struct

from streamlit.testing.v1 import AppTest

from tests.fixtures.toy_traces import APP, ToyTokenizer, write_trace


def test_the_tokens_page_of_an_all_corrupt_run_names_the_files(tmp_path, monkeypatch):
    root = tmp_path / "root"
    run = write_trace(root / "broken", tokenizer=ToyTokenizer(), steps=2)
    files = sorted((run / "steps").glob("*.safetensors"))
    for path in files:  # the header's first bytes replaced: same size, no longer JSON
        data = bytearray(path.read_bytes())
        assert struct.unpack("<Q", bytes(data[:8]))[0] > 5
        data[8:13] = b"\xff\xfe{{{"
        path.write_bytes(bytes(data))
    monkeypatch.setenv("TRACER_ROOT", str(root))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update({"run": "broken"})
    at.switch_page("app_pages/tokens.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [str(el.value) for el in at.error]
    assert "This step file cannot be read; pick another one." in errors, errors
    assert not [e for e in errors if "none of its" in e], errors
