"""How a run's end is put in words (tracer.read.run_status.status_text) from the manifest's ``status`` and
``ended`` entry, including an entry a hand-edited or hostile manifest fills with wrong types; and which
status each exception that ends a run gives (tracer.format.run_end)."""

from __future__ import annotations

import pytest

from tracer.errors import GuardStop
from tracer.format.run_end import MAX_MESSAGE_CHARS, ended_entry, exception_status
from tracer.read.run_status import status_text


def test_a_crash_names_the_exception_the_last_step_and_a_thread_other_than_main():
    manifest = {"ended": {"closed_by": "exit", "last_step": 12, "exception": "torch.OutOfMemoryError",
                          "message": "CUDA out of memory", "thread": "trainer"}}
    assert status_text("crashed", manifest) == ("crashed after recording step 12: torch.OutOfMemoryError: CUDA out "
                                                "of memory (in thread trainer)")
    manifest = {"ended": {"closed_by": "with", "last_step": None, "exception": "KeyboardInterrupt", "message": "",
                          "thread": "MainThread"}}
    assert status_text("interrupted", manifest) == "interrupted before recording any step: KeyboardInterrupt"


def test_wrong_types_in_the_ended_entry_are_left_out_and_a_long_message_cut():
    manifest = {"ended": {"exception": 3, "message": "x" * 10_000, "last_step": True, "thread": None}}
    assert status_text("crashed", manifest) == "crashed: " + "x" * MAX_MESSAGE_CHARS
    assert status_text("crashed", {"ended": ["not", "an", "object"]}) == "crashed"
    assert status_text("crashed", {}) == "crashed"  # the counts file's status, without the manifest's entry
    assert status_text("finished", manifest) == "finished"  # a finished run's entry adds nothing
    assert status_text(["running"]) == "['running']"


@pytest.mark.parametrize("exc, status", [
    (None, "finished"), (SystemExit(0), "finished"), (SystemExit(None), "finished"), (SystemExit(2), "crashed"),
    (GuardStop("stopped", None, None), "finished"),  # the guard's stop: the manifest's guard entry says why
    (KeyboardInterrupt(), "interrupted"), (ValueError("nan"), "crashed"), (MemoryError(), "crashed"),
])
def test_the_status_each_ending_gives(exc, status):
    assert exception_status(exc) == status


def test_the_ended_entry_of_a_nonzero_exit_and_of_a_broken_str():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no")

    assert ended_entry("with", 4, SystemExit(2), "MainThread") == ("crashed", {
        "closed_by": "with", "last_step": 4, "exception": "SystemExit", "message": "exit status 2",
        "thread": "MainThread"})
    status, entry = ended_entry("exit", 0, Unprintable(), "MainThread")
    assert (status, entry["message"]) == ("crashed", "Unprintable()")
    assert entry["exception"].endswith("Unprintable")  # qualified by the test module's name
