"""A new user's `tracer diff` report: a field derived on one side and recorded on the other, step
metadata recorded on one side only or with other values, long lists of steps on one side, the
verbose per-sequence counts, and two traces of different batch sizes (``first_k_sequences``).
Every trace is written by TraceWriter; the expected values are worked out by hand."""

import pytest
import torch

from tracer import TraceWriter, diff
from tracer.record.capture import SamplingPolicy
from tracer.cli import main
from tracer.diff import DiffInputError, comparable

from tests.fixtures.diff_traces import B, T, ListTokenizer, step_tensors, write_trace
from tests.fixtures.paths import SAMPLES

KEPT = 13  # kept positions of COMPLETION_MASK per step (tests/fixtures/diff_traces.py)
# policy - old = 1/128 at every position (step_tensors), so approx_kl_k2 = 0.5 * 2**-14 = 2**-15, exactly
K2 = 2.0 ** -15
EXPLICIT = {"beta": 0.04, "num_generations": 2, "loss_reduction": "sequence_mean", "clip_epsilon_low": 0.2}
ZERO_EDIT = {"beta": 0.04, "num_generations": 2}  # what a zero-edit capture can tell


def record_k2(value=K2, at=None):
    """An edit recording ``approx_kl_k2`` (the value by hand; ``at=(seq, tok, v)`` changes one)."""
    def edit(step, t):
        t["approx_kl_k2"] = torch.full((B, T), value)
        if at is not None:
            t["approx_kl_k2"][at[0], at[1]] = at[2]
    return edit


# -- 1. derived on one side, recorded on the other; metadata on one side only -------------------


def test_a_field_derived_on_one_side_and_recorded_on_the_other_is_compared_by_value(tmp_path, capsys):
    explicit = write_trace(tmp_path / "mine", hyperparameters=EXPLICIT)  # approx_kl_k2 derived by the reader
    zero_edit = write_trace(tmp_path / "zr", edit=record_k2(), hyperparameters=ZERO_EDIT)
    report = diff(explicit, zero_edit)
    assert report.equal and report.tensors_equal, report.format(verbose=True)
    assert report.missing_fields == {} and report.findings() == []
    k2 = report.fields["approx_kl_k2"]
    assert (k2.derived_in, k2.compared, k2.differing, k2.max_abs_diff) == ("a", 3 * KEPT, 0, 0.0)
    assert report.notes() == [
        "metadata only in a (not recorded in b, so not compared): clip_epsilon_low=0.2, loss_reduction='sequence_mean'",
        f"approx_kl_k2: recorded in b, derived in a from its recorded inputs (as the reader does); equal within "
        f"tolerance at {3 * KEPT} positions",
    ]
    assert main(["diff", str(explicit), str(zero_edit)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tracer diff: EQUAL within tolerance\n") and "notes (not differences):" in out
    assert diff(zero_edit, explicit).fields["approx_kl_k2"].derived_in == "b"  # either side derives


def test_a_derived_field_that_differs_in_value_is_still_reported(tmp_path, capsys):
    explicit = write_trace(tmp_path / "mine", hyperparameters=EXPLICIT)
    wrong = write_trace(tmp_path / "zr", edit=record_k2(at=(1, 2, 0.5)), hyperparameters=ZERO_EDIT)  # seq 1 keeps tok 2
    report = diff(explicit, wrong)
    assert not report.equal and not report.tensors_equal
    k2 = report.fields["approx_kl_k2"]
    assert (k2.derived_in, k2.differing, k2.step_pairs_differing) == ("a", 3, 3)
    assert (k2.first.index, k2.first.a, k2.first.b) == ((1, 2), K2, 0.5)
    assert k2.summary().endswith("[derived in a, recorded in b]")
    assert not any(n.startswith("approx_kl_k2") for n in report.notes())
    assert main(["diff", str(explicit), str(wrong)]) == 1
    assert capsys.readouterr().out.startswith("tracer diff: DIFFERENT: approx_kl_k2 diverges first, at step 0, seq 1")


def test_the_lacking_side_derives_with_its_own_metadata(tmp_path):
    # old_logprobs_source = policy_detached: the reader derives k2 from policy against itself (0), not
    # from the recorded old logprobs; the recorded 2**-15 differs from that at every kept position
    detached = write_trace(tmp_path / "a", hyperparameters={**ZERO_EDIT, "old_logprobs_source": "policy_detached"})
    recorded = write_trace(tmp_path / "b", edit=record_k2(), hyperparameters=ZERO_EDIT)
    k2 = diff(detached, recorded).fields["approx_kl_k2"]
    assert (k2.derived_in, k2.differing, k2.max_abs_diff) == ("a", 3 * KEPT, K2)


def test_metadata_values_that_differ_with_equal_tensors_are_a_metadata_only_difference(tmp_path, capsys):
    a = write_trace(tmp_path / "a")
    b = write_trace(tmp_path / "b", hyperparameters={"beta": 0.1, "num_generations": 2})
    report = diff(a, b)
    assert report.tensors_equal and report.metadata_only and not report.equal
    assert report.identical_by_checksum == 3  # the tensors' checksums agree
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("tracer diff: DIFFERENT (metadata only: the tensors are equal within tolerance; "
                                   "step metadata beta differs)")
    assert "metadata beta: a=0.04, b=0.1 (3 step pairs, first at step 0)" in out
    assert "--ignore-metadata beta" in out
    assert main(["diff", str(a), str(b), "--verbose"]) == 1
    assert capsys.readouterr().out.startswith("tracer diff: DIFFERENT (metadata only")
    assert main(["diff", str(a), str(b), "--ignore-metadata", "beta"]) == 0


def test_a_tensor_difference_with_metadata_on_one_side_still_exits_1(tmp_path):
    a = write_trace(tmp_path / "a", hyperparameters=EXPLICIT)
    b = write_trace(tmp_path / "b", hyperparameters=ZERO_EDIT,
                    edit=lambda s, t: t["rewards"].__setitem__(0, 0.25) if s == 2 else None)
    report = diff(a, b)
    assert not report.equal and not report.metadata_only and report.cause.name == "rewards"
    assert main(["diff", str(a), str(b)]) == 1


# -- 2. steps on one side only: one unambiguous list, compressed --------------------------------


def write_inner_steps(root, steps):
    with TraceWriter(root, "grpo", tokenizer=ListTokenizer(), hyperparameters=ZERO_EDIT) as writer:
        for step in steps:
            for inner in (0, 1):
                writer.record(step, step_tensors(step), inner_step=inner)
    return root


def test_steps_on_one_side_are_listed_without_ambiguous_commas(tmp_path, capsys):
    a = write_inner_steps(tmp_path / "a", range(7))
    b = write_inner_steps(tmp_path / "b", [0])
    report = diff(a, b)
    assert len(report.only_in_a) == 12
    line = ("steps only in a (12 step files, steps 1-6): 1, 1/inner 1, 2, 2/inner 1, 3, 3/inner 1, 4, 4/inner 1, "
            "5, 5/inner 1, … and 2 more")
    assert report.findings() == [line]
    assert main(["diff", str(a), str(b)]) == 1
    assert f"  {line}\n" in capsys.readouterr().out


def test_steps_missing_because_of_every_n_steps_say_so(tmp_path):
    full = write_trace(tmp_path / "full", steps=range(6))
    sampled = write_trace(tmp_path / "every_5", steps=range(6), sampling=SamplingPolicy(every_n_steps=5))
    assert diff(full, sampled).findings() == [
        "steps only in a (4 step files, steps 1-4): 1, 2, 3, 4 (b was recorded with every_n_steps=5: only steps "
        "divisible by 5 are written)"]


# -- 3. --verbose: the per-sequence count agrees with the lines listed ---------------------------


def test_verbose_sequence_header_says_how_many_of_its_positions_are_shown(tmp_path, capsys):
    def edit(step, t):
        if step == 1:
            t["policy_logprobs"][1, 2] += 0.5  # seq 1 keeps every token: two differing positions
            t["policy_logprobs"][1, 4] += 0.25

    a, b = write_trace(tmp_path / "a"), write_trace(tmp_path / "b", edit=edit)
    assert main(["diff", str(a), str(b), "--verbose", "--fields", "policy_logprobs", "--max-locations", "1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    i = lines.index("  step 1, seq 1 (showing 1 of 2 differing)")
    assert lines[i + 1].startswith("    tok 2 ' sat': ") and not lines[i + 2].startswith("    tok")
    assert main(["diff", str(a), str(b), "--verbose", "--fields", "policy_logprobs"]) == 1
    lines = capsys.readouterr().out.splitlines()
    i = lines.index("  step 1, seq 1 (2 differing)")
    assert [line[:9] for line in lines[i + 1 : i + 3]] == ["    tok 2", "    tok 4"]


# -- 4. a full trace against a first_k_sequences trace --------------------------------------------


def test_different_batch_sizes_name_first_k_sequences_and_say_there_is_no_option(tmp_path, capsys):
    full = write_trace(tmp_path / "full")
    first_k = write_trace(tmp_path / "first_k", sampling=SamplingPolicy(first_k_sequences=2))
    assert main(["diff", str(full), str(first_k)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "tracer diff: error: a has 3 sequences (B) per step file but b has 2 at step 0, so no per-sequence field "
        "([B], [B, T], [B, L], [B, F]) can be compared row by row: b was recorded with first_k_sequences=2 (its "
        "manifest's sampling: only the first 2 sequences of each step are written). tracer diff has no option to "
        "compare only the first rows of the other trace; record both traces with the same first_k_sequences (or "
        "both without it), then diff again\n")
    assert "leave the field out" not in err and "completion length" not in err
    assert comparable(full, first_k) == err.removeprefix("tracer diff: error: ").rstrip("\n")
    with pytest.raises(DiffInputError, match="first_k_sequences=2"):
        diff(first_k, full)  # either order


def test_verbose_keeps_the_short_reports_cause_and_advice_then_adds_the_details(capsys):
    """New-user trial: --verbose dropped the cause analysis and the 'what to do' lines of the short
    report; it now prints the short report first, then every finding and position."""

    samples = SAMPLES
    args = ["diff", str(samples / "grpo-diff-baseline"), str(samples / "grpo-diff-scorer-clip")]
    assert main(args) == 1
    short = capsys.readouterr().out
    assert main([*args, "--verbose"]) == 1
    verbose = capsys.readouterr().out
    assert verbose.startswith(short.rstrip("\n"))
    assert "cause: rewards" in verbose and "what to do:" in verbose
    assert "details (--verbose):" in verbose and verbose.index("details (--verbose):") > verbose.index("what to do:")
    assert "first divergence: rewards" in verbose
