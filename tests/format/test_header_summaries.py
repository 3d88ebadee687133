"""Per-step summaries in the step file's header: written by the writer thread, equal to
values recomputed here independently (numpy, by hand), and read without touching tensor data."""

from __future__ import annotations

import json
import shutil
import struct
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tracer.format.summary import SUMMARY_VERSION
from tracer.read.trace_info import trace_info
from tracer.read import Trace
from tracer.record.writer import TraceWriter

EPS_LOW, EPS_HIGH = 0.2, 0.28
QS = {"p10": 0.1, "p50": 0.5, "p90": 0.9, "max": 1.0}


def _grpo_step(seed: int, B: int = 6, T: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    policy = -3 * torch.rand(B, T, generator=g)
    old = policy + 0.3 * torch.randn(B, T, generator=g)
    ref = policy + 0.2 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False  # a sequence with no kept token
    ratio = torch.exp(policy - old)
    ratio[1, 2] = float("nan")  # a NaN ...
    mask[1, 2] = True  # ... at a kept position (the mean is NaN, the quantiles leave it out)
    ratio[2, 3] = float("inf")
    mask[2, 3] = False  # an Inf at a masked position: counted in nonfinite_values only
    return {
        "completion_ids": torch.randint(0, 50, (B, T), generator=g),
        "completion_mask": mask,
        "policy_logprobs": policy,
        "old_logprobs": old,
        "sampler_logprobs": old + 0.05 * torch.randn(B, T, generator=g),
        "ref_logprobs": ref,
        "ratio": ratio,
        "ref_kl_k3": torch.exp(ref - policy) - (ref - policy) - 1,
        "approx_kl_k2": 0.5 * (policy - old) ** 2,
        "rewards": torch.rand(B, generator=g),
        "advantages": torch.randn(B, generator=g),
    }


def _write(path, steps, algorithm="grpo", **hyper):
    with TraceWriter(path, algorithm, hyperparameters=hyper) as writer:
        for step, tensors in enumerate(steps):
            writer.record(step, tensors)
    return Trace(path)


def _expected(t: dict[str, torch.Tensor], eps=(EPS_LOW, EPS_HIGH)) -> dict[str, float]:
    """The summary recomputed with numpy from the definitions (SPEC: masked mean over kept tokens)."""
    mask = t["completion_mask"].numpy()
    out: dict[str, float] = {"kept_tokens": int(mask.sum())}
    token = {"ratio": t["ratio"], "ref_kl_k3": t["ref_kl_k3"], "approx_kl_k2": t["approx_kl_k2"],
             "mismatch": t["old_logprobs"] - t["sampler_logprobs"]}
    seen = []
    for name, value in token.items():
        v = value.double().numpy()
        kept = v[mask]
        out[f"mean_{name}"] = kept.sum() / max(mask.sum(), 1)
        for q, level in QS.items():
            out[f"{name}_{q}"] = np.nanquantile(kept, level)
        seen.append((v, mask))
    lengths = {"length": torch.from_numpy(mask.sum(axis=1))}  # kept completion tokens per sequence
    for name, field in (("reward", "rewards"), ("advantage", "advantages"), ("length", "length")):
        v = (lengths if field == "length" else t)[field].double().numpy()
        out[f"mean_{name}"] = v.mean()
        for q, level in QS.items():
            out[f"{name}_{q}"] = np.nanquantile(v, level)
        seen.append((v, None))
    if eps is not None:
        r, a = t["ratio"].double().numpy(), t["advantages"].double().numpy()[:, None]
        low = ((r < 1 - eps[0]) & (a < 0))[mask].sum() / mask.sum()
        high = ((r > 1 + eps[1]) & (a > 0))[mask].sum() / mask.sum()
        out.update(clip_fraction_low=low, clip_fraction_high=high, clip_fraction=low + high,
                   clip_region=((r < 1 - eps[0]) | (r > 1 + eps[1]))[mask].sum() / mask.sum())
    out["nonfinite_values"] = sum(int((~np.isfinite(v)).sum()) for v, _ in seen)
    out["nonfinite_kept"] = sum(int((~np.isfinite(v) & m).sum()) for v, m in seen if m is not None)
    return out


def _assert_matches(row, expected):
    for key, value in expected.items():
        got = row[key]
        if np.isnan(value):
            assert np.isnan(got), key
        else:
            assert got == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_header_summary_equals_an_independent_recomputation(tmp_path):
    steps = [_grpo_step(seed) for seed in range(3)]
    trace = _write(tmp_path / "run", steps, clip_epsilon_low=EPS_LOW, clip_epsilon_high=EPS_HIGH)
    summary = trace.step_summary()
    assert summary["summary_source"].tolist() == ["header"] * 3
    for step, tensors in enumerate(steps):
        stored = trace.metadata(trace.step_key(step))["summary"]
        assert stored["version"] == 2
        expected = _expected(tensors)
        assert np.isnan(expected["mean_ratio"])  # the kept NaN reaches the mean...
        assert np.isfinite(expected["ratio_p50"])  # ... not the quantiles
        assert expected["nonfinite_values"] == 2 and expected["nonfinite_kept"] == 1
        _assert_matches(summary.iloc[step], expected)
        _assert_matches(stored, expected)


def test_ppo_token_advantages_and_no_clip_epsilons(tmp_path):
    t = _grpo_step(7)
    t["advantages"] = torch.randn(t["ratio"].shape)
    t["values"] = torch.randn(t["ratio"].shape)
    t["returns"] = t["advantages"] + t["values"]
    row = _write(tmp_path / "ppo", [t], algorithm="ppo").step_summary().iloc[0]
    mask = t["completion_mask"].numpy()
    adv = t["advantages"].double().numpy()
    assert row["mean_advantage"] == pytest.approx(adv[mask].sum() / mask.sum(), rel=1e-5)
    assert row["advantage_p90"] == pytest.approx(np.quantile(adv[mask], 0.9), rel=1e-5)
    assert "clip_fraction" not in row.index or np.isnan(row["clip_fraction"])  # epsilons unknown


def _data_offset(path) -> int:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    return 8 + n


def _clobber_tensor_bytes(path) -> None:
    """Overwrite every tensor byte of a step file with 0xFF (floats become NaN, masks garbage);
    the header stays as it was."""
    start, size = _data_offset(path), path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(b"\xff" * (size - start))


def test_step_summary_and_info_read_no_tensor_when_headers_hold_summaries(tmp_path):
    steps = [_grpo_step(seed) for seed in range(4)]
    trace = _write(tmp_path / "run", steps, clip_epsilon_low=EPS_LOW, clip_epsilon_high=EPS_HIGH)
    before = trace.step_summary()
    copy = tmp_path / "clobbered"
    shutil.copytree(tmp_path / "run", copy)
    for path in sorted((copy / "steps").glob("*.safetensors")):
        _clobber_tensor_bytes(path)
    clobbered = Trace(copy)
    with pytest.raises(Exception):  # the tensors really are unusable: any tensor read would show it
        torch.testing.assert_close(clobbered.load_step(clobbered.step_key(0))["ratio"], steps[0]["ratio"],
                                   equal_nan=True)
    after = clobbered.step_summary()
    assert after.drop(columns="summary_source").equals(before.drop(columns="summary_source"))
    info = trace_info(copy)
    assert info["overview"]["from_headers"] == 4 and info["overview"]["from_tensors"] == 0
    assert info["overview"]["columns"]["kept_tokens"]["first"] == int(steps[0]["completion_mask"].sum())
    assert "summary" not in info["first_step_metadata"]


def _strip_summary(path, replacement=None) -> None:
    """Rewrite a step file without its summary (an older trace), or with ``replacement`` instead."""
    from safetensors import safe_open
    with safe_open(str(path), "pt") as fh:
        meta = dict(fh.metadata())
    tensors = load_file(str(path))
    meta.pop("summary")
    if replacement is not None:
        meta["summary"] = json.dumps(replacement)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("replacement", [None, {"version": SUMMARY_VERSION, "step": 99, "mean_ratio": 5.0},
                                         {"version": SUMMARY_VERSION + 1, "mean_ratio": 5.0},
                                         {"version": SUMMARY_VERSION, "mean_ratio": "x"},
                                         [1, 2]])
def test_files_without_a_usable_summary_are_summarised_from_tensors(tmp_path, replacement):
    steps = [_grpo_step(seed) for seed in range(2)]
    trace = _write(tmp_path / "run", steps, clip_epsilon_low=EPS_LOW, clip_epsilon_high=EPS_HIGH)
    _strip_summary(trace.step_key(1).path, replacement)
    summary = trace.step_summary()
    assert summary["summary_source"].tolist() == ["header", "tensors"]
    assert summary["step"].tolist() == [0, 1]  # a hostile "step" key never overrides the coordinates
    _assert_matches(summary.iloc[1], _expected(steps[1]))


def test_a_step_without_completion_mask_has_only_what_its_fields_allow(tmp_path):
    g = torch.Generator().manual_seed(3)
    t = {"chosen_ids": torch.randint(0, 9, (2, 4), generator=g), "rejected_ids": torch.randint(0, 9, (2, 4), generator=g),
         "chosen_mask": torch.ones(2, 4, dtype=torch.bool), "rejected_mask": torch.ones(2, 4, dtype=torch.bool),
         "chosen_policy_logprobs": torch.randn(2, 4, generator=g),
         "rejected_policy_logprobs": torch.randn(2, 4, generator=g)}
    before = time.time()
    trace = _write(tmp_path / "dpo", [t], algorithm="dpo")
    summary = trace.metadata(trace.step_key(0))["summary"]
    assert before <= summary.pop("wall_time") <= time.time()  # recorded at record(), not computed
    assert summary == {"version": 2, "nonfinite_values": 0, "nonfinite_kept": 0}


def test_masked_quantiles_match_numpy_and_handle_empty_and_inf():
    from tracer.formulas import masked_quantiles
    g = torch.Generator().manual_seed(11)
    values, mask = torch.randn(5, 7, generator=g), torch.rand(5, 7, generator=g) > 0.4
    values[0, 0], mask[0, 0] = float("nan"), True
    qs = (0.0, 0.1, 0.5, 0.9, 1.0)
    kept = values.double().numpy()[mask.numpy()]
    assert masked_quantiles(values, mask, qs).tolist() == pytest.approx(np.nanquantile(kept, qs).tolist(), rel=1e-6)
    assert np.isnan(masked_quantiles(values, torch.zeros_like(mask), qs).numpy()).all()
    inf = torch.tensor([1.0, float("inf"), float("inf")])
    assert masked_quantiles(inf, None, (0.0, 0.9, 1.0)).tolist() == [1.0, float("inf"), float("inf")]


def test_info_json_carries_the_overview_of_the_non_nan_values(tmp_path, capsys):
    from tracer.cli import main
    steps = [_grpo_step(seed) for seed in range(3)]
    clean = steps[2]["completion_mask"].clone()
    clean[1, 2] = False  # step 2: its NaN ratio is masked, so its mean ratio is a number
    steps[2]["completion_mask"] = clean
    _write(tmp_path / "run", steps, clip_epsilon_low=EPS_LOW, clip_epsilon_high=EPS_HIGH)
    assert main(["info", "--json", str(tmp_path / "run")]) == 0
    overview = json.loads(capsys.readouterr().out)["overview"]
    assert overview["from_headers"] == 3 and overview["from_tensors"] == 0
    mask = clean.numpy()
    expected_ratio = steps[2]["ratio"].double().numpy()[mask].sum() / mask.sum()
    assert overview["columns"]["mean_ratio"] == pytest.approx(  # steps 0 and 1 are NaN: left out
        {"first": expected_ratio, "last": expected_ratio, "min": expected_ratio, "max": expected_ratio}, rel=1e-5)
    rewards = [float(t["rewards"].double().mean()) for t in steps]
    assert overview["columns"]["mean_reward"] == pytest.approx(
        {"first": rewards[0], "last": rewards[2], "min": min(rewards), "max": max(rewards)}, rel=1e-6)
