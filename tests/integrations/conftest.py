"""The verl tests' ``traced`` fixture (verl is imported only when a test asks for it: the main venv has none)."""

import pytest


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """TRACER_DIR set for this test; tracer.integrations.verl's recorders closed and reset after it."""
    import tracer.integrations.verl as tv
    from tests.fixtures.verl_batches import TOKENIZER

    monkeypatch.setenv("TRACER_DIR", str(tmp_path / "trace"))
    tv.finish()
    tv.install(tokenizer=TOKENIZER)
    yield tmp_path / "trace"
    tv.finish()
