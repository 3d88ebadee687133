"""``record()`` under ``torch.inference_mode()`` (a rollout or evaluation phase) and outside it in the
same run: every step is written with the values the loop held, whichever writer. The staging
buffers, the writer process's ring and its views are reused across steps; made under inference
mode they would be inference tensors, which refuse the in-place copies of the steps after the block
(before the fix every step after the first inference-mode one was dropped)."""

from __future__ import annotations

import warnings

import pytest
import torch

import tracer
from tracer import Trace

B, T = 4, 6


def fields(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=g)
    return {"completion_ids": torch.randint(2, 50, (B, T), generator=g),
            "completion_mask": torch.ones(B, T, dtype=torch.bool), "policy_logprobs": logprobs,
            "old_logprobs": logprobs - 0.01 * seed, "rewards": torch.randn(B, generator=g),
            "advantages": torch.randn(B, generator=g), "group_ids": torch.arange(B) // 2}


@pytest.mark.parametrize("writer", ["thread", "process", "inline"])
@pytest.mark.parametrize("pattern", ["first", "alternating"])
def test_steps_recorded_in_and_out_of_inference_mode_are_all_written(tmp_path, writer, pattern):
    inside = {"first": lambda s: s == 0, "alternating": lambda s: s % 2 == 0}[pattern]
    kwargs = {"async_write": False} if writer == "inline" else {"writer": writer}
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dropped step warns: fail on it
        w = tracer.Tracer(tmp_path / "t", algorithm="grpo", hyperparameters={"num_generations": 2}, strict=True,
                          **kwargs)
        for step in range(6):
            d = fields(step)
            expected[step] = {k: v.clone() for k, v in d.items()}
            if inside(step):
                with torch.inference_mode():
                    w.record(step, d)
            else:
                w.record(step, d)
            w.flush()  # written: its buffers go back to the pool, for the next step to reuse
            for t in d.values():  # the loop reuses its tensors
                t.zero_() if t.dtype != torch.bool else t.fill_(False)
        w.close()
    trace = Trace(tmp_path / "t")
    assert [k.step for k in trace.steps()] == list(range(6))
    for key in trace.steps():
        d = trace.load_step(key, derive=False)
        for name, value in expected[key.step].items():
            assert torch.equal(d[name], value), (key.step, name)
