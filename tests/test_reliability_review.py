"""Faults found by the adversarial review (issue 13), one test or more each, pinned to the message:
bounded reading cost of tiny hostile files, the training thread never waiting on the disk with
``when_full="drop"``, strict mode raising for every failed write, fork, odd text, B = 0 steps,
spoofed view columns, the live manifest and ``info`` on a live run. (``tracer view`` and SIGTERM:
tests/test_cli_view_signals.py; the hostile-file campaign: tests/test_reliability_hostile.py.)
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from toy_traces import ToyTokenizer, grpo_step_tensors, start, write_trace

import tracer.record.writer as writer_module
from app.components.safe_trace import BadRequestError, resolve_request
from tracer import Trace, TraceWriter, views
from tracer.checks import run_checks
from tracer.cli import main
from tracer.read.trace_info import trace_info
from tracer.errors import TraceError, TraceFormatError
from tracer.format.integrity import EMPTY_ELEMENT_BUDGET, MAX_TOKEN_ENTRIES, MAX_TOKENS_BYTES
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME, step_file_name
from tracer.views.groups import component_columns

META = {"algorithm": "grpo", "num_generations": "2", "step": "0"}


def _trace_with(tmp_path: Path, tensors: dict, meta: dict | None = None, manifest: str | None = None) -> Path:
    run = tmp_path / "run"
    (run / STEPS_DIR).mkdir(parents=True)
    (run / MANIFEST_NAME).write_text(manifest or json.dumps({"algorithm": "grpo", "status": "finished"}))
    save_file(tensors, str(run / STEPS_DIR / step_file_name(0)), metadata={**META, **(meta or {})})
    return run


def _cli_output(*argv: str) -> tuple[int, str]:
    """``tracer ARGV`` with a strict UTF-8 stdout, as a terminal or a pipe is."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", errors="strict")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    out.flush()
    return code, raw.getvalue().decode("utf-8")


# -- 1. bounded cost: zero-byte tensors with huge shapes, tokens.json ---------------------------------


def _empty_step(rows: int, cols: int) -> dict[str, torch.Tensor]:
    return {"completion_ids": torch.empty(rows, cols, dtype=torch.int64),
            "completion_mask": torch.empty(rows, cols, dtype=torch.bool), "policy_logprobs": torch.empty(rows, cols)}


@pytest.mark.parametrize("rows, cols", [(10**8, 0), (0, 10**9)])
def test_zero_byte_tensors_with_huge_shapes_are_refused_by_every_reader(tmp_path, rows, cols):
    run = _trace_with(tmp_path, _empty_step(rows, cols))
    save_file(grpo_step_tensors(1), str(run / STEPS_DIR / step_file_name(1)), metadata={**META, "step": "1"})
    path = run / STEPS_DIR / step_file_name(0)
    size = path.stat().st_size
    assert size < 1000
    # completion_ids alone spans rows * cols (a 0 counted as 1) elements, over size + 2**20
    message = (rf"{re.escape(str(path))}: field 'completion_ids' has shape \[{rows}, {cols}\]: the header's "
               rf"shapes span {max(rows, 1) * max(cols, 1)} elements, over the limit of {size + 2**20} for a "
               rf"file of {size} bytes")
    trace = Trace(run)
    key = trace.steps()[0]
    for read in (trace.load_step, trace.token_table, trace.metadata, trace.fields):
        with pytest.raises(TraceFormatError, match=message):
            read(key)
    assert re.match(message, trace.scan()[path]) and len(trace.scan()) == 1
    findings = run_checks(run)
    assert [re.search(message, f.message) is not None for f in findings if f.check == "trace.unreadable"] == [True]
    assert re.search(message, json.loads(_cli_output("info", "--json", str(run))[1])["unreadable"][str(path)])


def test_the_element_budget_is_the_file_size_plus_2_20(tmp_path):
    """A zero-byte tensor spanning exactly size + 2**20 elements reads; one more is refused."""
    path = tmp_path / "one.safetensors"

    def write(rows: int) -> int:
        save_file({"my_debug": torch.empty(rows, 0)}, str(path))
        return path.stat().st_size

    size = write(EMPTY_ELEMENT_BUDGET)
    size = write(size + EMPTY_ELEMENT_BUDGET)  # same number of digits: the size does not change
    assert write(size + EMPTY_ELEMENT_BUDGET) == size
    trace = Trace(path)
    assert trace.scan() == {}
    assert trace.fields(trace.steps()[0]) == {"my_debug": ([size + EMPTY_ELEMENT_BUDGET, 0], "F32")}
    write(size + EMPTY_ELEMENT_BUDGET + 1)
    assert f"over the limit of {size + EMPTY_ELEMENT_BUDGET} for a file of {size} bytes" in Trace(path).scan()[path]


def test_an_empty_step_of_a_long_context_is_no_false_alarm(tmp_path):
    """B = 0 with T = 32768: 5 fields span 163840 elements, well inside the budget."""
    run = _trace_with(tmp_path, {**_empty_step(0, 32768), "old_logprobs": torch.empty(0, 32768),
                                 "ratio": torch.empty(0, 32768)})
    trace = Trace(run)
    assert trace.scan() == {}
    assert trace.load_step(trace.steps()[0])["completion_ids"].shape == (0, 32768)
    assert trace.token_table(trace.steps()[0]).empty


def test_token_strings_with_too_many_entries_are_refused_naming_file_field_and_limit(tmp_path):
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=1)
    entries = MAX_TOKEN_ENTRIES + 100
    (run / TOKENS_NAME).write_text('{"tokens": [' + ",".join(['""'] * entries) + "]}")
    trace = Trace(run)
    assert trace.tokens is None
    assert trace.tokens_problem == (
        # the bound counted: entries - 1 commas, one [ and one {, plus 1
        f"{run / TOKENS_NAME}: field 'tokens' of the token strings holds up to {entries + 2} values, over the "
        f"limit of {MAX_TOKEN_ENTRIES}; refusing to parse it; token ids are shown as <id N>")
    assert trace.token_table(trace.steps()[0])["token_text"].iloc[0].startswith("<id ")


def test_token_strings_over_the_size_cap_are_refused_before_reading(tmp_path):
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=1)
    with open(run / TOKENS_NAME, "wb") as fh:  # sparse: nothing is written but the size
        fh.truncate(MAX_TOKENS_BYTES + 1)
    assert Trace(run).tokens_problem.startswith(
        f"{run / TOKENS_NAME}: the token strings is {MAX_TOKENS_BYTES + 1} bytes, over the {MAX_TOKENS_BYTES}-byte cap")


# -- 2, 3. drops off the training thread; strict mode counts and raises every failure -----------------


def _grpo(step: int) -> dict[str, torch.Tensor]:
    return grpo_step_tensors(step)


def test_with_when_full_drop_record_never_touches_the_disk(tmp_path, monkeypatch):
    """Slow writes fill the queue, steps are dropped; no fsync and no manifest write happens on the
    training thread during record(), and the manifest's count is true after close()."""
    training = threading.current_thread()
    disk_on_training_thread: list[str] = []
    real_fsync, real_save, real_json = os.fsync, writer_module._save_atomic, writer_module.write_json_atomic

    def slow_fsync(fd):
        if threading.current_thread() is training:
            disk_on_training_thread.append("fsync")
        time.sleep(0.03)
        real_fsync(fd)

    def watched_json(path, payload):
        if threading.current_thread() is training:
            disk_on_training_thread.append(f"write {path.name}")
        real_json(path, payload)

    def slow_save(path, tensors, metadata, *specs):
        time.sleep(0.02)
        real_save(path, tensors, metadata, *specs)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    monkeypatch.setattr(writer_module, "_save_atomic", slow_save)
    monkeypatch.setattr(writer_module, "write_json_atomic", watched_json)
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}, max_queue_steps=1,
                         when_full="drop")
    disk_on_training_thread.clear()  # the constructor writes the first manifest, before training
    with pytest.warns(RuntimeWarning, match=r"tracer: dropped a step \(1 so far\): step \d+: queue full \(1 steps"):
        returned = [writer.record(step, _grpo(step)) for step in range(30)]
    assert disk_on_training_thread == []
    dropped = returned.count(None)
    assert dropped >= 10 and writer.dropped_steps == dropped
    writer.close()
    manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    assert manifest["dropped_steps"] == dropped and manifest["steps_written"] == 30 - dropped
    assert len(Trace(tmp_path / "run").steps()) == 30 - dropped


def _full_disk_from(monkeypatch, first_failing_step: int) -> None:
    real_save = writer_module._save_atomic

    def save(path, tensors, metadata, *specs):
        if int(path.name[5:13]) >= first_failing_step:
            raise OSError(28, "No space left on device")
        real_save(path, tensors, metadata, *specs)

    monkeypatch.setattr(writer_module, "_save_atomic", save)


def test_strict_mode_raises_for_every_failed_write_and_counts_them_all(tmp_path, monkeypatch):
    """The disk is full from step 5 of 40: every write from then on fails on the writer thread.
    Every failure is reported by a raise (the next record/flush/close raises the first pending one
    with the count of all), and the manifest counts them all."""
    _full_disk_from(monkeypatch, 5)
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}, strict=True)
    errors: list[str] = []
    recorded = []  # a record() that raises a pending failure does not take its own step
    for step in range(40):
        try:
            writer.record(step, _grpo(step))
            recorded.append(step)
        except TraceError as err:
            errors.append(str(err))
    failed = len([s for s in recorded if s >= 5])
    for verb in (writer.flush, writer.close):
        try:
            verb()
        except TraceError as err:
            errors.append(str(err))
    pattern = (rf"tracer: writing {re.escape(str(tmp_path / 'run'))} failed: step_(\d{{8}})\.inner_0\.mb_0\.rank_0"
               r"\.safetensors: OSError: \[Errno 28\] No space left on device(?: \((\d+) writes failed since the "
               r"last error raised; all are counted in the manifest's dropped_steps\))?$")
    matches = [re.match(pattern, e) for e in errors]
    assert all(matches), errors
    assert int(matches[0].group(1)) == 5
    assert failed >= 10 and sum(int(m.group(2) or 1) for m in matches) == failed
    manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    assert manifest["dropped_steps"] == failed and manifest["steps_written"] == 5 and manifest["status"] == "finished"


def test_non_strict_mode_counts_the_same_failures(tmp_path, monkeypatch):
    _full_disk_from(monkeypatch, 5)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}) as writer:
            for step in range(12):
                writer.record(step, _grpo(step))
    manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    assert (manifest["dropped_steps"], manifest["steps_written"]) == (7, 5)


# -- 4. fork ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("async_write", [True, False])
def test_a_forked_child_using_an_inherited_writer_gets_a_trace_error_at_once(tmp_path, async_write):
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}, async_write=async_write)
    writer.record(0, _grpo(0))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: 20 records and a flush, each must raise at once
        messages = []
        for call in [*(lambda s=s: writer.record(s, _grpo(s)) for s in range(1, 21)), writer.flush,
                     lambda: writer.count_drop("x")]:
            try:
                call()
                messages.append("no error")
            except TraceError as err:
                messages.append(str(err))
        writer.close()  # quiet: the parent owns the trace
        os.write(write_end, json.dumps(messages).encode())
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        assert time.monotonic() < deadline, "the forked child hung"
        time.sleep(0.05)
    with os.fdopen(read_end) as fh:
        messages = json.loads(fh.read())
    assert len(messages) == 22
    assert all(m.startswith(f"tracer: this TraceWriter for {tmp_path / 'run'} was created by process {os.getpid()} "
                            f"and inherited through fork() by process {pid}, which cannot use it") for m in messages)
    assert "create a new TraceWriter in the child" in messages[0]
    writer.record(1, _grpo(1))  # the parent goes on
    writer.close()
    assert [k.step for k in Trace(tmp_path / "run").steps()] == [0, 1]


# -- 5. odd text: lone surrogates, null bytes, B = 0 -----------------------------------------------


def test_lone_surrogates_in_metadata_and_manifest_print_as_replacement_characters(tmp_path):
    manifest = ('{"algorithm": "grpo", "status": "finished", "config": {"\\ud800k": "\\udc00"}, '
                '"created": "\\ud83d"}')
    run = _trace_with(tmp_path, grpo_step_tensors(0), meta={"note": '"a\\ud800b"'}, manifest=manifest)
    trace = Trace(run)
    assert trace.metadata(trace.steps()[0])["note"] == "a\ufffdb"
    assert trace.manifest["config"] == {"\ufffdk": "\ufffd"} and trace.manifest["created"] == "\ufffd"
    code, out = _cli_output("info", str(run))
    assert code == 0 and "note=a\ufffdb" in out
    code, out = _cli_output("check", str(run))
    assert code in (0, 1) and "Traceback" not in out


def test_lone_surrogates_in_token_strings_reach_tables_and_pyarrow(tmp_path):
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=1)
    (run / TOKENS_NAME).write_text('{"tokens": [' + ",".join(['"\\ud800"', '"x\\udfff"', '"\\ud83d\\ude00"'] * 4) + "]}")
    trace = Trace(run)
    assert trace.tokens[:3] == ["\ufffd", "x\ufffd", "\U0001F600"]  # a valid pair stays the emoji
    table = trace.token_table(trace.steps()[0])
    pa.Table.from_pandas(table)  # what Streamlit does with a frame; raised UnicodeEncodeError before
    assert set(table["token_text"]) <= {"\ufffd", "x\ufffd", "\U0001F600"}


@pytest.mark.parametrize("requested", ["\x00", "a_run\x00/x", "~nosuchuser/x"])
def test_a_bad_run_in_the_url_gets_the_apps_own_message(tmp_path, monkeypatch, requested):
    root = tmp_path / "root"
    write_trace(root / "a_run", tokenizer=ToyTokenizer(), steps=1)
    at = start(monkeypatch, root, {"run": requested})
    assert not at.exception, [e.value for e in at.exception]
    assert at.error[0].value == "The run named in the URL is not a trace under the root."
    shown = "\n".join(t.value for t in at.text)
    assert str(Path(__file__).parent) not in shown and "Traceback" not in shown


def test_resolve_request_refuses_a_null_byte_naming_it(tmp_path):
    with pytest.raises(BadRequestError, match=r"refused to open 'run\\x00': a path cannot hold a null byte"):
        resolve_request(tmp_path, "run\x00")
    assert resolve_request(tmp_path, "~nosuchuser") == (tmp_path / "~nosuchuser").resolve()  # no ~ expansion


def _b_zero_trace(tmp_path: Path) -> Path:
    empty = {name: t[:0] for name, t in grpo_step_tensors(0).items()}
    with TraceWriter(tmp_path / "run", "grpo", tokenizer=ToyTokenizer(), hyperparameters={"num_generations": 2},
                     async_write=False) as writer:
        writer.record(0, empty)
        writer.record(1, grpo_step_tensors(1))
    return tmp_path / "run"


def test_a_b_zero_step_is_an_empty_step_in_the_views(tmp_path):
    trace = Trace(_b_zero_trace(tmp_path))
    empty, full = trace.steps()
    assert views.group_frame(trace, empty).empty
    shares = views.zero_variance_shares(trace)
    assert shares["groups"].tolist() == [0, 2]
    assert math.isnan(shares["zero_variance_share"][0]) and shares["zero_variance_share"][1] == 0.0
    assert trace.token_table(empty).empty and trace.step_summary()["step"].tolist() == [0, 1]


@pytest.mark.parametrize("page", ["groups", "tokens", "steps", "health", "overview"])
def test_the_app_shows_a_b_zero_step_without_an_exception(tmp_path, monkeypatch, page):
    at = start(monkeypatch, _b_zero_trace(tmp_path))
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    infos = [i.value for i in at.info]
    if page == "groups":
        assert "Empty step: this step file holds no sequences (B = 0). It has no groups." in infos
    if page == "tokens":
        assert "Empty step: this step file holds no sequences (B = 0)." in infos


# -- 6. reward component names that collide with the view's columns -----------------------------------


def test_component_names_that_collide_with_view_columns_are_prefixed(tmp_path):
    tensors = grpo_step_tensors(0)  # rewards 1.0, 0.0, 0.5, 0.25
    tensors["reward_components"] = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])
    run = _trace_with(tmp_path, tensors, meta={"reward_component_names": '["reward", "advantage", "reward"]'})
    trace = Trace(run)
    frame = views.group_completions(trace, trace.steps()[0], 0)
    assert frame["reward"].tolist() == [1.0, 0.0]  # as recorded, not a component
    # as recorded: (r - mean) / (population std + 1e-4) of rewards 1 and 0
    assert frame["advantage"].tolist() == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001])
    assert frame["component: reward"].tolist() == pytest.approx([0.1, 0.4])
    assert frame["component: advantage"].tolist() == pytest.approx([0.2, 0.5])
    assert frame["component: 2 reward"].tolist() == pytest.approx([0.3, 0.6])
    assert component_columns(["a", "b"], 2) == ["a", "b"]
    assert component_columns(["a"], 2) == ["component_0", "component_1"]


# -- 8. live runs: the manifest's live counts, info during writing --------------------------------


def test_the_background_writer_updates_steps_written_while_the_run_goes_on(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2})
    for step in range(6):
        writer.record(step, _grpo(step))
    deadline, manifest = time.monotonic() + 30, {}
    while time.monotonic() < deadline:  # no flush(): the writer thread must do it on its own
        manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
        if manifest.get("steps_written") == 6:
            break
        time.sleep(0.1)
    assert manifest["steps_written"] == 6 and manifest["status"] == "running"
    writer.close()


def test_manifest_updates_are_rate_bounded(tmp_path, monkeypatch):
    writes: list[float] = []
    real_json = writer_module.write_json_atomic

    def counted(path, payload):
        if path.name == MANIFEST_NAME:
            writes.append(time.monotonic())
        real_json(path, payload)

    monkeypatch.setattr(writer_module, "write_json_atomic", counted)
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2})
    t0 = time.monotonic()
    for step in range(60):
        writer.record(step, _grpo(step))
    writer.close()
    elapsed = time.monotonic() - t0
    # the constructor's write, one per MANIFEST_INTERVAL_S at most, and the final one
    assert len(writes) <= 2 + math.ceil(elapsed / writer_module.MANIFEST_INTERVAL_S)


def test_scan_lists_the_directory_once_so_a_new_file_is_never_foreign(tmp_path, monkeypatch):
    """A live writer adds a step file between two listings: before, scan() called it "not listed
    as a step"; now it lists once."""
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=2)
    trace = Trace(run)
    real = Trace._step_paths
    calls = []

    def growing(self):
        paths = real(self)
        calls.append(1)
        return paths[:-1] if len(calls) == 1 else paths  # the last file appears after the first listing

    monkeypatch.setattr(Trace, "_step_paths", growing)
    assert trace.scan() == {}


def test_info_on_a_live_run_never_calls_a_new_file_foreign(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2})
    stop = threading.Event()

    def train():
        step = 0
        while not stop.is_set():
            writer.record(step, _grpo(step))
            step += 1
            time.sleep(0.002)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        for _ in range(40):
            assert trace_info(tmp_path / "run")["unreadable"] == {}
    finally:
        stop.set()
        thread.join()
        writer.close()


def test_info_prints_a_trace_path_that_is_not_utf8_escaped(tmp_path):
    run = write_trace(tmp_path / os.fsdecode(b"run\xff"), tokenizer=ToyTokenizer(), steps=1)
    code, out = _cli_output("info", str(run))
    assert code == 0 and "run\\udcff" in out.splitlines()[0]
