"""Zero-edit capture leaves the map's per-token derived fields (``ratio``, ``approx_kl_k2``,
``ref_kl_k3``) to the writer (off the training thread): the trace still records them, with
the values of the formulas (SPEC.md section 4) worked out here from the loop's own tensors."""

import threading

import pytest
import torch

import tracer
from tracer import Trace, formulas


def ppo_minibatches(steps=2):
    """MiniMind's PPO names: a rollout's old/ref logprobs, then minibatches drawn by ``inds``."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3))
    old_resp_logp = -torch.rand(4, 3)
    ref_resp_logp = -torch.rand(4, 3)
    resp_policy_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    seen = []
    for step in range(steps):
        inds = torch.tensor([3, 1]) if step % 2 else torch.tensor([0, 2])
        mb_resp_logp = -torch.nn.functional.softplus(weight[inds])  # (2, 3) policy logprobs
        seen.append((mb_resp_logp.detach().clone(), old_resp_logp[inds], ref_resp_logp[inds]))
        loss = -(mb_resp_logp * resp_policy_mask[inds]).sum()
        loss.backward()
    return seen


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_derived_fields_are_recorded_with_the_formulas_values_and_not_computed_on_the_training_thread(
        tmp_path, monkeypatch, writer):
    threads = []
    for name in ("ratio", "approx_kl_k2", "ref_kl_k3"):
        real = getattr(formulas, name)

        def spy(*args, _real=real, _name=name):
            threads.append((_name, threading.current_thread() is threading.main_thread()))
            return _real(*args)
        # the package (what callers outside formulas read) and each submodule that binds the name (the
        # per-token losses call ratio and ref_kl_k3 through their own module's globals)
        for module in (formulas, formulas.logprobs, formulas.losses):
            if getattr(module, name, None) is real:
                monkeypatch.setattr(module, name, spy)
    with tracer.watch(algo="ppo", out=tmp_path / "w", writer=writer) as w:
        seen = ppo_minibatches()
    assert w.steps_recorded == 2 and not w.failures
    if writer == "thread":  # the writer thread computed them (the writer process's calls are not seen here)
        assert sorted({name for name, _ in threads}) == ["approx_kl_k2", "ratio", "ref_kl_k3"], threads
    assert not any(on_main for _, on_main in threads), threads
    trace = Trace(tmp_path / "w")
    for key, (policy, old, ref) in zip(trace.steps(), seen):
        data = trace.load_step(key)
        assert trace.derived_fields(key) == []  # recorded in the file, not derived by the reader
        torch.testing.assert_close(data["ratio"], torch.exp(policy - old), rtol=0, atol=0)
        torch.testing.assert_close(data["approx_kl_k2"], 0.5 * (policy - old) ** 2, rtol=0, atol=0)
        # k3 = exp(ref - policy) - (ref - policy) - 1, here in another order of float32 operations
        torch.testing.assert_close(data["ref_kl_k3"], torch.exp(ref - policy) - (ref - policy) - 1, rtol=1e-6, atol=1e-7)
