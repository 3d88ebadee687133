"""Hostile inputs, each pinned to the message: the bounded reading cost of tiny hostile files
(zero-byte tensors with huge shapes, oversized token strings), odd text (lone surrogates, null bytes, a
path that is not UTF-8), B = 0 steps in the views and the app, reward component names that collide
with the views' columns. (Write faults: test_write_faults.py; live runs: test_live_runs.py; ``tracer
view`` and SIGTERM: tests/cli/test_view_signals.py; the hostile-file campaign: test_hostile_campaign.py.)
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from app.components.safe_trace import BadRequestError, resolve_request
from tracer import Trace, TraceWriter, views
from tracer.checks import run_checks
from tracer.cli import main
from tracer.errors import TraceFormatError
from tracer.format.integrity import EMPTY_ELEMENT_BUDGET, MAX_TOKEN_ENTRIES, MAX_TOKENS_BYTES
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME, step_file_name
from tracer.views.groups import component_columns

from tests.fixtures.paths import TESTS
from tests.fixtures.toy_traces import ToyTokenizer, grpo_step_tensors, start, write_trace


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


# -- bounded cost: zero-byte tensors with huge shapes, tokens.json ---------------------------------


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


# -- odd text: lone surrogates, null bytes, B = 0 -----------------------------------------------


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
    assert str(TESTS) not in shown and "Traceback" not in shown


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


# -- reward component names that collide with the view's columns -----------------------------------


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


def test_info_prints_a_trace_path_that_is_not_utf8_escaped(tmp_path):
    run = write_trace(tmp_path / os.fsdecode(b"run\xff"), tokenizer=ToyTokenizer(), steps=1)
    code, out = _cli_output("info", str(run))
    # the reader opens step files with safetensors' numpy API, which takes a path that is not UTF-8
    # (its torch API refuses one): info reads both step files, the path printed escaped on a strict
    # UTF-8 stdout
    assert code == 0 and "run\\udcff" in out.splitlines()[0]
    assert "step files: 2" in out and "2 from headers" in out and "problems" not in out
