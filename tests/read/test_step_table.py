"""The listing as arrays (:mod:`tracer.read.step_table`): the table of a folder's writer-named
files sorts them as their keys sort, refuses names it cannot read (those go the one-by-one way),
and the app's listing built from it (no key per file) gives the same steps, keys, lookups and
overview as the listing file by file."""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd

from app.components.safe_trace import SafeTrace
from tracer.format.names import STEPS_DIR, step_file_name
from tracer.read import StepKey, Trace
from tracer.read.step_table import StepTable

from tests.fixtures.toy_traces import write_trace


def test_a_folders_table_sorts_by_coordinates_and_builds_keys_on_demand(tmp_path):
    coords = [(s, i, m, r) for s in (0, 2, 10) for i in (0, 1) for m in (0, 3) for r in (1, 0)]
    names = [step_file_name(*c) for c in coords]
    random.Random(0).shuffle(names)
    table = StepTable.of_folder(tmp_path, names)
    assert table.coordinates.tolist() == [list(c) for c in sorted(coords)]
    assert table.names == [step_file_name(*c) for c in sorted(coords)]
    assert table.keys() == [StepKey(*c, tmp_path / step_file_name(*c)) for c in sorted(coords)]
    assert table.key(5) == table.keys()[5] and table.labels()[5] == table.keys()[5].label
    assert table.position(str(tmp_path / step_file_name(10, 1, 3, 0))) == len(coords) - 2
    assert table.position(str(tmp_path / "other" / step_file_name(0))) is None
    ranks = table.take([i for i, c in enumerate(table.coordinates.tolist()) if c[3] == 1])
    assert [k.rank for k in ranks.keys()] == [1] * (len(coords) // 2)


def test_names_it_cannot_read_are_refused():
    assert StepTable.of_folder(Path("."), [step_file_name(0), "mine.safetensors"]) is None
    assert StepTable.of_folder(Path("."), [step_file_name(1), "step_1.inner_0.mb_0.rank_0.safetensors"]) is None
    assert StepTable.of_folder(Path("."), [f"step_{2**70}.inner_0.mb_0.rank_0.safetensors"]) is None


def test_the_apps_listing_by_name_equals_the_listing_file_by_file(tmp_path):
    run = write_trace(tmp_path / "run", steps=3)
    fast = SafeTrace(run)
    slow = SafeTrace(run)
    slow._step_names = lambda: None  # the one-by-one listing
    assert fast.step_table().folder == run / STEPS_DIR and slow.step_table().folder is None
    assert fast.steps() == slow.steps() == Trace(run).steps()
    for key in Trace(run).steps():
        assert fast.key_of(str(key.path)) == key == slow.key_of(str(key.path))
    assert fast.key_of(str(run / step_file_name(0))) is None
    assert fast.step_table().labels() == [k.label for k in Trace(run).steps()]
    pd.testing.assert_frame_equal(fast.step_summary(), slow.step_summary())
    assert fast.step_summary().attrs["from_index"] == len(Trace(run).steps())


def test_a_name_beyond_int64_is_keyed_by_its_header(tmp_path):
    """A copy of step 1's file named ``step_<2**64>...``: no int64 holds that step, so the reader
    keys it as a user-named file (its header says step 1) and the table, count and overview hold it."""
    run = write_trace(tmp_path / "run", steps=2)
    name = f"step_{2**64}.inner_0.mb_0.rank_0.safetensors"
    (run / STEPS_DIR / name).write_bytes((run / STEPS_DIR / step_file_name(1)).read_bytes())
    for trace in (Trace(run), SafeTrace(run)):
        assert trace.step_count() == 5
        assert trace.step_table().coordinates.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0],
                                                           [1, 1, 0, 0]]
        assert trace.step_table().names[3] == name
        assert trace.step_summary()["step"].tolist() == [0, 0, 1, 1, 1]


def test_a_trace_and_its_overview_are_freed_without_the_cycle_collector():
    import gc
    import weakref

    from tracer.read import Trace
    from tests.fixtures.paths import SAMPLES

    enabled = gc.isenabled()
    gc.disable()
    try:
        trace = Trace(SAMPLES / "grpo-tiny")
        trace.step_summary()
        held = weakref.ref(trace)
        del trace
        assert held() is None  # the overview refers back to its trace weakly: no reference cycle
    finally:
        if enabled:
            gc.enable()
