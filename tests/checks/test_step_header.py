"""What `tracer.checks.context.StepHeader` reads from a step file's header, for the checks that share it:
the KL coefficient (``kl_coef``, else TRL's ``beta``) and the declared float dtypes."""

from __future__ import annotations

import pytest
import torch

import tracer
from tracer.checks.context import StepHeader
from tracer.read import Trace


def _header(tmp_path, hyperparameters: dict, metadata: dict | None = None) -> StepHeader:
    with tracer.Tracer(tmp_path / "t", algorithm="ppo", hyperparameters=hyperparameters) as w:
        w.record(0, {"completion_mask": torch.ones(1, 2), "policy_logprobs": torch.tensor([[-1.0, -2.0]])},
                 metadata=metadata)
    trace = Trace(tmp_path / "t")
    return StepHeader(trace, trace.steps()[0])


@pytest.mark.parametrize("hyper, metadata, expected", [
    ({"kl_coef": 0.02}, None, 0.02),
    ({"beta": 0.04}, None, 0.04),  # TRL's name
    ({"kl_coef": 0.02, "beta": 0.04}, None, 0.02),  # kl_coef first
    ({"kl_coef": 0.0, "beta": 0.04}, None, None),  # kl_coef set to 0: no penalty (beta is not consulted)
    ({"beta": 0.04}, {"kl_coef": 0.1}, 0.1),  # the step's metadata over the run's hyperparameters
    ({"kl_coef": True}, None, None),  # a bool is no coefficient
    ({"kl_coef": "0.05"}, None, 0.05),  # a number written as text
    ({"kl_coef": "adaptive"}, None, None),
    ({}, None, None),
])
def test_kl_coef_is_kl_coef_else_beta(tmp_path, hyper, metadata, expected):
    assert _header(tmp_path, hyper, metadata).kl_coef() == expected


def test_declared_dtypes_split_source_and_model_dtype(tmp_path):
    header = _header(tmp_path, {"model_dtype": "bfloat16, float32"})
    assert header.declared_dtypes() == ["float32", "bfloat16", "float32"]  # source_dtype (the writer's) first
