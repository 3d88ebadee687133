"""Property: what is on disk is what was recorded. Random steps (dtypes, layouts, empty dims, NaNs, one
tensor under two names; tests/fixtures/random_steps.py) through the batched writer thread with buffer
reuse, the anomaly ring, first_k_sequences and both queue policies, the loop overwriting its tensors
right after each record. (The same through the writer process: test_writer_process.py.)"""

from __future__ import annotations

import warnings

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tracer.read import Trace
from tracer.record.capture import SamplingPolicy
from tracer.record.writer import TraceWriter

from tests.fixtures.random_steps import as_stored, random_step


@settings(max_examples=30, deadline=None, phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rng=st.randoms(use_true_random=False))
def test_every_written_tensor_equals_a_copy_taken_at_record_time(tmp_path_factory, rng):
    """Random steps (dtypes, layouts, empty dims, NaNs, one tensor under two names) through the
    batched writer thread with buffer reuse, the anomaly ring, first_k_sequences, both queue
    policies; the loop overwrites its tensors right after each record. Every file holds the values
    recorded, its checksum verifies, and its header summary is compute_summary of its own tensors."""
    from tracer.format import summary as summary_format
    from tracer.formulas import summaries
    from tracer.format.integrity import verify_step_file

    algorithm = rng.choice(["ppo", "grpo", "rloo"])
    keep, k = rng.random() < 0.4, rng.choice([None, 1, 2])
    ring = rng.choice([0, 3])
    sampling = SamplingPolicy(every_n_steps=rng.choice([1, 2]), first_k_sequences=k, anomaly_ring=ring)
    root = tmp_path_factory.mktemp("run") / "t"
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # drops (when_full="drop") are allowed here
        with TraceWriter(root, algorithm, keep_source_dtype=keep, sampling=sampling,
                         when_full=rng.choice(["block", "drop"]), max_queue_steps=rng.choice([1, 4, 16]),
                         hyperparameters={"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28},
                         async_write=bool(ring) or rng.random() < 0.8) as writer:
            for step in range(16):
                tensors = random_step(rng, algorithm, g)
                expected[step] = {n: as_stored(n, t, keep, algorithm, k) for n, t in tensors.items()}
                writer.record(step, tensors)
                for t in tensors.values():  # the loop reuses its tensors in place
                    t.fill_(7) if t.dtype != torch.bool else t.logical_not_()
    trace = Trace(root)
    for key in trace.steps():
        data, meta = trace.load_step(key, derive=False), trace.metadata(key)
        want = expected[key.step]
        assert data.keys() == want.keys()
        for name, tensor in want.items():
            assert data[name].dtype == tensor.dtype and data[name].shape == tensor.shape, name
            # exact; NaN where NaN was recorded (its payload bits follow torch's conversion path, not the data)
            torch.testing.assert_close(data[name], tensor, rtol=0, atol=0, equal_nan=True, msg=name)
        assert verify_step_file(key.path) == meta["content_sha256"]
        stored, own = summary_format.read_summary(meta), summaries.compute_summary(trace.load_step(key), meta)
        assert stored.keys() == own.keys()
        assert all(stored[n] == own[n] or (stored[n] != stored[n] and own[n] != own[n]) for n in own)
