"""Three false alarms or silenced bugs of the first micro-batch, logprob-shift and cut-row rules,
each pinned on the data that showed it. Values are worked out by hand in the comments.

- identical rows scored apart by dropout in gradient-accumulation micro-batches the trainer numbered
  itself were taken for a later pass (not fresh), and identity.old_aliases_policy then fired: the
  later-pass rule now applies only to micro-batches a zero-edit capture counted (metadata
  ``micro_batch_counted``);
- trainer/sampler noise (0.15-0.3 nats) made one repeated-token position "fit" the next position's
  distribution (alignment.logprob_shift): at least 3 positions, fitting within a tenth of the gap;
- ``first_k_sequences`` >= the micro-batch size skipped recompute.loss although nothing was cut: the
  writer now records ``rows_before_cut`` when it drops rows, and only then do the loss checks skip.
(tests/checks/test_foreign_loops.py holds the loops these were found on.)
"""

import torch

import tracer
from tracer.checks import ERROR, WARNING, run_checks
from tracer.record.capture import SamplingPolicy


def test_rows_scored_apart_by_dropout_in_numbered_micro_batches_stay_fresh(tmp_path):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    ids = torch.randint(3, 9, (B, T), generator=g)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with tracer.Tracer(tmp_path / "t", algorithm="grpo", hyperparameters={"num_generations": 4, "beta": 0.0,
                                                                          "clip_epsilon_high": 0.2}) as w:
        for step in range(2):
            for mb in range(2):  # the same two rows in both micro-batches, scored apart by dropout noise
                policy = -torch.rand(2, T, generator=g) - 0.1
                w.record(step, {"prompt_ids": torch.full((2, 3), 5), "completion_ids": ids[:2],
                                "completion_mask": torch.ones(2, T), "policy_logprobs": policy,
                                "rewards": rewards[:2], "advantages": torch.tensor([1.0, -1.0]),
                                "group_ids": torch.zeros(2, dtype=torch.long)},
                         micro_batch=mb, metadata={"old_logprobs_source": "policy_detached",
                                                   "gradient_accumulation_steps": 2})
    findings = run_checks(tmp_path / "t")
    assert [f for f in findings if f.check.startswith("identity.") and f.severity in (ERROR, WARNING)] == []


def test_sampler_noise_with_repeated_tokens_is_no_logprob_shift(tmp_path):
    """recorded = sampler + N(0, 0.2) nats, tokens from a 60-token vocabulary (a repeated neighbour or two a
    file): the review's Monte Carlo flagged 4-9 files in 100 on one repeated position."""
    g = torch.Generator().manual_seed(0)
    B, T = 8, 12
    with tracer.Tracer(tmp_path / "t", algorithm="grpo", hyperparameters={"num_generations": 4, "beta": 0.0,
                                                                          "clip_epsilon_high": 0.2}) as w:
        for step in range(100):
            sampler = -torch.empty(B, T).exponential_(2.0, generator=g)  # mean 0.5 nats
            recorded = (sampler + 0.2 * torch.randn(B, T, generator=g)).clamp(max=-1e-4)
            w.record(step, {"prompt_ids": torch.full((B, 3), 5), "completion_ids": torch.randint(3, 63, (B, T), generator=g),
                            "completion_mask": torch.ones(B, T), "policy_logprobs": recorded, "old_logprobs": recorded,
                            "sampler_logprobs": sampler, "rewards": torch.randn(B, generator=g),
                            "group_ids": torch.arange(B) // 4})
    assert run_checks(tmp_path / "t", select=["alignment.logprob_shift"]) == []


def _grpo_steps(out, k: int | None, rows: int, loss_bug: bool):
    """Two GRPO micro-batches of ``rows`` rows; the recorded loss is the declared sequence mean, or (bug) the
    token sum."""
    g = torch.Generator().manual_seed(1)
    T = 4
    sampling = SamplingPolicy(first_k_sequences=k) if k else None
    with tracer.Tracer(out, algorithm="grpo", sampling=sampling, hyperparameters={
            "num_generations": 2, "beta": 0.0, "clip_epsilon_high": 0.2, "loss_reduction": "sequence_mean"}) as w:
        for mb in range(2):
            policy = -torch.rand(rows, T, generator=g) - 0.1
            advantages = torch.tensor([1.0, -0.5] * (rows // 2))
            per_token_loss = -advantages[:, None] * torch.ones(rows, T)  # ratio 1
            loss = per_token_loss.sum() if loss_bug else per_token_loss.mean(1).mean()
            w.record(0, {"completion_ids": torch.randint(3, 9, (rows, T), generator=g),
                         "completion_mask": torch.ones(rows, T), "policy_logprobs": policy, "old_logprobs": policy,
                         "rewards": advantages.clone(), "advantages": advantages, "per_token_loss": per_token_loss,
                         "loss": loss}, micro_batch=mb)
    return run_checks(out, select=["recompute.loss"])


def test_first_k_sequences_skips_the_loss_check_only_where_rows_were_dropped(tmp_path):
    errors = lambda fs: [f for f in fs if f.severity == ERROR]  # noqa: E731
    # K >= the micro-batch: nothing was cut, so a wrong loss is still an error (the review's silenced bug)
    assert len(errors(_grpo_steps(tmp_path / "whole", k=4, rows=4, loss_bug=True))) == 2
    assert errors(_grpo_steps(tmp_path / "whole_ok", k=4, rows=4, loss_bug=False)) == []
    # K below it: the loss covers rows the files lack, so the check skips, saying why
    cut = _grpo_steps(tmp_path / "cut", k=2, rows=4, loss_bug=True)
    assert errors(cut) == []
    reason = "the writer kept the first 2 of the step's 4 sequences (first_k_sequences): the recorded loss was taken over all of them"
    assert [f.message for f in cut if f.check == "recompute.loss"] == [f"skipped on 2 of 2 step files: {reason}"]
    # and the report opens with the bug class left unchecked, and why (tracer.checks.coverage)
    assert [f.message for f in cut if f.check == "trace.not_checked"] == [
        f"not checked: loss reduction and loss over padding — on 2 of 2 step files none of recompute.loss could run: {reason}"]
    assert tracer.Trace(tmp_path / "cut").metadata(tracer.Trace(tmp_path / "cut").steps()[0])["rows_before_cut"] == 4
