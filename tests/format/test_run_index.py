"""The run's summary index (``summary_index.rank_N.jsonl``, tracer.format.run_index): written by
the writer thread from real records; ``step_summary()`` from it equals ``step_summary()`` from the
step headers (the index hidden) on the same trace, whole, partial, torn, stale, foreign and
multi-rank; files it vouches for are not opened; a failing index never reaches training."""

from __future__ import annotations

import json
import logging
import os
from unittest import mock

import pandas as pd
from safetensors.torch import save_file

from tests.fixtures.paths import REPO
from tests.fixtures.run_index import (
    HYPER,
    assert_same_summary,
    index_lines,
    indexed_step,
    summary_from_headers,
    write_run,
)
from tracer.format import run_index
from tracer.format.metadata_codec import decode_metadata
from tracer.format.names import STEPS_DIR, step_file_name, summary_index_name
from tracer.format.summary import SUMMARY_VERSION
from tracer.read import Trace
from tracer.read.trace_info import trace_info
from tracer.record.writer import TraceWriter


def test_one_line_per_step_file_with_its_name_size_checksum_and_header_summary(tmp_path):
    out = write_run(tmp_path / "run", steps=3, inner_steps=2)
    lines = [json.loads(line) for line in index_lines(out)]
    assert {k: v for k, v in lines[0].items() if k != "writer"} == {"format": "tracer-summary-index", "version": 1,
                                                                     "rank": 0}
    assert len(lines[0]["writer"]) == 32  # a token per writer: a reader sees when the file was started again
    trace = Trace(out)
    keys = trace.steps()
    assert sorted(e["file"] for e in lines[1:]) == sorted(k.path.name for k in keys) and len(lines) == 7
    for entry in lines[1:]:
        key = next(k for k in keys if k.path.name == entry["file"])
        meta = trace.metadata(key)
        assert (entry["step"], entry["inner_step"], entry["micro_batch"], entry["rank"]) == \
            (key.step, key.inner_step, key.micro_batch, key.rank)
        assert entry["size"] == key.path.stat().st_size
        assert entry["content_sha256"] == meta["content_sha256"]
        assert json.dumps(entry["summary"]) == json.dumps(meta["summary"])  # NaN as NaN, same order
        assert entry["derived"] == trace.derived_fields(key)
    assert any(e["derived"] == ["ratio", "ref_kl_k3", "approx_kl_k2"] for e in lines[1:])  # odd steps record no ratio
    assert any(e["derived"] == [] for e in lines[1:])


def test_index_and_headers_give_the_same_frame(tmp_path):
    out = write_run(tmp_path / "run", steps=6, inner_steps=2, micro_batches=2)
    frame = assert_same_summary(out, from_index=24)
    assert frame["mean_ratio"].isna().sum() == 12  # the NaN at a kept position, as the loss would see it
    assert set(frame["derived"]) == {"", "ratio, ref_kl_k3, approx_kl_k2"}


def test_tracer_info_overview_is_the_same_with_and_without_the_index(tmp_path):
    out = write_run(tmp_path / "run", steps=4)
    with mock.patch.object(run_index, "index_paths", return_value=[]):
        without = trace_info(out)
    assert json.dumps(trace_info(out), default=str, sort_keys=True) == json.dumps(without, default=str, sort_keys=True)


def test_a_partial_index_lists_some_files_and_the_others_are_read_from_their_headers(tmp_path):
    out = write_run(tmp_path / "run", steps=6)
    lines = index_lines(out)
    (out / summary_index_name(0)).write_text("".join(lines[:4]))
    assert_same_summary(out, from_index=3)


def test_a_torn_last_line_is_skipped(tmp_path):
    out = write_run(tmp_path / "run", steps=4)
    lines = index_lines(out)
    (out / summary_index_name(0)).write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    assert_same_summary(out, from_index=3)
    # a complete last line without its newline is still what a live writer may be writing: skipped
    (out / summary_index_name(0)).write_text("".join(lines)[:-1])
    assert_same_summary(out, from_index=3)


def test_a_replaced_step_file_is_read_from_its_header(tmp_path):
    out = write_run(tmp_path / "run", steps=4)
    path = out / STEPS_DIR / step_file_name(2)
    with TraceWriter(tmp_path / "other", "grpo", hyperparameters=HYPER) as writer:
        writer.record(2, indexed_step(999, B=9))  # another step 2, another size
    os.replace(tmp_path / "other" / STEPS_DIR / step_file_name(2), path)
    frame = assert_same_summary(out, from_index=3)
    assert frame.loc[frame["step"] == 2, "kept_tokens"].item() == int(indexed_step(999, B=9)["completion_mask"].sum())


def test_a_deleted_step_file_is_not_listed_and_a_file_not_in_the_index_is_read(tmp_path):
    out = write_run(tmp_path / "run", steps=4)
    (out / STEPS_DIR / step_file_name(1)).unlink()
    assert_same_summary(out, from_index=3)
    tensors = {k: v for k, v in indexed_step(7).items()}
    save_file(tensors, str(out / STEPS_DIR / step_file_name(9)), metadata={"algorithm": "grpo", "step": "9"})
    frame = assert_same_summary(out, from_index=3)
    assert frame.loc[frame["step"] == 9, "summary_source"].item() == "tensors"


def test_an_index_of_another_format_or_version_is_ignored(tmp_path):
    out = write_run(tmp_path / "run", steps=3)
    lines = index_lines(out)
    for head in ('{"format": "tracer-summary-index", "version": 99, "rank": 0}\n', '{"format": "other"}\n',
                 "not json\n", ""):
        (out / summary_index_name(0)).write_text(head + "".join(lines[1:]))
        assert_same_summary(out, from_index=0)


def test_hostile_lines_are_skipped_and_a_summary_this_reader_does_not_know_is_read_from_the_header(tmp_path):
    out = write_run(tmp_path / "run", steps=4)
    lines = index_lines(out)
    entries = [json.loads(line) for line in lines[1:]]
    entries[0]["summary"]["version"] = SUMMARY_VERSION + 1  # another summary version: read the header instead
    entries[1]["step"] = 7  # coordinates that disagree with the file name
    entries[2]["size"] = "big"  # a wrong type
    bad = [json.dumps(e) + "\n" for e in entries[:3]] + ["[1, 2]\n", "\xff\n"]
    (out / summary_index_name(0)).write_text(lines[0] + "".join(bad) + lines[4], errors="surrogateescape")
    assert_same_summary(out, from_index=1)


def test_several_ranks_each_write_their_own_index(tmp_path, monkeypatch):
    out = tmp_path / "run"
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        write_run(out, steps=3)
    assert len(index_lines(out, 0)) == len(index_lines(out, 1)) == 4
    frame = assert_same_summary(out, from_index=6)
    assert sorted(frame["rank"].unique()) == [0, 1]
    (out / summary_index_name(1)).unlink()
    assert_same_summary(out, from_index=3)


def test_a_new_writer_starts_a_fresh_index(tmp_path):
    out = write_run(tmp_path / "run", steps=4)
    for key in Trace(out).steps():
        key.path.unlink()  # the user empties steps/ and traces again into the same directory
    write_run(out, steps=2)
    assert [json.loads(line)["file"] for line in index_lines(out)[1:]] == [step_file_name(0), step_file_name(1)]
    assert_same_summary(out, from_index=2)


def test_lines_are_appended_at_flush_not_per_step(tmp_path, monkeypatch):
    monkeypatch.setattr(run_index, "FLUSH_INTERVAL_S", 1e9)  # the writer thread's tick never flushes
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters=HYPER)
    writes = []
    real_write = os.write
    def spy(fd, data):  # the index's appends only (step files and the rollout summaries are written with os.write too)
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("summary_index.rank_"):
            writes.append(data)
        return real_write(fd, data)

    monkeypatch.setattr(run_index.os, "write", spy)
    for step in range(3):
        writer.record(step, indexed_step(step))
    writer._background.flush()  # the files are written; the index lines are only buffered
    assert writes == [] and len(index_lines(tmp_path / "run")) == 1  # the first line, written at once
    writer.flush()
    assert len(writes) == 1 and len(index_lines(tmp_path / "run")) == 4  # one append for all of them
    writer.close()
    assert_same_summary(tmp_path / "run", from_index=3)


def test_a_failing_index_never_reaches_training(tmp_path, monkeypatch, caplog):
    real_write = os.write

    def refuse(fd, data):  # the index's appends only (step files are written with os.write too)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".jsonl"):
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(run_index.os, "write", refuse)
    with caplog.at_level(logging.WARNING, logger="tracer.format.run_index"):
        out = write_run(tmp_path / "run", steps=3, strict=True)
    assert "abandoned" in caplog.text
    assert len(Trace(out).steps()) == 3
    assert_same_summary(out, from_index=0)


def test_an_index_that_cannot_be_created_leaves_the_trace_as_before(tmp_path, caplog):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / summary_index_name(0)).mkdir()  # something that is not a file is in the way
    with caplog.at_level(logging.WARNING, logger="tracer.format.run_index"):
        out = write_run(tmp_path / "run", steps=2)
    assert "abandoned" in caplog.text
    assert_same_summary(out, from_index=0)


def test_the_apps_listing_does_not_open_files_the_index_vouches_for(tmp_path):
    from app.components import safe_trace

    out = write_run(tmp_path / "run", steps=4)
    with open(out / STEPS_DIR / step_file_name(3), "r+b") as fh:  # a torn header, same size as before
        fh.write(b"\xff" * 16)
    calls = []
    real = safe_trace.header_problem
    with mock.patch.object(safe_trace, "header_problem", lambda *a: calls.append(a[0]) or real(*a)):
        assert len(safe_trace.SafeTrace(out).steps()) == 4 and calls == []
        (out / summary_index_name(0)).write_text("".join(index_lines(out)[:3]))  # lists steps 0 and 1 only
        trace = safe_trace.SafeTrace(out)
        assert [k.step for k in trace.steps()] == [0, 1, 2]  # step 3's header is read: set aside
    assert sorted(p.name for p in calls) == [step_file_name(2), step_file_name(3)]
    assert "unreadable" in trace.problems()[out / STEPS_DIR / step_file_name(3)]


def test_a_single_step_file_has_no_index(tmp_path):
    out = write_run(tmp_path / "run", steps=1)
    trace = Trace(out / STEPS_DIR / step_file_name(0))
    assert trace.summary_index() == {} and trace.step_summary().attrs["from_index"] == 0


def test_decoded_header_summary_is_what_the_index_holds(tmp_path):
    """Independent of the reader: the index line's summary is the header's ``summary`` JSON text."""
    from safetensors import safe_open

    out = write_run(tmp_path / "run", steps=2)
    for line in index_lines(out)[1:]:
        entry = json.loads(line)
        with safe_open(str(out / STEPS_DIR / entry["file"]), "pt") as fh:
            raw = fh.metadata()
        assert line.endswith(f', "summary": {raw["summary"]}}}\n')
        assert decode_metadata(raw)["content_sha256"] == entry["content_sha256"]


def test_a_quiet_trace_is_listed_once_and_a_change_is_seen_at_once(tmp_path, monkeypatch):
    from tracer.read import step_table

    out = write_run(tmp_path / "run", steps=3)
    listings = []
    real = step_table.listed_step_files
    monkeypatch.setattr(step_table, "listed_step_files", lambda folder: listings.append(folder) or real(folder))
    trace = Trace(out)
    trace.steps(), trace.steps()
    assert len(listings) == 4  # just written (modified under QUIET_S ago): listed every time
    past = 1_000_000_000 * 10**9  # 2001: both folders quiet for years
    for folder in (out, out / STEPS_DIR):
        os.utime(folder, ns=(past, past))
    listings.clear()
    assert [k.step for k in trace.steps()] == [0, 1, 2] and [k.step for k in trace.steps()] == [0, 1, 2]
    assert len(listings) == 2  # listed once (steps/ and the root), then reused
    os.replace(out / STEPS_DIR / step_file_name(2), out / STEPS_DIR / step_file_name(7))  # the folder changes
    assert [k.step for k in trace.steps()] == [0, 1, 7]
    os.utime(out / STEPS_DIR, ns=(past, past))  # even a change that restores an older time is a change
    assert [k.step for k in trace.steps()] == [0, 1, 7] and len(listings) == 6


def test_a_live_index_is_read_where_it_grew(tmp_path, monkeypatch):
    parsed = []
    real = run_index._entries
    monkeypatch.setattr(run_index, "_entries", lambda lines: parsed.append(len(lines)) or real(lines))
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters=HYPER)
    trace = Trace(tmp_path / "run")
    for step in range(3):
        writer.record(step, indexed_step(step))
    writer.flush()
    assert trace.step_summary().attrs["from_index"] == 3 and parsed == [3]
    trace.step_summary()
    assert parsed == [3]  # nothing new: not read again
    for step in range(3, 5):
        writer.record(step, indexed_step(step))
    writer.close()  # compacts the index into columns: the writer parses its five lines once
    assert parsed == [3, 5]
    assert trace.step_summary().attrs["from_index"] == 5 and parsed == [3, 5, 2]  # the reader: only the two new lines
    pd.testing.assert_frame_equal(trace.step_summary(), summary_from_headers(tmp_path / "run"))


def test_a_reader_sees_a_new_writer_start_the_index_again(tmp_path):
    out = write_run(tmp_path / "run", steps=3)
    trace = Trace(out)
    before = trace.step_summary()
    for key in trace.steps():
        key.path.unlink()
    with TraceWriter(out, "grpo", hyperparameters=HYPER) as writer:  # same names, same sizes, other values
        for step in range(3):
            writer.record(step, indexed_step(50 + step))
    after = trace.step_summary()  # the same Trace: its index cache must not keep the old run's lines
    assert after.attrs["from_index"] == 3
    pd.testing.assert_frame_equal(after, summary_from_headers(out))
    assert not after["mean_reward"].equals(before["mean_reward"])


def test_a_file_corrupted_in_place_at_its_size_fails_cleanly_when_a_page_reads_it(tmp_path, monkeypatch):
    """The index vouches by name and size only: such a file stays listed (the sidebar offers it) and
    the page that reads it says it cannot be read, never raises."""
    from streamlit.testing.v1 import AppTest

    from app.components import trace_cache

    out = write_run(tmp_path / "run", steps=3)
    with open(out / STEPS_DIR / step_file_name(2), "r+b") as fh:
        fh.write(b"\xff" * 16)
    monkeypatch.setenv("TRACER_ROOT", str(tmp_path))
    at = AppTest.from_file(str(REPO / "app" / "streamlit_app.py"), default_timeout=120)
    at.query_params.update({"run": "run", "step": "2"})
    trace_cache.clear_caches()
    at.switch_page("app_pages/step.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="step_file").value.startswith("step 2 ")
    assert any("cannot be read" in e.value for e in at.error)
