"""The KL term of the per-token loss under each estimator name a trainer records: k1 / k2 / k3, verl's
kl / mse / low_var_kl and their straight-through forms (``k3+``: k3's value, k2's gradient) are recomputed,
and the check passes on a loss built by hand with that estimator; an estimator tracer does not model
(verl's ``abs``) opens the report with "not checked: KL estimator 'abs'" instead of a silent pass.

One GRPO step file of 2 rows x 4 tokens, written with the explicit API; the per-token loss is built here
by hand: ``-min(r A, clip(r, 0.8, 1.2) A) + 0.1 * KL`` with the estimator written out.
"""

from __future__ import annotations

import pytest
import torch

import tracer
from tracer.checks import ERROR, run_checks
from tracer.checks.coverage import NOT_CHECKED

POLICY = torch.tensor([[-1.0, -0.5, -2.0, -0.3], [-0.7, -1.2, -0.4, -0.9]])
OLD = POLICY - torch.tensor([[0.1, -0.05, 0.3, 0.0], [-0.2, 0.1, 0.05, -0.1]])
REF = POLICY + torch.tensor([[0.4, -0.3, 0.2, 0.1], [-0.5, 0.25, 0.3, -0.2]])
MASK = torch.tensor([[True, True, True, False], [True, True, True, True]])
ADV = torch.tensor([1.0, -1.0])
D = POLICY - REF
BY_HAND = {"k1": D, "k2": 0.5 * D**2, "k3": torch.exp(-D) + D - 1, "abs": D.abs()}
NAMES = {"k1": "k1", "kl": "k1", "kl+": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "k3+": "k3",
         "low_var_kl+": "k3"}


def write(tmp_path, name: str, kind: str):
    r = torch.exp(POLICY - OLD)
    a = ADV.unsqueeze(1)
    per_token_loss = -torch.min(r * a, r.clamp(0.8, 1.2) * a) + 0.1 * BY_HAND[kind]
    with tracer.Tracer(tmp_path / name, algorithm="grpo", hyperparameters={
            "beta": 0.1, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "kl_estimator": name,
            "num_generations": 2}) as writer:
        writer.record(0, {"policy_logprobs": POLICY, "old_logprobs": OLD, "ref_logprobs": REF,
                          "completion_mask": MASK, "advantages": ADV, "rewards": ADV,
                          "group_ids": torch.tensor([0, 0]), "per_token_loss": per_token_loss}, inner_step=1)
    return tmp_path / name


@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_estimator_name_is_recomputed_and_a_healthy_loss_passes(tmp_path, name):
    findings = run_checks(write(tmp_path, name, NAMES[name]))
    assert [f for f in findings if f.check == "recompute.per_token_loss"] == []
    assert [f for f in findings if f.check == NOT_CHECKED and "objective" in f.details] == []


def test_k3_plus_recorded_with_a_k1_term_is_named(tmp_path):
    trace = write(tmp_path, "k3+", "k1")
    (error,) = [f for f in run_checks(trace) if f.check == "recompute.per_token_loss" and f.severity == ERROR]
    assert error.message.startswith("The recorded per_token_loss follows the loss with the k1 estimator in its KL "
                                    "term"), error.message
    assert "Metadata declares 'k3+'" in error.message


def test_an_estimator_not_modelled_is_said_not_checked(tmp_path):
    findings = run_checks(write(tmp_path, "abs", "abs"))
    notes = [f for f in findings if f.check == NOT_CHECKED and "objective" in f.details]
    assert notes and notes[0].message.startswith("not checked: KL estimator 'abs' — unknown KL estimator 'abs'")
    assert [f for f in findings if f.severity == ERROR] == []
