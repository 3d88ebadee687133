"""The big traces of the viewer benchmark (bench/viewer_traces.py) are healthy GRPO runs: what the
benchmark times is the app on a run a user would open, so ``tracer check`` finds no error or
warning on a small one, and it holds every canonical GRPO field with its B x T shape."""

from __future__ import annotations

from bench import viewer_traces
from tracer.checks import run_checks
from tracer.read import Trace


def test_the_viewer_bench_trace_is_a_healthy_grpo_run(tmp_path, monkeypatch):
    monkeypatch.setattr(viewer_traces, "CACHE", tmp_path)
    path = viewer_traces.ensure(3, B=16, T=32)
    written = (path / ".done").stat().st_mtime_ns
    assert viewer_traces.ensure(3, B=16, T=32) == path and (path / ".done").stat().st_mtime_ns == written  # cached
    trace = Trace(path)
    bad = [f for f in run_checks(trace) if f.severity in ("error", "warning")]
    assert bad == [], [f.message for f in bad]
    fields = trace.fields(trace.steps()[0])
    assert fields["completion_ids"][0] == [16, 32] and fields["reward_components"][0] == [16, viewer_traces.F]
    for name in ("prompt_ids", "prompt_mask", "completion_mask", "policy_logprobs", "old_logprobs", "ref_logprobs",
                 "sampler_logprobs", "entropy", "ratio", "ref_kl_k3", "approx_kl_k2", "per_token_loss", "rewards",
                 "advantages", "group_ids"):
        assert name in fields, name
    assert trace.tokens is not None and len(trace.tokens) == viewer_traces.VOCAB


def test_the_loop_benchmark_calls_a_target_only_when_its_interval_is_on_one_side():
    from bench.loops import paired_ratio, verdict

    mean, low, high = paired_ratio([2.0, 0.5])  # geometric mean: sqrt(2 * 0.5) = 1
    assert abs(mean - 1.0) < 1e-12 and abs(low - 0.5) < 1e-12 and abs(high - 2.0) < 1e-12  # resamples: both, or mixed
    assert all(abs(x - 1.02) < 1e-12 for x in paired_ratio([1.02] * 9))  # no spread: the interval is the point
    assert verdict(paired_ratio([1.02] * 9), 1.05) == "met"
    assert verdict(paired_ratio([1.2, 1.3, 1.25]), 1.05) == "missed"
    assert verdict(paired_ratio([0.9, 1.2, 1.0, 1.1]), 1.05) == "undecided"
