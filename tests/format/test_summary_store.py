"""The run's summary columns (``summary_index.rank_N.columns``, tracer.format.summary_store): the
index compacted by the writer at close (and at a forced flush once it has grown enough); a reader
that starts from them parses only the index lines after them, and ``step_summary()`` from them
equals ``step_summary()`` from the step headers (the index hidden) whole, with newer files, replaced
files, a missing, torn, foreign or stale store, several ranks and a restarted run."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest
from safetensors.numpy import load_file, save_file

from tracer.format import run_index, summary_store
from tracer.format import summary as summary_format
from tracer.format.names import STEPS_DIR, step_file_name, summary_index_name, summary_store_name
from tracer.read import Trace
from tracer.record.writer import TraceWriter

from tests.fixtures.run_index import (HYPER, assert_same_summary, index_lines, indexed_step, summary_from_headers,
                                      write_run)


def _store(out, rank: int = 0):
    return out / summary_store_name(rank)


def _parsed(monkeypatch) -> list[int]:
    """The number of index lines each parse of the reader (or the writer's compaction) handles."""
    parsed: list[int] = []
    real = run_index._entries
    monkeypatch.setattr(run_index, "_entries", lambda lines: parsed.append(len(lines)) or real(lines))
    return parsed


def test_close_compacts_the_index_into_columns_that_hold_each_line(tmp_path):
    out = write_run(tmp_path / "run", steps=4, inner_steps=2)
    columns = summary_store.read_store(_store(out))
    lines = [json.loads(line) for line in index_lines(out)]
    assert columns is not None and len(columns) == 8
    assert columns.writer == lines[0]["writer"]
    assert columns.index_bytes == (out / summary_index_name(0)).stat().st_size  # the whole index
    assert oct(_store(out).stat().st_mode & 0o777) == oct((out / summary_index_name(0)).stat().st_mode & 0o777)
    for entry in lines[1:]:
        row = list(columns.names).index(entry["file"])
        assert columns.coordinates[row].tolist() == [entry[k] for k in ("step", "inner_step", "micro_batch", "rank")]
        assert columns.size[row] == entry["size"]
        assert bytes(columns.content_sha256[row]).hex() == entry["content_sha256"]
        assert columns.derived_texts[columns.derived[row]] == ", ".join(entry["derived"])
        held = {k: columns.values[row, j] for j, k in enumerate(columns.keys) if columns.present[row, j]}
        assert list(held) == [k for k in entry["summary"] if k != "version"]  # same keys, same order
        for key, value in held.items():  # NaN as NaN, counts exact
            assert value == entry["summary"][key] or (np.isnan(value) and entry["summary"][key] != entry["summary"][key])


def test_a_reader_from_the_columns_parses_no_index_line_and_gives_the_header_frame(tmp_path, monkeypatch):
    out = write_run(tmp_path / "run", steps=6, inner_steps=2, micro_batches=2)
    parsed = _parsed(monkeypatch)
    frame = assert_same_summary(out, from_index=24)
    assert sum(parsed) == 0  # every row from the columns (no index line parsed); the headers path opened every file
    assert frame["kept_tokens"].dtype == np.int64 and frame["mean_ratio"].isna().sum() == 12
    assert list(frame.columns[:4]) == ["step", "inner_step", "micro_batch", "rank"]
    assert list(frame.columns[-2:]) == ["summary_source", "derived"]


def test_files_written_after_the_columns_come_from_the_index_lines_after_them(tmp_path, monkeypatch):
    monkeypatch.setattr(run_index, "MIN_COMPACT_LINES", 3)
    parsed = _parsed(monkeypatch)
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters=HYPER)
    for step in range(4):
        writer.record(step, indexed_step(step))
    writer.flush()  # 4 new lines >= 3: compacted
    assert len(summary_store.read_store(_store(tmp_path / "run"))) == 4 and parsed == [4]
    for step in range(4, 6):
        writer.record(step, indexed_step(step))
    writer.flush()  # 2 new lines < max(3, 4 in the columns): appended to the index only
    assert len(summary_store.read_store(_store(tmp_path / "run"))) == 4 and parsed == [4]
    frame = assert_same_summary(tmp_path / "run", from_index=6)
    assert parsed == [4, 2]  # the reader parsed the two lines after the columns, not the first four
    assert frame["step"].tolist() == list(range(6))
    writer.close()
    assert len(summary_store.read_store(_store(tmp_path / "run"))) == 6 and parsed[-1] == 2  # only the new lines
    assert_same_summary(tmp_path / "run", from_index=6)


def test_a_replaced_or_resized_step_file_is_read_from_its_header(tmp_path):
    out = write_run(tmp_path / "run", steps=4)
    with TraceWriter(tmp_path / "other", "grpo", hyperparameters=HYPER) as writer:
        writer.record(2, indexed_step(999, B=9))  # another step 2, another size
    os.replace(tmp_path / "other" / STEPS_DIR / step_file_name(2), out / STEPS_DIR / step_file_name(2))
    with open(out / STEPS_DIR / step_file_name(3), "ab") as fh:
        fh.write(b"\0")  # grown in place: the directory does not change, the size does
    frame = assert_same_summary(out, from_index=2)
    assert frame.loc[frame["step"] == 2, "kept_tokens"].item() == int(indexed_step(999, B=9)["completion_mask"].sum())
    assert "problem" in frame and frame["problem"].notna().tolist() == [False, False, False, True]


def test_a_deleted_file_and_a_file_the_columns_do_not_list(tmp_path):
    out = write_run(tmp_path / "run", steps=4)
    (out / STEPS_DIR / step_file_name(1)).unlink()
    save_file_torch(out / STEPS_DIR / step_file_name(9))
    frame = assert_same_summary(out, from_index=3)
    assert frame["step"].tolist() == [0, 2, 3, 9]
    assert frame["summary_source"].tolist() == ["header", "header", "header", "tensors"]


def save_file_torch(path):
    from safetensors.torch import save_file as save

    save(indexed_step(7), str(path), metadata={"algorithm": "grpo", "step": "9"})


def test_a_step_file_at_the_root_under_a_listed_name_is_not_vouched_for(tmp_path):
    out = write_run(tmp_path / "run", steps=3)
    os.replace(out / STEPS_DIR / step_file_name(1), out / step_file_name(1))  # same name and size, not in steps/
    frame = assert_same_summary(out, from_index=2)
    assert frame["step"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("damage", ["missing", "torn", "foreign", "stale", "other_writer", "hostile", "bad_rows"])
def test_columns_that_cannot_be_trusted_are_ignored(tmp_path, damage):
    out = write_run(tmp_path / "run", steps=5)
    store = _store(out)
    if damage == "missing":
        store.unlink()
    elif damage == "torn":
        store.write_bytes(store.read_bytes()[: store.stat().st_size // 2])
    elif damage == "foreign":
        store.write_bytes(b"not a safetensors file at all")
    elif damage == "stale":  # the index cut below what the columns compact (a crash, a copy): the index is read
        lines = index_lines(out)
        (out / summary_index_name(0)).write_text("".join(lines[:3]))
    elif damage == "other_writer":
        lines = index_lines(out)
        head = json.loads(lines[0])
        (out / summary_index_name(0)).write_text(json.dumps({**head, "writer": "0" * 32}) + "\n" + "".join(lines[1:]))
    elif damage == "hostile":
        tensors = load_file(str(store))
        tensors["values"] = tensors["values"][:, :2].copy()  # shapes that disagree with the keys
        save_file(tensors, str(store), metadata=summary_store_metadata(store))
    else:  # rows whose counts or derived ids are out of range
        tensors = load_file(str(store))
        tensors["derived"] = np.full_like(tensors["derived"], 7)
        save_file(tensors, str(store), metadata=summary_store_metadata(store))
    trace = Trace(out)
    frame = trace.step_summary()
    assert trace.summary_columns() is None
    expected = 2 if damage == "stale" else 5  # the stale index lists steps 0 and 1
    assert frame.attrs["from_index"] == expected
    pd.testing.assert_frame_equal(frame, summary_from_headers(out), check_exact=True)


def summary_store_metadata(store):
    from safetensors import safe_open

    with safe_open(str(store), framework="np") as fh:
        return fh.metadata()


def test_a_row_whose_coordinates_disagree_with_its_file_is_not_used(tmp_path):
    out = write_run(tmp_path / "run", steps=3)
    store = _store(out)
    tensors, meta = load_file(str(store)), summary_store_metadata(store)
    tensors["coordinates"][1, 0] = 7  # the row of step_00000001 claims step 7
    save_file(tensors, str(store), metadata=meta)
    assert_same_summary(out, from_index=2)


def test_several_ranks_each_compact_their_own_index(tmp_path, monkeypatch):
    out = tmp_path / "run"
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        write_run(out, steps=3)
    assert [len(summary_store.read_store(_store(out, r))) for r in (0, 1)] == [3, 3]
    frame = assert_same_summary(out, from_index=6)
    assert frame["rank"].tolist() == [0, 1] * 3
    _store(out, 1).unlink()  # rank 1 from its index lines, rank 0 from its columns
    assert_same_summary(out, from_index=6)


def test_a_restarted_run_drops_the_older_columns(tmp_path):
    out = write_run(tmp_path / "run", steps=4)
    old = summary_store.read_store(_store(out))
    for key in Trace(out).steps():
        key.path.unlink()
    writer = TraceWriter(out, "grpo", hyperparameters=HYPER)
    assert not _store(out).exists()  # removed when the new writer started
    for step in range(2):
        writer.record(step, indexed_step(50 + step))
    writer.close()
    new = summary_store.read_store(_store(out))
    assert len(new) == 2 and new.writer != old.writer
    assert_same_summary(out, from_index=2)


def test_a_summary_of_another_version_is_not_compacted(tmp_path):
    out = write_run(tmp_path / "run", steps=3)
    lines = index_lines(out)
    entry = json.loads(lines[2])
    entry["summary"]["version"] = summary_format.SUMMARY_VERSION + 1
    lines[2] = json.dumps(entry) + "\n"
    (out / summary_index_name(0)).write_text("".join(lines))
    entries = run_index._entries([line.encode().rstrip(b"\n") for line in lines[1:]])
    columns = summary_store.build_columns(entries.values())
    assert sorted(columns.names.tolist()) == [step_file_name(0), step_file_name(2)]


def test_merged_columns_keep_the_newer_row_of_a_file_and_every_key(tmp_path):
    def entry(step, **summary):
        return {"file": step_file_name(step), "step": step, "inner_step": 0, "micro_batch": 0, "rank": 0,
                "size": 100 + step, "content_sha256": None, "derived": "", "summary": summary}

    old = summary_store.build_columns([entry(0, kept_tokens=3), entry(1, kept_tokens=4)])
    new = summary_store.build_columns([entry(1, kept_tokens=5, mean_ratio=1.5), entry(2, mean_ratio=float("nan"))])
    both = summary_store.merged(old, new)
    assert both.names.tolist() == [step_file_name(0), step_file_name(1), step_file_name(2)]
    assert both.keys == ("kept_tokens", "mean_ratio")
    assert both.present.tolist() == [[True, False], [True, True], [False, True]]
    assert both.values[1].tolist() == [5.0, 1.5] and np.isnan(both.values[2, 1])
