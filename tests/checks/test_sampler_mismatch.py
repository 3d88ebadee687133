"""``sampler.mismatch`` on mismatches made the way engines make them: tokens sampled from real
next-token distributions (random logits), the trainer scoring logits / τ, the sampler reporting raw
logprobs, a nucleus-renormalised distribution, a constant offset, or only numerical noise (logits
perturbed at fp32 level, or rounded to bfloat16). Systematic patterns are errors; noise stays info.
The importance-sampling part is checked against weights built here by hand from TRL's rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tracer.checks import ERROR, INFO, WARNING, run_checks

from tests.fixtures.check_traces import found, write_trace


B, T, V = 8, 12, 40
TAU = 0.7


def make_logits(seed: int, scale: float = 3.0) -> torch.Tensor:
    """``[B, T, V]`` logits of peaked next-token distributions (one favourite token per position)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * scale
    favourite = torch.randint(0, V, (B, T, 1), generator=g)
    return logits.scatter_add(-1, favourite, torch.full((B, T, 1), 2.0 * scale))


def sample(probs: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.multinomial(probs.reshape(-1, V), 1, generator=g).reshape(B, T)


def logprob_at(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logprobs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` restricted to the smallest set of top tokens whose mass reaches ``top_p``, renormalised."""
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def step_tensors(trainer: torch.Tensor, sampler: torch.Tensor, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"completion_mask": torch.ones(B, T, dtype=torch.bool), "old_logprobs": trainer,
            "policy_logprobs": trainer.clone(), "sampler_logprobs": sampler, **extra}


def mismatch(tmp_path, name, trainer, sampler, hyper=None, metadata=None, **extra):
    root = write_trace(tmp_path / name, "grpo", [(0, 0, step_tensors(trainer, sampler, **extra), metadata or {})],
                       hyperparameters={"temperature": TAU, "top_p": 1.0, "top_k": 0, **(hyper or {})})
    (finding,) = found(run_checks(root), "sampler.mismatch")
    return finding


@pytest.mark.parametrize("seed", range(4))
def test_fp32_noise_is_info(tmp_path, seed):
    logits = make_logits(seed)
    ids = sample(torch.softmax(logits / TAU, -1), seed)
    trainer = logprob_at(torch.log_softmax(logits / TAU, -1), ids)
    noise = 1e-3 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed + 7))
    sampler = logprob_at(torch.log_softmax((logits + noise) / TAU, -1), ids)  # another kernel's rounding
    f = mismatch(tmp_path, "noise", trainer, sampler)
    assert f.severity == INFO and f.details["patterns"] == []
    assert f.details["mean_abs"] < 1e-2  # noise of 1e-3 in the logits


@pytest.mark.parametrize("seed", range(12))
def test_noise_over_many_distributions_raises_no_pattern(tmp_path, seed):
    # sharp to flat distributions (logit scale 0.3 to 6) and noise from 1e-4 to 3e-3 in the logits
    scale = [0.3, 1.0, 3.0, 6.0][seed % 4]
    level = [1e-4, 1e-3, 3e-3][seed % 3]
    logits = make_logits(100 + seed, scale=scale)
    ids = sample(torch.softmax(logits / TAU, -1), 100 + seed)
    trainer = logprob_at(torch.log_softmax(logits / TAU, -1), ids)
    noise = level * torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    sampler = logprob_at(torch.log_softmax((logits + noise) / TAU, -1), ids)
    f = mismatch(tmp_path, "noise", trainer, sampler)
    assert f.severity == INFO and f.details["patterns"] == []


@pytest.mark.parametrize("seed", range(3))
def test_bfloat16_rounding_is_not_an_error(tmp_path, seed):
    logits = make_logits(seed)
    ids = sample(torch.softmax(logits / TAU, -1), seed)
    trainer = logprob_at(torch.log_softmax(logits / TAU, -1), ids)
    rounded = logits.bfloat16().float()
    sampler = logprob_at(torch.log_softmax(rounded / TAU, -1), ids)
    f = mismatch(tmp_path, "bf16", trainer, sampler, metadata={"model_dtype": "bfloat16"})
    assert f.severity in (INFO, WARNING) and f.details["patterns"] == []


def test_raw_logprobs_under_temperature_is_an_error(tmp_path):
    # the engine samples from softmax(logits / τ) but reports log_softmax(logits): trl#4159
    logits = make_logits(0)
    ids = sample(torch.softmax(logits / TAU, -1), 0)
    trainer = logprob_at(torch.log_softmax(logits / TAU, -1), ids)
    sampler = logprob_at(torch.log_softmax(logits, -1), ids)
    f = mismatch(tmp_path, "raw", trainer, sampler)
    assert f.severity == ERROR
    assert any("temperature applied on one side only (temperature = 0.7" in p for p in f.details["patterns"])


def test_raw_logprobs_on_a_flat_distribution_scale_by_tau(tmp_path):
    # near-uniform logits: log p = -log V + (z - mean z) / τ up to second order, so the raw logprobs
    # are τ = 0.7 times the tempered ones around their mean
    logits = make_logits(1, scale=0.05)
    ids = sample(torch.softmax(logits / TAU, -1), 1)
    trainer = logprob_at(torch.log_softmax(logits / TAU, -1), ids)
    sampler = logprob_at(torch.log_softmax(logits, -1), ids)
    f = mismatch(tmp_path, "flat", trainer, sampler)
    assert f.severity == ERROR and "sampler logprobs ≈ 0.70" in f.message


def test_engine_reporting_raw_logprobs_while_tempering_is_an_error(tmp_path):
    logits = make_logits(2)
    ids = sample(torch.softmax(logits / TAU, -1), 2)
    trainer = logprob_at(torch.log_softmax(logits / TAU, -1), ids)
    f = mismatch(tmp_path, "mode", trainer, trainer.clone(), hyper={"sampler_logprobs_mode": "raw_logprobs"})
    assert f.severity == ERROR and "reports raw_logprobs while it samples with temperature = 0.7" in f.message
    # at temperature 1 with no truncation raw and processed logprobs are the same thing
    f = mismatch(tmp_path, "mode1", trainer, trainer.clone(), hyper={"sampler_logprobs_mode": "raw_logprobs",
                                                                     "temperature": 1.0})
    assert f.severity == INFO


def test_top_p_renormalisation_is_an_error(tmp_path):
    # trl#6789: the engine samples from the nucleus and reports its renormalised logprobs
    logits = make_logits(3)
    processed = nucleus(torch.softmax(logits / TAU, -1), 0.8)
    ids = sample(processed, 3)
    trainer = logprob_at(torch.log_softmax(logits / TAU, -1), ids)
    sampler = logprob_at(processed.log(), ids)
    assert bool((trainer <= sampler + 1e-6).all())  # p / Z >= p: the premise of the pattern
    f = mismatch(tmp_path, "topp", trainer, sampler, hyper={"top_p": 0.8})
    assert f.severity == ERROR
    assert any("below the sampler's on" in p and "top_p = 0.8" in p for p in f.details["patterns"])


def test_constant_offset_is_an_error(tmp_path):
    logits = make_logits(4)
    ids = sample(torch.softmax(logits / TAU, -1), 4)
    trainer = logprob_at(torch.log_softmax(logits / TAU, -1), ids)
    sampler = trainer + 0.08  # below the 0.5 nats error bound on the mean: only the pattern makes it an error
    f = mismatch(tmp_path, "offset", trainer, sampler)
    assert f.severity == ERROR and any("constant -0.0800 nats" in p for p in f.details["patterns"])


def test_probability_space_is_reported(tmp_path):
    trainer = torch.full((B, T), math.log(0.5))
    sampler = torch.full((B, T), math.log(0.5))
    sampler[0, 0] = math.log(0.9)  # |0.5 - 0.9| = 0.4 on one of 96 tokens
    f = mismatch(tmp_path, "prob", trainer, sampler)
    assert f.details["prob_diff_max"] == pytest.approx(0.4, abs=1e-6)
    assert f.details["prob_diff_mean"] == pytest.approx(0.4 / (B * T), abs=1e-6)
    assert f.details["mean_abs"] == pytest.approx(math.log(1.8) / (B * T), abs=1e-6)


def test_token_truncation_counts_the_capped_tokens(tmp_path):
    g = torch.Generator().manual_seed(5)
    trainer = -torch.rand(B, T, generator=g) * 2
    sampler = trainer - 0.02 * torch.randn(B, T, generator=g)
    sampler[1, 3] = trainer[1, 3] - 1.0  # exp(1) = 2.72 > cap 2.5: truncated
    sampler[2, 5] = trainer[2, 5] - 1.2  # exp(1.2) = 3.32 > 2.5: truncated
    weights = torch.exp(trainer - sampler).clamp(max=2.5)  # TRL token_truncate, by hand
    f = mismatch(tmp_path, "tis", trainer, sampler, hyper={"is_mode": "token_truncate", "is_clip_max": 2.5},
                 is_weights=weights)
    c = f.details["correction"]
    assert c["cut"] == 2 and c["count"] == B * T and c["weights_max"] == pytest.approx(2.5)
    assert "truncated 2 of 96 tokens" in f.message and "differ from TRL's rule" not in f.message
    f = mismatch(tmp_path, "tis-wrong", trainer, sampler, hyper={"is_mode": "token_truncate", "is_clip_max": 2.5},
                 is_weights=torch.exp(trainer - sampler))  # the cap was not applied
    assert f.severity == WARNING and "differ from TRL's rule" in f.message


@pytest.mark.parametrize("aggregation", ["sum", "mean"])
def test_sequence_ratio_aggregation_sum_vs_mean(tmp_path, aggregation):
    # per-token noise of std 0.4 nats over 12 tokens: the sum's std is 0.4 * sqrt(12) = 1.39 nats,
    # so exp(sum) leaves [1/3, 3] (|sum| > 1.10) on some sequences; the mean's std is 0.12: never
    g = torch.Generator().manual_seed(6)
    trainer = -torch.rand(B, T, generator=g) * 2
    delta = 0.4 * torch.randn(B, T, generator=g)
    sampler = trainer - delta
    per_seq = delta.sum(-1) if aggregation == "sum" else delta.mean(-1)
    ratio = torch.exp(per_seq)
    weights = ratio.masked_fill((ratio > 3.0) | (ratio < 1 / 3), 0.0)  # TRL sequence_mask, by hand
    cut_by_sum = int(((delta.sum(-1).exp() > 3.0) | (delta.sum(-1).exp() < 1 / 3)).sum())
    assert cut_by_sum >= 1  # the premise: the sum cuts some sequences here
    f = mismatch(tmp_path, aggregation, trainer, sampler,
                 hyper={"is_mode": "sequence_mask", "is_clip_max": 3.0, "is_clip_min": 1 / 3},
                 sequence_is_weights=weights)
    c = f.details["correction"]
    assert c["aggregation"] == aggregation and c["cut_if_sum"] == cut_by_sum and c["cut_if_mean"] == 0
    length_bias = [p for p in f.details["patterns"] if "aggregated by sum" in p]
    assert bool(length_bias) == (aggregation == "sum")


# -- the cause, with the sampler's settings in effect ------------------------------------------------

def test_one_signed_shift_is_not_truncation_when_truncation_is_off(tmp_path):
    # trainer below the sampler on every token, but the engine recorded top_p = 1, top_k = 0, min_p = 0:
    # nothing was truncated, so the truncation hypothesis is ruled out and no cause is claimed from one step
    g = torch.Generator().manual_seed(8)
    trainer = -torch.rand(B, T, generator=g) * 2 - 0.1
    sampler = trainer + 0.05 + 0.2 * torch.rand(B, T, generator=g)  # one-signed, not constant
    off = {"sampler_top_p": 1.0, "sampler_top_k": 0, "sampler_min_p": 0.0, "sampler_dtype": "bfloat16"}
    f = mismatch(tmp_path, "off", trainer, sampler, hyper=off)
    assert not any("truncated" in p for p in f.details["patterns"])
    assert "No known cause explains it" in f.message and "top_p = 1, top_k = 0, min_p = 0" in f.message
    assert "Likely fix" not in f.message
    # the same numbers with top_k = 5 in effect: truncation, and only truncation
    f = mismatch(tmp_path, "on", trainer, sampler, hyper={**off, "sampler_top_k": 5})
    assert f.severity == ERROR and len(f.details["patterns"]) == 1
    assert f.message.startswith("Cause: trainer logprobs are below the sampler's on 100% of tokens")
    assert "(top_k = 5)" in f.message


def apply_repetition_penalty(logits: torch.Tensor, context: list[list[int]], penalty: float) -> torch.Tensor:
    """vLLM's rule (vllm/model_executor/layers/utils.py apply_penalties), by hand: a token already in the
    context has its logit divided by ``penalty`` when positive, multiplied when negative."""
    out = logits.clone()
    for token in set(context):
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    return out


def test_repetition_penalty_is_named_from_the_repeated_tokens(tmp_path):
    # rows of 12 tokens sampled from softmax(penalised logits / τ), the prompt ids 0..5 in context
    prompt = torch.arange(6).repeat(B, 1)  # (B, L)
    logits = make_logits(9, scale=1.0)
    g = torch.Generator().manual_seed(9)
    ids = torch.zeros(B, T, dtype=torch.int64)
    trainer, sampler = torch.zeros(B, T), torch.zeros(B, T)
    for b in range(B):
        context = prompt[b].tolist()
        for t in range(T):
            processed = torch.log_softmax(apply_repetition_penalty(logits[b, t], context, 1.3) / TAU, -1)
            token = int(torch.multinomial(processed.exp(), 1, generator=g))
            ids[b, t] = token
            sampler[b, t] = processed[token]
            trainer[b, t] = torch.log_softmax(logits[b, t] / TAU, -1)[token]
            context.append(token)
    hyper = {"sampler_repetition_penalty": 1.3, "sampler_presence_penalty": 0.0, "sampler_frequency_penalty": 0.0}
    f = mismatch(tmp_path, "rep", trainer, sampler, hyper=hyper, completion_ids=ids, prompt_ids=prompt,
                 prompt_mask=torch.ones(B, 6, dtype=torch.bool))
    assert f.severity == ERROR and len(f.details["patterns"]) == 1
    assert f.message.startswith("Cause: the mismatch sits on tokens repeated from the context")
    assert "(repetition_penalty = 1.3)" in f.message
    # the share of tokens seen earlier in their row, counted here with a set per row
    seen = [[ids[b, t].item() in set(prompt[b].tolist()) | set(ids[b, :t].tolist()) for t in range(T)] for b in range(B)]
    assert f"the {sum(map(sum, seen)) / (B * T):.0%} of kept tokens seen earlier" in f.message
    # no penalty in effect: the same data is not blamed on a penalty
    f = mismatch(tmp_path, "norep", trainer, sampler, hyper={**hyper, "sampler_repetition_penalty": 1.0},
                 completion_ids=ids, prompt_ids=prompt, prompt_mask=torch.ones(B, 6, dtype=torch.bool))
    assert not any("repeated from the context" in p for p in f.details["patterns"])


@pytest.mark.parametrize("seed", range(3))
def test_seen_in_context_matches_a_loop(seed):
    from tracer.checks.sampler_patterns import seen_in_context

    g = torch.Generator().manual_seed(seed)
    prompt_ids, completion_ids = torch.randint(0, 6, (5, 4), generator=g), torch.randint(0, 6, (5, 7), generator=g)
    prompt_mask = torch.rand(5, 4, generator=g) > 0.3
    expected = [[completion_ids[b, t].item() in set(prompt_ids[b][prompt_mask[b]].tolist())
                 | set(completion_ids[b, :t].tolist()) for t in range(7)] for b in range(5)]
    assert seen_in_context(prompt_ids, prompt_mask, completion_ids).tolist() == expected


# -- recorded runs of TRL GRPO with the vLLM CPU engine (tests/data/vllm_bugs/, engine_run.py --bug) ---------

VLLM_RUNS = Path(__file__).resolve().parents[1] / "data" / "vllm_bugs"


def recorded(run: str):
    from tracer import Trace

    trace = Trace(VLLM_RUNS / run)
    steps = sorted(trace.steps(), key=lambda k: k.step)
    findings = {f.step: f for f in found(run_checks(VLLM_RUNS / run), "sampler.mismatch")}
    return trace, steps, findings


def mean_abs_gap(trace, key) -> float:
    data = trace.load_step(key)
    keep = data["completion_mask"].bool()
    return float((data["old_logprobs"].double() - data["sampler_logprobs"].double())[keep].abs().mean())


def test_recorded_stale_weight_sync_is_a_stale_policy():
    trace, steps, findings = recorded("stale-sync")
    meta = trace.metadata(steps[0])
    assert (meta["sampler_top_p"], meta["sampler_top_k"], meta["sampler_min_p"]) == (1.0, 0, 0.0)  # truncation off
    first = mean_abs_gap(trace, steps[0])
    assert findings[0].severity == INFO and findings[0].details["patterns"] == []  # same initial weights
    for key in steps[1:]:
        f = findings[key.step]
        assert f.severity == ERROR and len(f.details["patterns"]) == 1
        assert f.message.startswith(f"Cause: mean |old - sampler| {mean_abs_gap(trace, key):.4f} nats at step "
                                    f"{key.step} against {first:.4f} at step 0")
        assert "the engine samples with a stale policy" in f.message
        assert "truncated distribution" not in f.message


def test_recorded_repetition_penalty_is_named():
    trace, steps, findings = recorded("repetition-penalty")
    assert trace.metadata(steps[0])["sampler_repetition_penalty"] == pytest.approx(1.3)
    for key in steps:
        f = findings[key.step]
        assert f.severity == ERROR and len(f.details["patterns"]) == 1
        assert f.message.startswith("Cause: the mismatch sits on tokens repeated from the context")
        assert "(repetition_penalty = 1.3)" in f.message


def test_recorded_top_k_is_truncation_only():
    trace, steps, findings = recorded("top-k")
    for key in steps:
        f = findings[key.step]
        assert f.severity == ERROR and len(f.details["patterns"]) == 1  # no temperature finding beside it
        assert f.message.startswith("Cause: trainer logprobs are below the sampler's on")
        assert "(top_k = 5)" in f.message and "temperature applied" not in f.message


# Measured on these recorded healthy runs (BENCHMARKS.md "Sampler noise floor"): mean |old - sampler| per
# step 0.0055, 0.0043, 0.0070 nats with the engine in bfloat16 (vLLM's "auto" for this float32 model),
# 5.0e-7, 4.8e-7, 6.1e-7 with dtype="float32"; the bounds below are those figures with a factor 2 of room.
@pytest.mark.parametrize("run, low, high", [("healthy-bf16", 0.002, 0.014), ("healthy-fp32", 0.0, 1.2e-6)])
def test_recorded_healthy_engine_noise_by_dtype(run, low, high):
    from tracer.checks.sampler_patterns import noise_floor

    trace, steps, findings = recorded(run)
    dtype = trace.metadata(steps[0])["sampler_dtype"]
    assert dtype == run.removeprefix("healthy-").replace("bf16", "bfloat16").replace("fp32", "float32")
    for key in steps:
        gap = mean_abs_gap(trace, key)
        assert low <= gap <= high
        f = findings[key.step]
        assert f.severity == INFO and f.details["patterns"] == [] and f.details["noise_floor"] > gap
        assert f"Within the noise of a {dtype} engine" in f.message
    assert noise_floor("bfloat16") > 0.014  # the floor sits above the bf16 engine's noise
