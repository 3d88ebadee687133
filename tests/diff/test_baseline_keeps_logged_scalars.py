"""A regression baseline recorded with ``--tracer-regen`` keeps the scalars a trainer logged after
their steps' files were written (``scalars.rank_N.jsonl``: data no step file holds), so the baseline
shows the same per-step curves as the run it was recorded from."""

from __future__ import annotations

from tracer.read import Trace
from tracer.record.writer import TraceWriter
from tracer.testing import _copy_trace

from tests.fixtures.toy_traces import ToyTokenizer, healthy_step_tensors


def test_a_recorded_baseline_holds_the_logged_scalars(tmp_path):
    run = tmp_path / "run"
    with TraceWriter(run, algorithm="grpo", tokenizer=ToyTokenizer(), async_write=False) as writer:
        for step in range(2):
            writer.record(step, healthy_step_tensors(seed=step, inner_step=0))
            writer.log_scalars(step, {"grad_norm": 0.5 + step})
    _copy_trace(run, tmp_path / "baseline")
    summary = Trace(tmp_path / "baseline").step_summary()
    assert dict(zip(summary["step"], summary["scalars/grad_norm"])) == {0: 0.5, 1: 1.5}
