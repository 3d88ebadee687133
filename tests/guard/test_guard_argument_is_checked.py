"""``guard=`` is checked before anything is written: an unknown word is refused by name (also through
``TRACER_GUARD``), ``"off"`` attaches no guard, and the manifest says which guard ran."""

from __future__ import annotations

import json

import pytest

import tracer


def test_an_unknown_guard_is_refused_before_the_trace_exists(tmp_path):
    with pytest.raises(tracer.TraceError, match=r"^guard='halt' is not one of \['off', 'warn', 'stop'\] or a callable"):
        tracer.Tracer(tmp_path / "run", "grpo", guard="halt")
    assert not (tmp_path / "run").exists()


def test_warn_is_the_default_guard(tmp_path, monkeypatch):
    monkeypatch.delenv("TRACER_GUARD", raising=False)
    with tracer.Tracer(tmp_path / "plain", "grpo") as writer:
        assert writer.guard_stop is None
    assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["guard"] == {"mode": "warn"}
    with tracer.Tracer(tmp_path / "off", "grpo", guard="off"):
        pass
    assert json.loads((tmp_path / "off" / "manifest.json").read_text())["guard"] == {"mode": "off"}
    assert not list((tmp_path / "off").glob("findings.rank_*.jsonl"))


def test_the_environment_gives_the_default_guard(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACER_GUARD", "off")
    with tracer.Tracer(tmp_path / "off", "grpo") as writer:
        assert writer.guard_stop is None
    assert json.loads((tmp_path / "off" / "manifest.json").read_text())["guard"] == {"mode": "off"}
    monkeypatch.setenv("TRACER_GUARD", "sometimes")
    with pytest.raises(tracer.TraceError, match="TRACER_GUARD environment variable"):
        tracer.Tracer(tmp_path / "bad", "grpo")


def test_guard_stop_is_not_an_exception_that_except_exception_swallows():
    assert issubclass(tracer.GuardStop, BaseException) and not issubclass(tracer.GuardStop, Exception)
