"""``SamplingPolicy(first_k_sequences=K)`` on real TRL trainers: every field whose first dimension is B
is cut to K rows, the trainer's own fields too (TRL RLOO's ``sequence_ratio``, ``generation_row_ids``...),
and `tracer check` stays quiet on the healthy run. Before (a new-user trial, 2026-12-04): only SPEC's
canonical fields were cut, so RLOO's own [B] fields kept B rows and recompute.loss crashed on them
(a warning), and the scalar loss, taken by the trainer over all B rows, failed GRPO's recompute.loss
against the K rows kept (an error on a healthy run). recompute.loss and recompute.dpo's loss now skip
a step whose rows may have been cut.
"""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import tracer  # noqa: E402
from tracer import Trace  # noqa: E402
from tracer.record.capture import SamplingPolicy, first_k_sequences  # noqa: E402
from tracer.checks import ERROR, WARNING, run_checks  # noqa: E402
from tracer.demo import grpo_trl, rloo_trl  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402

import torch  # noqa: E402

K = 2
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _traced(make_trainer, model_dir, out, tmp_path):
    trainer = make_trainer(model_dir, tmp_path / "scratch", steps=2, seed=0, progress=False)
    tracer.attach(trainer, out, sampling=SamplingPolicy(first_k_sequences=K))
    with torch_threads(1):
        trainer.train()
    return Trace(out)


@pytest.mark.parametrize("make_trainer", [grpo_trl.make_trainer, rloo_trl.make_trainer], ids=["grpo", "rloo"])
def test_first_k_sequences_cuts_every_batch_field_and_check_stays_quiet(tmp_path, model_dir, make_trainer):
    B = grpo_trl.NUM_GENERATIONS * grpo_trl.PROMPTS_PER_STEP
    assert B > K
    trace = _traced(make_trainer, model_dir, tmp_path / "trace", tmp_path)
    assert trace.steps()
    for key in trace.steps():
        data = trace.load_step(key)
        long = {name: list(t.shape) for name, t in data.items() if t.dim() and t.shape[0] == B}
        assert long == {}, f"{key.label}: fields still holding B = {B} rows: {long}"
        assert data["completion_ids"].shape[0] == K
    findings = run_checks(trace)
    bad = [f"{f.severity} {f.check}: {f.message}" for f in findings if f.severity in (ERROR, WARNING)]
    assert bad == [], "\n".join(bad)


def test_first_k_sequences_cuts_only_fields_of_the_step_s_batch():
    B, T = 6, 3
    tensors = {"completion_ids": torch.zeros(B, T, dtype=torch.long), "advantages": torch.arange(B, dtype=torch.float),
               "my_row_score": torch.arange(B, dtype=torch.float), "my_vocab_table": torch.zeros(50),
               "my_scalar": torch.tensor(1.0), "loss": torch.tensor(0.5)}
    out = first_k_sequences(tensors, K, "grpo")
    assert {n: list(t.shape) for n, t in out.items()} == {
        "completion_ids": [K, T], "advantages": [K], "my_row_score": [K], "my_vocab_table": [50], "my_scalar": [],
        "loss": []}
    assert out["my_row_score"].tolist() == [0.0, 1.0]
    # no canonical [B, ...] field: B is unknown, so the trainer's own fields stay whole
    alone = first_k_sequences({"my_row_score": torch.arange(B, dtype=torch.float)}, K, "grpo")
    assert list(alone["my_row_score"].shape) == [B]
