"""tracer.diff and `tracer diff` on hand-built trace pairs whose differences are known."""

import json

import pytest
import torch

from tracer import TraceWriter, diff
from tracer.cli import main
from tracer.diff import DEFAULT_TOLERANCES, DiffInputError, token_diff_table

from tests.fixtures.diff_traces import B, T, write_trace


@pytest.fixture
def base(tmp_path):
    return write_trace(tmp_path / "a")


def test_identical_traces_are_equal_and_skipped_by_checksum(tmp_path, base, capsys):
    other = write_trace(tmp_path / "b")
    report = diff(base, other)
    assert report.equal and report.findings() == [] and report.fields == {}
    assert report.step_pairs == 3 and report.identical_by_checksum == 3  # no tensor was read
    assert main(["diff", str(base), str(other)]) == 0
    assert capsys.readouterr().out.startswith("tracer diff: EQUAL within tolerance")


def test_one_float_changed_names_the_place_values_and_minimal_tolerances(tmp_path, base, capsys):
    def edit(step, t):
        if step == 1:
            t["policy_logprobs"][2, 1] += 0.5  # seq 2, tok 1 is ' sat'; a = -(2*6+1+1+1)/64 = -0.234375

    other = write_trace(tmp_path / "b", edit=edit)
    report = diff(base, other)
    assert not report.equal and report.identical_by_checksum == 2  # steps 0 and 2 are not read
    (field,) = report.differing_fields
    assert field.name == "policy_logprobs" and field.differing == 1 and field.compared == 13
    loc = field.worst[0]
    assert (loc.step, loc.sequence, loc.token, loc.token_text) == ((1, 0, 0, 0), 2, 1, " sat")
    assert (loc.a, loc.b) == (-0.234375, 0.265625)
    assert field.min_atol == 0.5 and field.min_rtol == 0.5 / 0.234375
    assert report.findings() == [
        "policy_logprobs: max |Δ|=5.0e-01 at step 1, seq 2, tok 1 ' sat' (a=-0.234375, b=0.265625, "
        "tol=1.0e-05); 1 of 13 kept positions differ (7.69%)"]
    assert report.first_divergence == ("policy_logprobs", loc)
    # the reported minimal tolerances pass, anything tighter fails
    assert diff(base, other, atol={"policy_logprobs": 0.5}).equal
    assert not diff(base, other, atol={"policy_logprobs": 0.49}).equal
    assert diff(base, other, atol={"policy_logprobs": 0.0}, rtol={"policy_logprobs": field.min_rtol}).equal
    assert main(["diff", str(base), str(other)]) == 1
    short = capsys.readouterr().out  # the headline, then the table with the tolerance that would pass
    assert short.startswith("tracer diff: DIFFERENT: policy_logprobs diverges first, at step 1, seq 2, tok 1 ' sat' "
                            "(a=-0.234375, b=0.265625)")
    assert "--atol policy_logprobs=0.5" in short
    assert main(["diff", str(base), str(other), "--verbose"]) == 1
    out = capsys.readouterr().out
    assert "tok 1 ' sat': a=-0.234375, b=0.265625 |Δ|=5.0e-01" in out
    assert "would pass with atol>=5.0e-01 (rtol=0) or rtol>=2.1e+00 (atol=0)" in out
    assert main(["diff", str(base), str(other), "--atol", "policy_logprobs=0.5"]) == 0


def test_a_change_at_a_masked_position_is_no_finding(tmp_path, base):
    def edit(step, t):
        t["policy_logprobs"][0, 5] = 99.0  # seq 0 keeps tok 0..3 only
        t["completion_ids"][2, 4] = 7  # padding after EOS

    report = diff(base, write_trace(tmp_path / "b", edit=edit))
    assert report.equal, report.format()
    assert report.fields["policy_logprobs"].compared == 3 * 13


def test_a_mask_change_is_its_own_finding(tmp_path, base):
    def edit(step, t):
        if step == 2:
            t["completion_mask"][0, 4] = True  # b keeps one more token
            t["policy_logprobs"][0, 4] = 5.0  # kept by b only: not compared

    report = diff(base, write_trace(tmp_path / "b", edit=edit))
    assert [f.name for f in report.differing_fields] == ["completion_mask"]
    mask = report.fields["completion_mask"]
    assert (mask.kind, mask.kept_only_in_a, mask.kept_only_in_b, mask.differing) == ("mask", 0, 1, 1)
    assert report.findings() == [
        "completion_mask: masks differ at 1 of 18 positions (5.56%; kept only in a: 0, kept only in b: 1), "
        "first at step 2, seq 0, tok 4 '<pad>' (a=False, b=True)"]


@pytest.mark.parametrize("shift", [1, -1])
def test_a_one_position_shift_is_reported_as_a_shift(tmp_path, base, shift):
    def edit(step, t):
        # shift +1: b[t] = a[t-1]; shift -1: b[t] = a[t+1]
        t["policy_logprobs"] = torch.roll(t["policy_logprobs"], shifts=shift, dims=1)

    report = diff(base, write_trace(tmp_path / "b", edit=edit))
    field = report.fields["policy_logprobs"]
    assert field.shift == shift and not field.passed
    rel = "b[t] = a[t-1]" if shift == 1 else "b[t] = a[t+1]"
    assert f"shift: b looks like a shifted by {shift:+d} along T ({rel}): within tolerance at all 30" in report.format(verbose=True)


def test_noise_is_not_a_shift(tmp_path, base):
    def edit(step, t):
        t["policy_logprobs"] += torch.randn(B, T, generator=torch.Generator().manual_seed(step)) * 0.1

    field = diff(base, write_trace(tmp_path / "b", edit=edit)).fields["policy_logprobs"]
    assert not field.passed and field.shift is None and field.shift_detail == ""


def test_a_systematic_offset_inside_tolerance_is_reported_as_drift(tmp_path, base, capsys):
    def edit(step, t):
        t["old_logprobs"] = torch.where(t["completion_mask"], t["old_logprobs"] + 1e-6, t["old_logprobs"])

    other = write_trace(tmp_path / "b", edit=edit)
    report = diff(base, other)
    field = report.fields["old_logprobs"]
    assert field.differing == 0 and field.max_abs_diff < 1e-5  # every element inside the 1e-5 atol
    assert field.drift and not report.equal
    assert field.mean_diff == pytest.approx(1e-6, rel=0.05)
    assert "although every element is within tolerance" in field.drift_detail
    assert diff(base, other, drift=False).equal
    assert main(["diff", str(base), str(other)]) == 1
    assert capsys.readouterr().out.startswith("tracer diff: DIFFERENT: old_logprobs drifts (drift: mean(b-a)=+1.0e-06 "
                                              "over 39 kept positions")


def test_symmetric_noise_inside_tolerance_is_not_drift(tmp_path, base):
    signs = torch.tensor([1.0, -1.0]).repeat(B * T // 2).reshape(B, T)

    def edit(step, t):
        t["old_logprobs"] = t["old_logprobs"] + 2e-6 * signs

    report = diff(base, write_trace(tmp_path / "b", edit=edit))
    assert report.equal, report.format()


def test_different_step_sets_are_listed(tmp_path, base, capsys):
    other = write_trace(tmp_path / "b", steps=(1, 2, 3, 4))
    report = diff(base, other)
    assert report.only_in_a == [(0, 0, 0, 0)] and report.only_in_b == [(3, 0, 0, 0), (4, 0, 0, 0)]
    assert report.step_pairs == 2 and not report.equal
    assert report.findings() == ["steps only in a (1 step file): 0", "steps only in b (2 step files, steps 3-4): 3, 4"]
    assert main(["diff", str(base), str(other), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["equal"] is False and out["only_in_b"] == [[3, 0, 0, 0], [4, 0, 0, 0]]


def test_bfloat16_against_float32_passes_with_the_bfloat16_default(tmp_path):
    g = torch.Generator().manual_seed(0)
    values = {s: -torch.rand(B, T, generator=g) * 5 for s in range(2)}  # not exact in bfloat16

    def f32(step, t):
        t["policy_logprobs"] = values[step]

    def bf16(step, t):
        for name in ("policy_logprobs", "old_logprobs", "rewards", "advantages"):
            t[name] = t[name].to(torch.bfloat16)
        t["policy_logprobs"] = values[step].to(torch.bfloat16)

    a = write_trace(tmp_path / "a", steps=(0, 1), edit=f32)
    b = write_trace(tmp_path / "b", steps=(0, 1), edit=bf16, keep_source_dtype=True)
    report = diff(a, b)
    assert report.equal, report.format()
    field = report.fields["policy_logprobs"]
    assert (field.dtype_a, field.dtype_b, field.tolerance) == ("F32", "BF16", DEFAULT_TOLERANCES["BF16"])
    assert 0 < field.max_abs_diff  # rounding happened, and the bfloat16 rtol absorbed it
    assert not diff(a, b, rtol=1e-4).equal  # a float32 tolerance would not


def test_ids_metadata_and_missing_fields_are_findings(tmp_path, base):
    def edit(step, t):
        if step == 0:
            t["completion_ids"][1, 1] = 2  # ' dog' -> ' cat' at a kept position
        t["sampler_logprobs"] = t["old_logprobs"].clone()  # (the writer refuses shared storage)

    other = write_trace(tmp_path / "b", edit=edit, hyperparameters={"beta": 0.1, "num_generations": 2})
    report = diff(base, other)
    assert report.findings() == [
        "sampler_logprobs: only in b (3 step pairs, first at step 0)",
        "metadata beta: a=0.04, b=0.1 (3 step pairs, first at step 0)",
        "completion_ids: 1 of 39 kept positions differ (2.56%), first at step 0, seq 1, tok 1 ' dog' "
        "(a=7 ' dog', b=2 ' cat')",
    ]
    assert diff(base, other, ignore_metadata=["beta"], fields=["policy_logprobs"]).equal


def test_single_step_files_and_json_output(tmp_path, base, capsys):
    other = write_trace(tmp_path / "b", edit=lambda s, t: t["rewards"].__setitem__(0, 0.0))
    file_a = next((base / "steps").glob("step_00000000.*"))
    file_b = next((other / "steps").glob("step_00000001.*"))  # another step number: files pair anyway
    assert main(["diff", str(file_a), str(file_b), "--json", "--fields", "rewards"]) == 1
    out = json.loads(capsys.readouterr().out)
    rewards = out["fields"]["rewards"]
    assert out["step_pairs"] == 1 and list(out["fields"]) == ["rewards"]
    assert rewards["first"]["index"] == [0] and (rewards["first"]["a"], rewards["first"]["b"]) == (1.0, 0.0)
    assert rewards["min_rtol"] == 1.0 and out["first_divergence"]["field"] == "rewards"


# -- unusable input: exit 2 and a message that says what to do ----------------------------------


def test_different_algorithms(tmp_path, base, capsys):
    dpo = tmp_path / "dpo"
    with TraceWriter(dpo, "dpo") as writer:
        writer.record(0, {"dpo_loss": torch.zeros(2)})
    assert main(["diff", str(base), str(dpo)]) == 2
    assert capsys.readouterr().err == (
        f"tracer diff: error: cannot diff a grpo trace ({base}) with a dpo trace ({dpo}): their fields and "
        "metadata mean different things; compare two traces of the same algorithm\n")


def test_different_schema_versions(tmp_path, base, capsys):
    other = write_trace(tmp_path / "b")
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "schema_version": "2"}))
    assert main(["diff", str(base), str(other)]) == 2
    assert capsys.readouterr().err == (
        f"tracer diff: error: cannot diff schema version 1 ({base}) with schema version 2 ({other}): field "
        "names and layouts can change between versions; re-record the older trace with the current tracer\n")


def test_a_field_with_different_shapes(tmp_path, base, capsys):
    # a different number of sequences B cannot be compared position by position (different widths T
    # can: see test_widths.py)
    def more_rows(step, t):
        for name, value in list(t.items()):
            if value.dim() >= 1 and value.shape[0] == 3:
                t[name] = torch.cat([value, value[:1]], dim=0)  # B = 4

    other = write_trace(tmp_path / "b", edit=more_rows)
    assert main(["diff", str(base), str(other)]) == 2
    assert capsys.readouterr().err == (
        "tracer diff: error: a has 3 sequences (B) per step file but b has 4 at step 0, so no per-sequence field "
        "([B], [B, T], [B, L], [B, F]) can be compared row by row: the runs used different batch sizes (B = prompts "
        "x num_generations; pairs for DPO); re-run both with the same batch size\n")
    with pytest.raises(DiffInputError, match=r"a has 3 sequences \(B\)"):
        diff(base, other)


def test_not_a_trace_bad_tolerance_and_unknown_field(tmp_path, base, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["diff", str(base), str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err == (
        f"tracer diff: error: {tmp_path / 'empty'} is not a trace: expected manifest.json and "
        "steps/*.safetensors (written by tracer), or pass a single .safetensors step file\n")
    assert main(["diff", str(base), str(base), "--atol", "ratio=small"]) == 2
    assert capsys.readouterr().err == (
        "tracer diff: error: --atol 'ratio=small': expected FIELD=NUMBER or NUMBER, e.g. --atol ratio=1e-4\n")
    assert main(["diff", str(base), str(base), "--fields", "policy_logprob"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tracer diff: error: fields names ['policy_logprob'], which neither trace has "
                          "(fields of the first step: ['advantages', 'completion_ids'")
    assert err.endswith("check the spelling\n")


# -- what the app's Diff page uses -----------------------------------------------------------------


def test_field_table_and_token_diff_table(tmp_path, base):
    def edit(step, t):
        t["policy_logprobs"][2, 1] += 0.5  # kept
        t["policy_logprobs"][0, 5] += 0.5  # masked: not a difference
        t["completion_mask"][0, 4] = True

    other = write_trace(tmp_path / "b", edit=edit)
    table = diff(base, other, progress=True).field_table()
    assert list(table["field"][:2]) == ["completion_mask", "policy_logprobs"] and not table["passed"][1]
    assert table.set_index("field").loc["policy_logprobs", "max_abs_diff"] == 0.5

    tokens = token_diff_table(base, other, step=(1, 0, 0, 0))
    assert len(tokens) == B * T
    row = tokens.set_index(["sequence", "position"])
    assert row.loc[(2, 1), "policy_logprobs_differs"] and row.loc[(2, 1), "token_text_a"] == " sat"
    assert (row.loc[(2, 1), "policy_logprobs_a"], row.loc[(2, 1), "policy_logprobs_b"]) == (-0.234375, 0.265625)
    assert not row.loc[(0, 5), "policy_logprobs_differs"]  # masked on both sides
    assert row.loc[(0, 4), "mask_differs"] and not row.loc[(0, 4), "policy_logprobs_differs"]
    assert tokens["policy_logprobs_differs"].sum() == 1 and tokens["mask_differs"].sum() == 1
    one = token_diff_table(base, other, step=(1, 0, 0, 0), sequence=2)
    assert list(one["sequence"].unique()) == [2] and one["policy_logprobs_differs"].sum() == 1
    with pytest.raises(DiffInputError, match=r"step \(9, 0, 0, 0\) is not in both traces"):
        token_diff_table(base, other, step=(9, 0, 0, 0))
