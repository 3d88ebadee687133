"""A GRPO loss with TRL's vLLM importance-sampling correction whose weights the capture did not record: the
per-token loss is still checked, with the weights derived from the recorded old and sampler logprobs under
the declared mode and cap (``token_truncate``, cap 2: ``min(exp(old - sampler), 2)``); a loss that leaves the
weights out fails; without ``sampler_logprobs`` the report opens with "not checked: vLLM importance-sampling
correction" instead of a silent pass. The loss is built by hand here: ``-min(r A, clip(r, 0.8, 1.2) A) * w``.
"""

from __future__ import annotations

import torch

import tracer
from tracer.checks import ERROR, run_checks
from tracer.checks.coverage import NOT_CHECKED

POLICY = torch.tensor([[-1.0, -0.5, -2.0, -0.3], [-0.7, -1.2, -0.4, -0.9]])
OLD = POLICY - torch.tensor([[0.1, -0.05, 0.3, 0.0], [-0.2, 0.1, 0.05, -0.1]])
SAMPLER = OLD - torch.tensor([[0.9, 0.1, -0.4, 0.0], [0.2, 1.5, 0.0, -0.3]])  # exp(old - sampler): 2.46 and 4.48 capped
MASK = torch.tensor([[True, True, True, False], [True, True, True, True]])
ADV = torch.tensor([1.0, -1.0])
HYPER = {"beta": 0.0, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "num_generations": 2,
         "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
         "vllm_importance_sampling_clip_max": 2.0}


def write(tmp_path, weighted: bool = True, sampler: bool = True):
    r = torch.exp(POLICY - OLD)
    a = ADV.unsqueeze(1)
    w = torch.exp(OLD - SAMPLER).clamp(max=2.0) if weighted else torch.ones_like(POLICY)
    per_token_loss = -torch.min(r * a, r.clamp(0.8, 1.2) * a) * w
    tensors = {"policy_logprobs": POLICY, "old_logprobs": OLD, "completion_mask": MASK, "advantages": ADV,
               "rewards": ADV, "group_ids": torch.tensor([0, 0]), "per_token_loss": per_token_loss}
    if sampler:
        tensors["sampler_logprobs"] = SAMPLER
    with tracer.Tracer(tmp_path, algorithm="grpo", hyperparameters=HYPER) as writer:
        writer.record(0, tensors, inner_step=1)
    return tmp_path


def loss_findings(trace):
    return [f for f in run_checks(trace) if f.check == "recompute.per_token_loss"]


def test_derived_weights_check_a_healthy_weighted_loss(tmp_path):
    assert float(torch.exp(OLD - SAMPLER)[MASK].max()) > 2.0  # the cap binds on some kept token
    assert loss_findings(write(tmp_path / "ok")) == []


def test_a_loss_without_the_weights_fails(tmp_path):
    errors = [f for f in loss_findings(write(tmp_path / "bare", weighted=False)) if f.severity == ERROR]
    assert errors and errors[0].field == "per_token_loss"


def test_without_sampler_logprobs_the_correction_is_said_not_checked(tmp_path):
    findings = run_checks(write(tmp_path / "blind", sampler=False))
    notes = [f for f in findings if f.check == NOT_CHECKED and "objective" in f.details]
    assert notes and notes[0].message.startswith(
        "not checked: vLLM importance-sampling correction (vllm_importance_sampling_correction) — the IS weights "
        "the loss applies are not recorded, nor sampler_logprobs to derive them from")
    assert [f for f in findings if f.severity == ERROR and f.check.startswith("recompute.")] == []
