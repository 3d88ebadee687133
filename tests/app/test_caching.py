"""The viewer's caches: the shared LRU of open step files closes what it evicts and
stays within its bound, including under concurrent sessions; a step file rewritten under the same
name is read again, never served stale (by the handle cache, by SafeTrace's listing and by the
app's st.cache_data keys); one sequence read by slice through a cached handle equals that row of
the whole tensor; the listing of a trace of many steps is reused while its directories are
unchanged, and redone when a step appears. No wall-time assertion: counts and values only.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from app.components import safe_trace, trace_cache
from app.components.safe_trace import SafeTrace
from app.components.step_handles import StepHandles, file_id
from tracer.read import reader
from tracer.errors import TraceFormatError
from tracer.format.names import STEPS_DIR
from tracer.record.writer import TraceWriter

from tests.fixtures.toy_traces import TOKENS_PAGE, ToyTokenizer, frame_with, healthy_step_tensors, start, write_trace


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished GRPO trace of 4 steps x 2 inner steps (8 step files), 4 sequences each."""
    return write_trace(tmp_path_factory.mktemp("caching") / "run", tokenizer=ToyTokenizer(), steps=4)


def step_paths(run: Path) -> list[Path]:
    return sorted((run / STEPS_DIR).glob("*.safetensors"))


def test_evicted_handles_are_closed_and_the_cache_stays_within_its_bound(run):
    handles = StepHandles(max_handles=3)
    seen = []
    for path in step_paths(run):  # 8 files through a cache of 3
        with handles.lease(path) as fh:
            seen.append(fh)
            assert fh.keys()  # open while leased
        assert len(handles) <= 3
    assert (handles.opened, handles.closed, len(handles)) == (8, 5, 3)
    for fh in seen[:5]:  # the 5 least recently used were closed: reading them fails
        with pytest.raises(SafetensorError, match="closed"):
            fh.keys()
    for fh in seen[5:]:
        assert fh.keys()
    with handles.lease(step_paths(run)[-1]) as fh:  # the most recent: served from the cache
        assert fh is seen[-1]
    assert handles.opened == 8
    handles.clear()
    assert len(handles) == 0 and handles.closed == 8


def test_the_open_files_stay_within_the_byte_bound(run):
    paths = step_paths(run)
    size = max(p.stat().st_size for p in paths)
    handles = StepHandles(max_handles=64, max_bytes=2 * size)  # room for two files
    for path in paths:
        with handles.lease(path):
            pass
        assert handles.open_bytes <= 2 * size and len(handles) <= 2
    assert handles.open_bytes == sum(p.stat().st_size for p in paths[-len(handles):])
    big = StepHandles(max_handles=64, max_bytes=1)  # smaller than any file: the latest one stays open
    for path in paths[:3]:
        with big.lease(path) as fh:
            assert fh.keys()
        assert len(big) == 1
    assert big.closed == 2


def test_a_handle_in_use_when_evicted_is_closed_when_given_back(run):
    handles = StepHandles(max_handles=1)
    first, second = step_paths(run)[:2]
    with handles.lease(first) as held:
        with handles.lease(second):  # evicts `first` while it is still leased
            assert len(handles) == 1
            assert held.keys()  # not closed under the reader's feet
        assert handles.closed == 0
    assert handles.closed == 1
    with pytest.raises(SafetensorError, match="closed"):
        held.keys()


def test_concurrent_leases_never_meet_a_closed_handle(run):
    """Eight threads (sessions) reading eight files through a cache of two: every read succeeds,
    and once all are given back every handle opened was closed but the two cached."""
    handles, paths, errors = StepHandles(max_handles=2), step_paths(run), []

    def read(offset: int) -> None:
        try:
            for i in range(40):
                with handles.lease(paths[(offset + i) % len(paths)]) as fh:
                    fh.get_slice("completion_ids")[0:1]
                    fh.get_tensor("rewards")
        except Exception as err:  # collected: an exception in a thread does not fail the test
            errors.append(err)

    threads = [threading.Thread(target=read, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(handles) <= 2 and handles.opened - handles.closed == len(handles)


def _rewrite(path: Path, **fields: torch.Tensor) -> None:
    """Write a step file with other ``fields`` under the same name (temporary file + rename, as the
    writer does), keeping the old modification time: only the inode tells the files apart."""
    before = path.stat()
    tmp = path.parent / "rewrite"
    with TraceWriter(tmp, "grpo", hyperparameters={"num_generations": 2}, async_write=False) as writer:
        new = writer.record(0, {**healthy_step_tensors(0, 0), **fields})
    os.replace(new, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_file_rewritten_under_the_same_name_is_not_served_stale(tmp_path):
    run = write_trace(tmp_path / "run", steps=1)
    path = step_paths(run)[0]
    handles = StepHandles(max_handles=4)
    with handles.lease(path) as fh:
        old = fh.get_tensor("rewards")
    _rewrite(path, rewards=torch.tensor([7.0, 8.0, 9.0, 10.0]))
    with handles.lease(path) as fh:
        assert fh.get_tensor("rewards").tolist() == [7.0, 8.0, 9.0, 10.0] != old.tolist()
    assert (handles.opened, handles.closed, len(handles)) == (2, 1, 1)  # the old handle was closed


def test_the_app_reads_a_rewritten_step_file_again(monkeypatch, tmp_path):
    """The Tokens page's cached token table is keyed by the file's identity (inode, size, mtime),
    not its name and mtime alone: a rewrite with the same name and mtime shows the new rewards."""
    trace_cache.clear_caches()
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=1)
    at = start(monkeypatch, run, {"step": "0", "seq": "0"}, page=TOKENS_PAGE)
    assert not at.exception
    assert at.sidebar.selectbox(key="sequence").format_func(0).endswith("reward 1")
    _rewrite(step_paths(run)[0], rewards=torch.tensor([7.0, 8.0, 9.0, 10.0]))
    at.run()
    assert not at.exception
    assert at.sidebar.selectbox(key="sequence").format_func(0).endswith("reward 7")


def test_the_step_page_reads_a_rewritten_step_file_again(monkeypatch, tmp_path):
    """The Step page's frame of every token (st.cache_resource) is keyed by the identities of the
    step's files: a rewrite under the same name and mtime shows the new advantages."""
    trace_cache.clear_caches()
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=1)
    at = start(monkeypatch, run, {"step": "0", "inner": "0"})
    at.switch_page("app_pages/step.py").run()
    assert not at.exception
    table = frame_with(at, {"advantages", "mask_reason", "open"}).value
    assert set(table["advantages"].abs().round(2)) == {1.0}  # group z-scores of two: +-1 (less eps)
    _rewrite(step_paths(run)[0], advantages=torch.tensor([5.0, -5.0, 3.0, -3.0]))
    at.run()
    assert not at.exception
    table = frame_with(at, {"advantages", "mask_reason", "open"}).value
    assert set(table["advantages"].abs()) == {5.0, 3.0}


@pytest.mark.parametrize("sequence", [0, 2, 3])
def test_a_sequence_read_by_slice_equals_that_row_of_the_whole_tensor(run, sequence):
    trace = SafeTrace(run, handles=StepHandles(max_handles=2))
    key = trace.steps()[3]
    row = trace.load_sequence(key, sequence)
    whole = trace.load_step(key)
    assert set(row) == set(whole)  # every field with a B dim, derived ones included
    for name, tensor in whole.items():
        torch.testing.assert_close(row[name], tensor[sequence], rtol=0, atol=0, msg=name)


def test_each_cached_handle_checks_its_header_once(run, monkeypatch):
    calls = []
    check = reader.check_step_header
    monkeypatch.setattr(reader, "check_step_header", lambda *a: (calls.append(a[0]), check(*a))[1])
    handles = StepHandles(max_handles=4)
    trace = SafeTrace(run, handles=handles)
    key = trace.steps()[0]
    for sequence in range(4):
        trace.load_sequence(key, sequence)
    assert calls == [key.path]  # once for four reads of the same open file
    plain = SafeTrace(run)  # without the cache: a check per read, as before
    calls.clear()
    for sequence in range(2):
        plain.load_sequence(key, sequence)
    assert calls == [key.path, key.path]


def test_the_listing_is_reused_until_a_step_appears(tmp_path, monkeypatch):
    monkeypatch.setattr(safe_trace, "RACY_LISTING_NS", 0)  # trust the directories' times at once
    run = tmp_path / "live"
    writer = TraceWriter(run, "grpo", hyperparameters={"num_generations": 2}, async_write=False)
    writer.record(0, healthy_step_tensors(0, 0))
    trace = SafeTrace(run)
    listings = []
    inner = trace._step_names  # every listing of steps/ starts here
    monkeypatch.setattr(trace, "_step_names", lambda: (listings.append(1), inner())[1])
    assert [k.step for k in trace.steps()] == [0]
    assert [k.step for k in trace.steps()] == [0] and trace.problems() == {}
    assert len(listings) == 1  # the second steps() and problems() reused the listing
    time.sleep(0.01)  # a later tick of the file clock
    new = writer.record(1, healthy_step_tensors(1, 0))
    writer.close()
    assert [k.step for k in trace.steps()] == [0, 1]  # steps/ changed: listed again
    assert trace.key_of(str(new)).step == 1 and trace.key_of(str(new.parent / "nope")) is None
    assert len(listings) == 2


def test_a_young_listing_is_not_reused(tmp_path, monkeypatch):
    """Within RACY_LISTING_NS of the directory's last change the listing is redone on every call
    (a step added in the same clock tick must not be missed)."""
    monkeypatch.setattr(safe_trace, "RACY_LISTING_NS", 10**18)
    run = write_trace(tmp_path / "run", steps=1)
    trace = SafeTrace(run)
    listings = []
    inner = trace._step_names  # every listing of steps/ starts here
    monkeypatch.setattr(trace, "_step_names", lambda: (listings.append(1), inner())[1])
    trace.steps()
    trace.steps()
    assert len(listings) == 2


def test_the_app_keeps_at_most_its_bound_of_open_step_files(monkeypatch, run):
    """Visiting every step file of the run with a bound of 3: at most 3 stay open, the others closed."""
    trace_cache.clear_caches()
    trace_cache.step_handles.clear()
    monkeypatch.setattr(trace_cache, "MAX_OPEN_STEP_FILES", 3)
    at = start(monkeypatch, run, page=TOKENS_PAGE)
    box = at.sidebar.selectbox(key="step_file")
    for label in box.options:
        at.sidebar.selectbox(key="step_file").select(label).run()
        assert not at.exception
        assert len(trace_cache.step_handles()) <= 3
    handles = trace_cache.step_handles()
    assert handles.opened >= len(box.options) and handles.closed >= len(box.options) - 3
    trace_cache.clear_caches()  # Reload closes the idle handles
    assert len(handles) == 0
    trace_cache.step_handles.clear()


def test_an_unreadable_file_is_not_cached(tmp_path):
    bad = tmp_path / "step_00000000.inner_0.mb_0.rank_0.safetensors"
    bad.write_bytes(b"\x00" * 4)
    handles = StepHandles(max_handles=2)
    for _ in range(2):
        with pytest.raises(TraceFormatError, match="too short"):
            with handles.lease(bad):
                pass
    assert len(handles) == 0 and handles.opened == 0
    with pytest.raises(TraceFormatError):  # gone: the opener's own message
        with handles.lease(tmp_path / "missing.safetensors"):
            pass
    assert file_id(bad)[0] == str(bad)
