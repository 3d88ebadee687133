"""Every manifest key tracer reads, given a wrong JSON type or an oversized value: ``tracer info``,
``tracer check``, ``tracer diff`` and the reader's views give an answer or a one-line error, never a
traceback, and the manifest's problems are one note per key naming the file, the key, what was
expected and what was found (``tracer.format.integrity.clean_manifest``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracer import Trace
from tracer.checks import run_checks
from tracer.cli import main
from tracer.format.integrity import MAX_MANIFEST_TEXT, _MANIFEST_TYPES
from tracer.format.names import MANIFEST_NAME
from tracer.read.trace_info import trace_info

from tests.fixtures.toy_traces import ToyTokenizer, write_trace

# One value of each JSON type a field might wrongly hold, plus sizes past the bounds.
WRONG_VALUES = {
    "object": {"a": 1}, "nested_list": [1, [2]], "long_text": "x" * (MAX_MANIFEST_TEXT + 1), "negative": -1,
    "huge_int": 2**70, "float": 1.5, "bool": True, "null": None, "text": "text",
}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    return write_trace(tmp_path_factory.mktemp("healthy") / "run", tokenizer=ToyTokenizer(), steps=2)


def _with_manifest(healthy: Path, tmp_path: Path, change: dict) -> Path:
    """A copy of ``healthy`` (its files linked) with ``change`` written over its manifest's keys."""
    run = tmp_path / "run"
    run.mkdir()
    for item in healthy.iterdir():
        (run / item.name).symlink_to(item, target_is_directory=item.is_dir())
    (run / MANIFEST_NAME).unlink()
    manifest = json.loads((healthy / MANIFEST_NAME).read_text())
    (run / MANIFEST_NAME).write_text(json.dumps({**manifest, **change}))
    return run


def _no_traceback(run: Path, other: Path, capsys) -> str:
    for argv in (["info", str(run)], ["info", "--json", str(run)], ["check", str(run)],
                 ["diff", str(other), str(run)]):
        assert main(argv) in (0, 1, 2), argv
    return capsys.readouterr().out


def test_drop_reasons_that_are_not_strings_are_noted_and_info_goes_on(healthy, tmp_path, capsys):
    run = _with_manifest(healthy, tmp_path, {"drop_reasons": [{"a": 1}, [1, [2]], "step 3: queue full"],
                                              "dropped_steps": 3})
    assert main(["info", str(run)]) == 0
    out = capsys.readouterr().out
    assert "drop reasons (of the first 1): queue full x1" in out
    note = (f"{run / MANIFEST_NAME}: key 'drop_reasons' should be a list of at most 1000 strings of at most "
            f"{MAX_MANIFEST_TEXT} characters, got 3 entries (a dict of 1, a list of 2); 2 ignored")
    assert Trace(run).manifest_notes == [note]
    assert note in " ".join(out.split())  # the problems section, as wrapped by the terminal
    assert trace_info(run)["drop_reasons"] == ["step 3: queue full"]


@pytest.mark.parametrize("kind", sorted(WRONG_VALUES))
def test_every_manifest_key_with_a_wrong_value_gives_notes_not_a_traceback(healthy, tmp_path, capsys, kind):
    value = WRONG_VALUES[kind]
    run = _with_manifest(healthy, tmp_path, {key: value for key in _MANIFEST_TYPES})
    trace = Trace(run)
    noted = {note.split("key ", 1)[1].split(" ", 1)[0].strip("'") for note in trace.manifest_notes}
    for note in trace.manifest_notes:
        assert note.startswith(f"{run / MANIFEST_NAME}: key '") and " should be " in note and ", got " in note
    for key in _MANIFEST_TYPES:  # each key either noted, or its value fits (a text is a valid status)
        assert key in noted or trace.manifest.get(key) == value, key
    _no_traceback(run, healthy, capsys)
    key = trace.steps()[0]
    trace.token_table(key)
    run_checks(trace)


@pytest.mark.parametrize("kind", sorted(WRONG_VALUES))
def test_wrong_values_inside_the_manifests_objects_give_no_traceback(healthy, tmp_path, capsys, kind):
    value = WRONG_VALUES[kind]
    inner = {name: value for name in ("beta", "num_generations", "clip_epsilon_high", "clip_epsilon_low",
                                      "learning_rate", "loss_type", "scale_rewards", "epsilon")}
    run = _with_manifest(healthy, tmp_path, {
        "hyperparameters": inner, "sampling": {"every_n_steps": value, "first_k_sequences": value},
        "producers": {"torch": value}, "capture": {"writer": value},
        "config": {"trainer_args": value, "diff_change": value, "trainer": value, **inner},
        "tokenizer": {"class": value, "name_or_path": value, "eos_token_id": value, "pad_token_id": value},
        "capture_report": {"backward_calls": value, "steps_recorded": value, "drops": value, "sources": value}})
    _no_traceback(run, healthy, capsys)
    run_checks(Trace(run))
