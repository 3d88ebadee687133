"""recompute.loss on two layouts real loops produce (found by an adversarial review on MiniMind-style and TRL
GRPO runs): a loss recorded divided by the gradient accumulation steps (MiniMind's ``loss / accumulation_steps``,
with ``gradient_accumulation_steps`` recorded and no ``loss_scale``) is healthy; a loss whose divisor counts
the padding (``(per_token_loss * mask).mean()``: the kept tokens summed over all B x T positions) is a loss
over padding, named as such, whether a reduction is declared or the padded width changes between steps.

Step files are written with TraceWriter; every expected number is computed here by hand in float64.
"""

from __future__ import annotations

import torch

from tracer.checks import ERROR, INFO, run_checks

from tests.fixtures.check_traces import EOS, PAD, found, write_trace

EPS = 0.2


def grpo_step(lengths: list[int], width: int, seed: int) -> dict:
    """One GRPO step of ``len(lengths)`` rows right-padded to ``width``; row b keeps ``lengths[b]`` tokens,
    the last an EOS. The per-token loss (a recorded tensor; only recompute.loss runs on it) grows along the
    row, so the reductions differ, and is non-zero at padding too (TRL computes it over the whole padded
    width and masks only in the reduction)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    ids = torch.randint(3, 60, (B, width), generator=g)
    for b, n in enumerate(lengths):
        ids[b, n - 1] = EOS
        ids[b, n:] = PAD
    logprobs = -torch.rand(B, width, generator=g) - 0.1
    advantages = torch.tensor([1.0, -1.0] * (B // 2))
    per_token_loss = -advantages[:, None] * (1 + 0.1 * torch.arange(width, dtype=torch.float32))  # (B, T)
    return {"completion_ids": ids, "completion_mask": keep, "policy_logprobs": logprobs, "old_logprobs": logprobs.clone(),
            "advantages": advantages, "group_ids": torch.arange(B) // 2, "rewards": advantages.clone(),
            "per_token_loss": per_token_loss}


def by_hand(step: dict) -> dict[str, float]:
    ptl, keep = step["per_token_loss"].double(), step["completion_mask"].double()
    B, T = ptl.shape
    return {"sequence_mean": float(((ptl * keep).sum(1) / keep.sum(1)).mean()),
            "token_mean": float((ptl * keep).sum() / keep.sum()),
            "padded_divisor": float((ptl * keep).sum() / (B * T))}


HYPER = {"num_generations": 2, "clip_epsilon_low": EPS, "clip_epsilon_high": EPS, "beta": 0.0}


def test_a_loss_divided_by_the_accumulation_steps_is_healthy_and_says_so(tmp_path):
    step = grpo_step([2, 4, 3, 5], 6, seed=0)
    value = by_hand(step)["sequence_mean"] / 2  # MiniMind: loss = policy_loss / accumulation_steps
    step["loss"] = torch.tensor(value, dtype=torch.float32)
    hyper = {**HYPER, "gradient_accumulation_steps": 2}
    declared = run_checks(write_trace(tmp_path / "declared", "grpo", [(0, 0, step)],
                                      {**hyper, "loss_reduction": "sequence_mean"}), select=["recompute.loss"])
    assert found(declared, "recompute.loss") == []
    (info,) = found(run_checks(write_trace(tmp_path / "undeclared", "grpo", [(0, 0, step)], hyper),
                               select=["recompute.loss"]), "recompute.loss")
    assert info.severity == INFO and info.details["matches"] == ["sequence_mean"]
    assert "times 1 / gradient_accumulation_steps (0.5)" in info.message
    # without the recorded accumulation steps, half the loss is no reduction of it
    (error,) = found(run_checks(write_trace(tmp_path / "no_ga", "grpo", [(0, 0, step)],
                                            {**HYPER, "loss_reduction": "sequence_mean"}),
                                select=["recompute.loss"]), "recompute.loss")
    assert error.severity == ERROR


def test_padding_counted_in_the_divisor_is_named_a_loss_over_padding(tmp_path):
    step = grpo_step([2, 4, 3, 5, 6, 1, 4, 2], 6, seed=1)
    hand = by_hand(step)
    step["loss"] = torch.tensor(hand["padded_divisor"], dtype=torch.float32)  # (ptl * mask).mean()
    assert abs(hand["padded_divisor"] - hand["token_mean"]) > 1e-2  # the bug shows
    out = write_trace(tmp_path / "padded", "grpo", [(0, 0, step)], {**HYPER, "loss_reduction": "token_mean"})
    (error,) = found(run_checks(out, select=["recompute.loss"]), "recompute.loss")
    assert error.severity == ERROR and error.details["cause"] == "padded_divisor"
    assert error.message.startswith(
        f"loss over padding: recorded loss {hand['padded_divisor']:.6g} equals the masked sum of the recorded "
        "per_token_loss divided by all 8 × 6 = 48 positions, padding counted in the divisor (21 of 48 positions "
        "are masked) to ")  # 48 - (2 + 4 + 3 + 5 + 6 + 1 + 4 + 2) = 21
    assert f"the declared token-mean of the recorded per_token_loss gives {hand['token_mean']:.6g}" in error.message


def test_an_undeclared_constant_divisor_that_follows_the_padded_width_is_a_loss_over_padding(tmp_path):
    """No reduction, divisor or max_completion_length recorded: `masked sum / (B * T)` matches the
    constant reduction's fallback B * T of each step file, but T is 5, 4, 6 across the steps: no constant."""
    steps, expected = [], []
    for s, (lengths, width) in enumerate([([2, 4, 3, 5], 5), ([1, 4, 3, 2], 4), ([6, 2, 3, 5], 6)]):
        step = grpo_step(lengths, width, seed=10 + s)
        step["loss"] = torch.tensor(by_hand(step)["padded_divisor"], dtype=torch.float32)
        steps.append((s, 0, step))
        expected.append(by_hand(step))
    findings = found(run_checks(write_trace(tmp_path / "varying", "grpo", steps, HYPER), select=["recompute.loss"]),
                     "recompute.loss")
    assert [f.severity for f in findings] == [ERROR] * 3
    assert all(f.details["cause"] == "padded_divisor" for f in findings)
    assert ("the padded width T changes between step files (4, 5, 6) and no max_completion_length or loss_divisor "
            "is recorded, so B × T is no constant divisor") in findings[0].message
    # the same loss with one padded width throughout cannot be told from Dr. GRPO's constant divisor: an info
    same = [(s, 0, grpo_step(lengths, 6, seed=20 + s)) for s, lengths in enumerate([[2, 4, 3, 5], [1, 4, 3, 2]])]
    for _, _, step in same:
        step["loss"] = torch.tensor(by_hand(step)["padded_divisor"], dtype=torch.float32)
    infos = found(run_checks(write_trace(tmp_path / "fixed", "grpo", same, HYPER), select=["recompute.loss"]),
                  "recompute.loss")
    assert [f.severity for f in infos] == [INFO, INFO] and all("constant" in f.details["matches"] for f in infos)
