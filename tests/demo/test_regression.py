"""Trace regression tests of the hand-written demo loops (fixed seeds, 2 steps) against committed
baselines in tests/demo/test_regression/, one set per CPU vendor (``<test>.<vendor_id>``): with ATen
and MKL pinned to their AVX2 kernels (tests/conftest.py), an Intel and an AMD machine still differ in
the last bits of float32 results, which one optimizer step amplifies past the tolerance (up to 3e-4
here). Re-record after an intended change with ``pytest tests/demo/test_regression.py --tracer-regen``
on each vendor's machine and commit the baselines; a vendor without baselines fails and says how to
record them."""

import os

import pytest
import torch

from tracer.demo.runner import run_demo


def _kernels() -> tuple[str, str | None]:
    return torch.backends.cpu.get_cpu_capability(), os.environ.get("MKL_CBWR")


def _vendor() -> str:
    """The CPU vendor as /proc/cpuinfo names it (``GenuineIntel``, ``AuthenticAMD``), else ``unknown``."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() or "unknown"
    except OSError:
        pass
    return "unknown"


@pytest.mark.parametrize("algo", ["ppo", "grpo", "cispo", "dpo"])
def test_demo_loop_matches_baseline(algo, model_dir, tmp_path, trace_regression):
    # the baselines hold AVX2-kernel float32 results (tests/conftest.py pins ATen and MKL to them): an
    # AVX-512 machine left unpinned differs from them by up to 1e-3 after the first optimizer step
    assert _kernels() == ("AVX2", "AVX2"), (
        f"CPU kernels {_kernels()}: the baselines were recorded with ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 "
        "(tests/conftest.py sets both unless the environment already does; this machine needs AVX2)")
    trace = run_demo(algo, tmp_path / algo, steps=2, seed=0, progress=False, model_dir=model_dir)
    # float32 on CPU: allow for kernel differences between machines, nothing more
    trace_regression.check(trace, _vendor(), atol=1e-4, rtol=1e-4)


def test_the_baseline_catches_a_changed_loop(model_dir, tmp_path):
    from pathlib import Path

    from tracer.demo import grpo_loop
    from tracer.testing import assert_traces_match

    baseline = Path(__file__).with_suffix("") / f"test_demo_loop_matches_baseline_grpo.{_vendor()}"
    # the same rollouts at step 0, but a larger learning rate: the policy differs from inner step 1 on
    changed = grpo_loop.run(tmp_path / "grpo", grpo_loop.GRPOConfig(steps=1, learning_rate=1e-2), model_dir)
    with pytest.raises(AssertionError, match=r"policy_logprobs: max \|Δ\|=.* at step 0"):
        assert_traces_match(changed, baseline, atol=1e-4, rtol=1e-4, fields=["policy_logprobs", "completion_ids"])
