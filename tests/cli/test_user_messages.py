"""What a user reads when something goes wrong or is missing, on real writers and real traces: a drop
warning points at the loop's own line and names the step file's coordinates, ``tracer info`` sums the
drop reasons up and says plainly when a trace has no step file, ``tracer check`` shows a message
found at many locations once, and EOS/pad ids given as hyperparameters turn the mask checks on."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from tracer.checks import run_checks
from tracer.checks.finding import Finding
from tracer.checks.report import render_findings, same_message
from tracer.cli import main
from tracer.read.trace_info import describe_drops, drop_kind
from tracer.record.writer import TraceWriter

from tests.fixtures.writer_process import WRITERS, grpo_step, stalled_writer


@pytest.mark.parametrize("kind", WRITERS)
def test_a_drop_warning_points_at_the_loop_line_and_names_the_inner_step(tmp_path, kind, monkeypatch, capsys):
    writer, release = stalled_writer(kind, monkeypatch, tmp_path / "d")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert writer.record(1, grpo_step(1), inner_step=1) is not None  # takes the one place
            line = inspect.currentframe().f_lineno + 1
            assert writer.record(1, grpo_step(2), inner_step=2) is None  # dropped
    finally:
        release()
    writer.close()
    said = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    assert (said[0].filename, said[0].lineno) == (__file__, line)  # before: a line of tracer's writer
    assert "dropped a step (1 so far): step 1, inner step 2: queue full (1 steps" in str(said[0].message)
    capsys.readouterr()
    assert main(["info", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "drop reasons (of all 1): queue full x1" in out
    assert "first: step 1, inner step 2: queue full (1 steps" in out and "last kept" not in out


def test_drop_reasons_are_counted_by_kind_without_their_step():
    assert drop_kind("step 3, inner step 1, micro-batch 2: queue full (2 steps, 10 bytes)") == "queue full"
    assert drop_kind("step 4: staging the tensors failed: RuntimeError: out of memory") == \
        "staging the tensors failed: RuntimeError: out of memory"
    assert drop_kind("step_00000001.inner_0.mb_0.rank_0.safetensors: OSError: [Errno 28] No space left on device: "
                     "'/runs/a/steps/.step_00000001.tmp'") == "OSError: [Errno 28] No space left on device"
    reasons = [f"step {s}: queue full (1 steps)" for s in range(19)] + ["step 19: OSError: [Errno 28] disk full"]
    assert describe_drops(250, reasons) == [
        "  drop reasons (of the first 20): queue full x19, OSError: [Errno 28] disk full x1",
        "  first: step 0: queue full (1 steps)",
        "  last kept: step 19: OSError: [Errno 28] disk full"]
    assert describe_drops(0, []) == []


def test_info_on_a_trace_without_step_files_says_so(tmp_path, capsys):
    TraceWriter(tmp_path / "empty", "grpo").close()
    assert main(["info", str(tmp_path / "empty")]) == 0
    out = capsys.readouterr().out
    assert "fields: none (no readable step file)" in out
    assert "fields (first" not in out  # before: the title of an empty table, cut to its width


def test_check_shows_one_message_found_at_many_step_files_once():
    same = [Finding("sampler.mismatch", "info", "the sampler's logprobs are 0.01 nats off", step=s, inner_step=0,
                    micro_batch=0, rank=0) for s in range(6)]
    other = Finding("sampler.mismatch", "info", "another message", step=9, inner_step=0, micro_batch=0, rank=0)
    entries = same_message([same[0], other, *same[1:]])
    assert [(f, len(rest)) for f, rest in entries] == [(same[0], 5), (other, 0)]
    from rich.console import Console

    console = Console(width=400, record=True)
    console.print(render_findings([*same, other], max_per_check=1))
    text = console.export_text()
    assert text.count("the sampler's logprobs are 0.01 nats off") == 1
    assert ("step 0 · inner 0 · mb 0 · rank 0 (the same at 5 more: step 1 · inner 0 · mb 0 · rank 0, step 2 · "
            "inner 0 · mb 0 · rank 0, step 3 · inner 0 · mb 0 · rank 0, …)") in text
    assert "7 findings" in text and "… 1 more (use --json for all)" in text and "another message" not in text


def _kept_after_eos(eos: int) -> dict[str, torch.Tensor]:
    """Row 0's answer ends with EOS at token 2, and its mask keeps tokens 3 and 4 after it."""
    step = grpo_step(0, B=2, T=5)
    ids = torch.tensor([[5, 6, eos, 7, 8], [5, 6, 7, 8, 9]])
    return {**step, "completion_ids": ids, "completion_mask": torch.ones(2, 5, dtype=torch.bool),
            "group_ids": torch.tensor([0, 0])}


def test_eos_and_pad_ids_in_the_hyperparameters_turn_the_mask_checks_on_without_a_tokenizer(tmp_path):
    with TraceWriter(tmp_path / "ids", "grpo", hyperparameters={"eos_token_id": 2, "pad_token_id": 0}) as w:
        w.record(0, _kept_after_eos(2))
    with TraceWriter(tmp_path / "none", "grpo") as w:
        w.record(0, _kept_after_eos(2))
    found = [(f.check, f.severity, f.sequence, f.token) for f in run_checks(tmp_path / "ids", select=["masks"])]
    assert ("masks.after_eos", "error", 0, 3) in found
    assert ("masks.padding", "skipped", None, None) not in found
    unknown = {f.check: f.severity for f in run_checks(tmp_path / "none", select=["masks"])}
    assert unknown["masks.after_eos"] == "skipped" and unknown["masks.padding"] == "skipped"


def test_check_takes_its_path_after_select_and_comma_separated_ids(tmp_path, capsys):
    from tests.fixtures.check_traces import case1_tensors, write_trace

    root = write_trace(tmp_path / "r", "grpo", [(0, 0, case1_tensors())])
    assert main(["check", "--select", "masks", "identity.first_step", str(root)]) == 1  # case 1: first-step error
    assert "identity.first_step" in capsys.readouterr().out
    assert main(["check", str(root), "--select", "masks,kl"]) == 0
    out = capsys.readouterr().out
    assert "identity.first_step" not in out and "PASS" in out
    assert main(["check", "--select", "masks"]) == 2
    assert "no trace given" in capsys.readouterr().err


def test_a_streamlit_option_given_to_view_says_how_to_pass_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["view", "runs", "--server.maxUploadSize", "500"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--server.maxUploadSize is a Streamlit option" in err and "STREAMLIT_SERVER_MAX_UPLOAD_SIZE=" in err
