"""tracer.testing: assert_traces_match's failure message is the report; the trace_regression
fixture records a baseline only with --tracer-regen (driven through pytester)."""

import pytest
import torch

from tracer import diff
from tracer.testing import assert_traces_match, failure_message

from tests.fixtures.diff_traces import write_trace


pytest_plugins = ["pytester"]


def test_assert_traces_match_passes_and_its_failure_message_is_the_report(tmp_path):
    expected = write_trace(tmp_path / "expected")
    assert assert_traces_match(write_trace(tmp_path / "same"), expected).equal

    def edit(step, t):
        if step == 1:
            t["policy_logprobs"][2, 1] += 0.5

    actual = write_trace(tmp_path / "actual", edit=edit)
    with pytest.raises(AssertionError) as info:
        assert_traces_match(actual, expected)
    report = diff(expected, actual, labels=("expected", "actual"))
    assert str(info.value) == failure_message(report)
    # it leads with the headline (the cause), then the short report, then the full one
    assert str(info.value).splitlines()[0] == ("tracer diff: DIFFERENT: policy_logprobs diverges first, at step 1, "
                                              "seq 2, tok 1 ' sat' (a=-0.234375, b=0.265625)")
    assert str(info.value).splitlines()[1:3] == [f"  a (expected): {expected}", f"  b (actual): {actual}"]
    assert str(info.value).startswith(report.format()) and report.format(verbose=True) in str(info.value)
    assert "policy_logprobs: max |Δ|=5.0e-01 at step 1, seq 2, tok 1 ' sat'" in str(info.value)
    # per-field tolerances as keywords: field=atol or field=(atol, rtol)
    assert assert_traces_match(actual, expected, policy_logprobs=0.5).equal
    assert assert_traces_match(actual, expected, policy_logprobs=(0.0, 2.2)).equal
    with pytest.raises(TypeError, match="pass policy_logprobs=atol or policy_logprobs=\\(atol, rtol\\)"):
        assert_traces_match(actual, expected, policy_logprobs="loose")


PRODUCER = '''
import os
import torch
from tracer import TraceWriter


def test_loop(tmp_path, trace_regression):
    out = tmp_path / "trace"
    with TraceWriter(out, "grpo") as writer:
        for step in range(2):
            policy = -(torch.arange(12, dtype=torch.float32).reshape(2, 6) + 1 + step) / 64
            policy[1, 2] += float(os.environ.get("TRACER_TEST_OFFSET", "0"))
            writer.record(step, {"completion_ids": torch.ones(2, 6, dtype=torch.long),
                                 "completion_mask": torch.ones(2, 6, dtype=torch.bool),
                                 "policy_logprobs": policy, "rewards": torch.tensor([1.0, 0.0])})
    trace_regression.check(out)
'''


def run(pytester, *args):
    # other plugins off: hypothesis' terminal summary alone costs seconds per in-process run
    return pytester.runpytest("-p", "no:hypothesispytest", "-p", "no:cacheprovider", *args)


def test_trace_regression_records_the_baseline_only_when_asked(pytester, monkeypatch):
    # Off CI pytest cuts the short summary's copy of the message to one line, so the lines below must
    # be in the failure's own text, in this order: the headline, what to do, then the details.
    monkeypatch.delenv("CI", raising=False)
    pytester.makeconftest('pytest_plugins = ["tracer.testing"]')
    pytester.makepyfile(test_loop=PRODUCER)
    baseline = pytester.path / "test_loop" / "test_loop"

    result = run(pytester)  # no baseline, no flag: fail and record nothing
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*no trace baseline at *test_loop/test_loop; record it from * by running "
                                 "pytest with --tracer-regen, then commit it*"])
    assert not baseline.exists()

    result = run(pytester, "--tracer-regen")  # records, and says so by failing
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*recorded the trace baseline *test_loop/test_loop from *"])
    assert (baseline / "manifest.json").is_file() and len(list((baseline / "steps").iterdir())) == 2

    run(pytester).assert_outcomes(passed=1)  # same code, same trace
    run(pytester, "--tracer-regen").assert_outcomes(passed=1)  # a matching baseline is left alone

    monkeypatch.setenv("TRACER_TEST_OFFSET", "0.25")  # the "trainer" changed
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([  # the headline first, the full report last
        "tracer diff: DIFFERENT: policy_logprobs diverges first, at step 0, seq 1, tok 2 '<id 1>' (a=-0.140625, "
        "b=0.109375)",
        "*If this change is intended, re-record the baseline with pytest --tracer-regen and commit it.*",
        "*policy_logprobs: max |Δ|=2.5e-01 at step 0, seq 1, tok 2 '<id 1>' (a=-0.140625, b=0.109375, *"])

    result = run(pytester, "--tracer-regen")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*re-recorded the trace baseline *test_loop/test_loop (--tracer-regen); "
                                 "it differed:*"])
    run(pytester).assert_outcomes(passed=1)
    assert not list(baseline.parent.glob("*.partial"))
