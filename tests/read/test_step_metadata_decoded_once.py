"""Step metadata is decoded once per step file and cached (``tracer.read.metadata_cache``): the reader,
the check contexts, the KL and micro-batch checks and the run overview share one decode; metadata of
more keys or characters than any real step holds is refused with one message naming the file."""

from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import save_file

from tracer import Trace
from tracer.checks import run_checks
from tracer.cli import main
from tracer.errors import SchemaError, TraceFormatError
from tracer.format.integrity import MAX_METADATA_BYTES, MAX_METADATA_KEYS
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, step_file_name
from tracer.read.metadata_cache import MetadataCache
from tracer.record.writer import TraceWriter

from tests.fixtures.toy_traces import ToyTokenizer, grpo_step_tensors, write_trace


def _trace_with_metadata(tmp_path, extra: dict[str, str], steps: int = 3):
    run = tmp_path / "run"
    (run / STEPS_DIR).mkdir(parents=True)
    (run / MANIFEST_NAME).write_text(json.dumps({"algorithm": "grpo", "status": "finished"}))
    for step in range(steps):
        save_file(grpo_step_tensors(step), str(run / STEPS_DIR / step_file_name(step)),
                  metadata={"algorithm": "grpo", "num_generations": "2", "step": str(step), **extra})
    return run


def test_a_check_pass_decodes_each_step_files_metadata_once(tmp_path):
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=3)
    trace = Trace(run)
    run_checks(trace)
    trace.step_summary()
    for key in trace.steps():
        trace.metadata(key), trace.load_step(key), trace.token_table(key)
    assert trace._metadata_cache.decodes == len(trace.steps())  # 3 steps x inner steps 0 and 1


def test_a_large_but_allowed_header_is_decoded_once(tmp_path):
    run = _trace_with_metadata(tmp_path, {f"k{i:05d}": "1" for i in range(MAX_METADATA_KEYS - 10)})
    trace = Trace(run)
    run_checks(trace)
    assert trace._metadata_cache.decodes == 3


def test_metadata_handed_out_is_a_copy(tmp_path):
    trace = Trace(_trace_with_metadata(tmp_path, {}, steps=1))
    key = trace.steps()[0]
    trace.metadata(key).clear()
    assert trace.metadata(key)["algorithm"] == "grpo"


def test_a_file_replaced_under_its_name_is_decoded_again(tmp_path):
    run = _trace_with_metadata(tmp_path, {"note": "first"}, steps=1)
    trace = Trace(run)
    key = trace.steps()[0]
    assert trace.metadata(key)["note"] == "first"
    save_file(grpo_step_tensors(0), str(key.path) + ".tmp", metadata={"algorithm": "grpo", "note": "second!"})
    (run / STEPS_DIR / (key.path.name + ".tmp")).replace(key.path)
    assert trace.metadata(key)["note"] == "second!"


def test_the_cache_is_bounded_by_the_characters_it_holds(tmp_path):
    run = _trace_with_metadata(tmp_path, {"pad": "x" * 1000}, steps=3)
    trace = Trace(run)
    trace._metadata_cache = cache = MetadataCache(max_chars=2500)  # room for two files' metadata
    for key in trace.steps():
        trace.metadata(key)
    trace.metadata(trace.steps()[-1])
    assert cache.decodes == 3
    trace.metadata(trace.steps()[0])  # dropped, least recently used
    assert cache.decodes == 4


def test_metadata_with_too_many_keys_is_refused_naming_the_file(tmp_path, capsys):
    run = _trace_with_metadata(tmp_path, {f"k{i:06d}": "1" for i in range(100_000)})  # 1.4 MB per file
    path = run / STEPS_DIR / step_file_name(0)
    message = (f"{path}: the step metadata holds 100003 keys, over the limit of {MAX_METADATA_KEYS} (real steps "
               "hold a few dozen: hyperparameters and small values); refusing to decode it")
    trace = Trace(run)
    for read in (trace.metadata, trace.load_step, trace.token_table):
        with pytest.raises(TraceFormatError, match=re.escape(message)):
            read(trace.steps()[0])
    assert trace.scan()[path] == message
    assert main(["check", str(run)]) == 2
    assert message in capsys.readouterr().err
    assert main(["info", str(run)]) == 2  # no step file can be read: nothing to summarise (as check)
    assert message in capsys.readouterr().err


def test_metadata_over_the_size_limit_is_refused_naming_the_file(tmp_path):
    run = _trace_with_metadata(tmp_path, {"note": "x" * (MAX_METADATA_BYTES + 1)}, steps=1)
    with pytest.raises(TraceFormatError, match=r"step metadata holds \d+ characters of keys and values, over the "
                                                rf"limit of {MAX_METADATA_BYTES}"):
        Trace(run).metadata(Trace(run).steps()[0])


def test_the_writer_refuses_metadata_the_reader_would_refuse(tmp_path):
    too_many = {f"k{i}": 1 for i in range(MAX_METADATA_KEYS)}  # with the writer's own keys: over the limit
    with (TraceWriter(tmp_path / "run", "grpo", async_write=False) as writer,
          pytest.raises(SchemaError, match=rf"exceeds {MAX_METADATA_KEYS} keys; readers refuse headers")):
        writer.record(0, grpo_step_tensors(0), metadata=too_many)
