"""The viewer's per-step summary cache sees a trainer's log line written after its step's file
(TRL's ``on_log`` closes a step whose file is already on disk): the cached summary is keyed by the
logged-scalar files' sizes as well as by the step files, so the value shows without a new step file
or a Reload."""

from __future__ import annotations

import math

from app.components import trace_cache
from tracer.record.writer import TraceWriter

from tests.fixtures.toy_traces import ToyTokenizer, healthy_step_tensors


def test_a_log_line_after_the_last_step_file_reaches_the_cached_summary(tmp_path):
    root = tmp_path / "live"
    writer = TraceWriter(root, algorithm="grpo", tokenizer=ToyTokenizer(), async_write=False)
    try:
        for step in range(2):
            writer.record(step, healthy_step_tensors(seed=step, inner_step=0))
        writer.flush()
        trace = trace_cache.open_trace(str(root))
        listing = trace_cache.listing_token(trace)
        before = trace_cache.step_summary(str(root), listing)
        assert "scalars/grad_norm" not in before.columns

        writer.log_scalars(1, {"grad_norm": 0.25})  # no new step file: the listing is unchanged
        assert trace_cache.listing_token(trace_cache.open_trace(str(root))) == listing
        after = trace_cache.step_summary(str(root), listing)
        by_step = dict(zip(after["step"], after["scalars/grad_norm"]))
        assert by_step[1] == 0.25 and math.isnan(by_step[0])

        writer.log_scalars(1, {"grad_norm": 0.5})  # a later line for the same step wins
        again = trace_cache.step_summary(str(root), listing)
        assert dict(zip(again["step"], again["scalars/grad_norm"]))[1] == 0.5
    finally:
        writer.close()
