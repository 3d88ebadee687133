"""Zero-edit capture of a loop with an entropy bonus: the shipped name map reads ``entropy`` [B, T] and
metadata ``entropy_coef``, ``clip_ratio_c`` and ``importance_sampling_level`` (``args.*``) from the
frame, so ``recompute.loss`` checks the loss with its bonus: a healthy loop passes, one that adds the
bonus where it should subtract it is named ("entropy bonus sign flipped")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tracer
from tracer import Trace
from tracer.checks import ERROR, run_checks


def _loop(steps: int, sign: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """GRPO-style updates, loss = token-mean clipped surrogate − sign · entropy_coef · token-mean entropy;
    returns (entropy, loss) of each step."""
    args = SimpleNamespace(entropy_coef=0.05, clip_ratio_c=3.0, importance_sampling_level="token", beta=0.0,
                           clip_epsilon=0.2, num_generations=2)
    gen = torch.Generator().manual_seed(0)
    logits = torch.nn.Parameter(torch.randn(4, 5, 7, generator=gen))  # (B, T, V)
    optimizer = torch.optim.SGD([logits], lr=0.5)
    ids = torch.randint(0, 7, (4, 5), generator=gen)
    completion_mask = torch.ones(4, 5, dtype=torch.bool)
    completion_mask[1, 3:] = False
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = []
    for step in range(steps):
        logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
        per_token_logps = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
        old_per_token_logps = per_token_logps.detach()
        entropy = -(logp.exp() * logp).sum(-1)  # (B, T) nats
        ratio = torch.exp(per_token_logps - old_per_token_logps)
        per_token_loss = -torch.min(ratio * advantages[:, None],
                                    ratio.clamp(1 - args.clip_epsilon, 1 + args.clip_epsilon) * advantages[:, None])
        m = completion_mask.float()
        loss = (per_token_loss * m).sum() / m.sum() - sign * args.entropy_coef * (entropy * m).sum() / m.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append((entropy.detach(), loss.detach()))
    return out


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_capture_records_entropy_and_the_loss_is_checked_with_its_bonus(tmp_path, sign):
    with tracer.watch(algo="grpo", out=tmp_path / "run"):
        used = _loop(steps=2, sign=sign)
    trace = Trace(tmp_path / "run")
    keys = sorted(trace.steps(), key=lambda k: k.step)
    assert len(keys) == 2
    for key, (entropy, loss) in zip(keys, used):
        data, meta = trace.load_step(key), trace.metadata(key)
        assert torch.equal(data["entropy"], entropy)
        assert meta["entropy_coef"] == 0.05 and meta["clip_ratio_c"] == 3.0
        assert meta["importance_sampling_level"] == "token"
    findings = [f for f in run_checks(trace, select=["recompute.loss"]) if f.severity != "info"]
    if sign == 1.0:
        assert findings == [], [f.message[:200] for f in findings]
    else:
        assert findings and all(f.severity == ERROR and f.message.startswith("entropy bonus sign flipped")
                                for f in findings), [f.message[:200] for f in findings]
