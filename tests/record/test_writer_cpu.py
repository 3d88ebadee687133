"""The writer's CPU per step file: the cheaper paths write the same files and the same
summaries as the general ones they replace. A small step file is made in memory by safetensors'
``serialize`` and written once, with the mode ``open()`` gives; its size goes to the index without a
``stat``; the summaries' quantiles, clip fractions and zero-variance groups are computed with
fewer calls, bit for bit equal to the torch formulas the reader's fallback path uses."""

from __future__ import annotations

import json
import os
import stat
import warnings

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tracer import formulas
from tracer.format import run_index
from tracer.record import step_bytes
from tracer.format import files
from tracer.format import summary as summary_format
from tracer.formulas import summaries
from tracer.format.names import STEPS_DIR
from tracer.format.files import save_atomic
from tracer.read import Trace
from tracer.format.metadata_codec import encode_metadata
from tracer.record.writer import TraceWriter

QS = tuple(summary_format.QUANTILES.values())


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"policy_logprobs": -torch.rand(3, 5, generator=g), "ids": torch.randint(0, 9, (3, 5), generator=g),
           "mask": torch.rand(3, 5, generator=g) > 0.5, "half": torch.randn(4, generator=g).half(),
           "bf": torch.randn(2, generator=g).bfloat16(), "wide": torch.randn(2, 1, generator=g).double(),
           "scalar": torch.tensor(0.5), "small_int": torch.randint(0, 9, (7,), generator=g).to(torch.int16)}
    if seed % 2:
        out["byte"] = torch.randint(0, 255, (5,), generator=g).to(torch.uint8)
        out["b"] = torch.randn(3, generator=g)  # names that sort before others of other dtypes
    return out


def test_a_small_step_file_has_the_open_mode_and_its_size_is_returned(tmp_path):
    tensors = _tensors(1)
    described = step_bytes.describe(tensors, step_bytes.make_plan(tensors))
    assert set(described.specs) == set(tensors)  # pointer specs: safetensors' serialize makes the file
    path = tmp_path / "step.safetensors"
    stale = tmp_path / "step.safetensors.partial"  # left by a crash, with another mode
    stale.write_bytes(b"half a file")
    stale.chmod(0o600)
    meta = {"step": "1"}
    size = save_atomic(path, tensors, meta, described.specs, fsync=True)
    assert size == os.stat(path).st_size and not stale.exists()
    assert stat.S_IMODE(os.stat(path).st_mode) == files.FILE_MODE  # 0666 less the umask, as open() gives
    with safe_open(str(path), "pt") as fh:
        assert fh.metadata() == meta
        for name, want in tensors.items():
            assert torch.equal(fh.get_tensor(name), want), name
    # a large step is streamed by serialize_file (no copy): no size known, the same mode
    big = {"x": torch.arange(files.IMAGE_BYTES // 4 + 1, dtype=torch.float32)}
    assert save_atomic(tmp_path / "big.safetensors", big, meta, None, fsync=False) is None
    assert stat.S_IMODE(os.stat(tmp_path / "big.safetensors").st_mode) == files.FILE_MODE
    with safe_open(str(tmp_path / "big.safetensors"), "pt") as fh:
        assert torch.equal(fh.get_tensor("x"), big["x"])


def test_the_index_lists_each_file_size_without_a_stat(tmp_path, monkeypatch):
    stats = []
    real_stat = os.stat

    def counting_stat(path, *args, **kwargs):
        if os.fspath(path).endswith(".safetensors"):  # a step file
            stats.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(run_index.os, "stat", counting_stat)
    g = torch.Generator().manual_seed(0)
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}) as writer:
        for step in range(5):
            policy = -torch.rand(4, 3, generator=g)
            writer.record(step, {"policy_logprobs": policy, "old_logprobs": policy + 0.1, "rewards": torch.rand(4),
                                 "completion_mask": torch.ones(4, 3, dtype=torch.bool)})
    monkeypatch.undo()
    assert stats == []
    index = (tmp_path / "run" / "summary_index.rank_0.jsonl").read_text()
    lines = [json.loads(line) for line in index.splitlines()[1:]]
    assert len(lines) == 5
    for line in lines:
        assert line["size"] == os.stat(tmp_path / "run" / STEPS_DIR / line["file"]).st_size
    assert Trace(tmp_path / "run").step_summary()["summary_source"].tolist() == ["header"] * 5


def _torch_masked_row_quantiles(values, mask, qs):
    """The torch implementation masked_row_quantiles had before (one torch.sort for all rows)."""
    keep = mask & ~torch.isnan(values)
    counts = keep.sum(dim=1)
    ordered = torch.sort(values.masked_fill(~keep, float("inf")), dim=1).values
    pos = torch.tensor(qs, dtype=torch.float64) * (counts.unsqueeze(1) - 1).clamp(min=0)
    lo, hi = pos.floor().long(), pos.ceil().long()
    below, above = ordered.gather(1, lo).double(), ordered.gather(1, hi).double()
    out = torch.where(below == above, below, below + (above - below) * (pos - lo.double()))
    return out.masked_fill((counts == 0).unsqueeze(1), float("nan"))


def _f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_masked_row_quantiles_equal_the_torch_reference_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    for R, N in ((1, 1), (7, 13), (40, 64), (3, 257)):
        values = (torch.randn(R, N, generator=g) * 3).to(dtype)
        values[:, : N // 3] = torch.round(values[:, : N // 3])  # ties
        mask = torch.rand(R, N, generator=g) > 0.3
        flat, keep = values.view(-1), mask.view(-1)
        for k in torch.randint(0, R * N, (max(1, R * N // 10),), generator=g).tolist():
            flat[k] = (float("nan"), float("inf"), -float("inf"))[k % 3]
            keep[k] = bool(k % 2)
        mask[0] = False  # nothing kept
        got = formulas.masked_row_quantiles(values, mask, QS)
        want = _torch_masked_row_quantiles(values, mask, QS)
        assert got.dtype == torch.float64 and _same(got, want), (R, N)
        assert _same(formulas.masked_row_quantiles(values.float().numpy(), mask.numpy(), QS), want)


def test_clip_fractions_are_the_masked_means_of_their_indicators():
    g = torch.Generator().manual_seed(5)
    for shape, dims in (((6, 9), None), ((4, 6, 9), (1, 2)), ((5, 7), 1)):
        ratio = torch.exp(0.3 * torch.randn(*shape, generator=g))
        ratio.view(-1)[::11] = float("nan")
        mask = torch.rand(*shape, generator=g) > 0.2
        mask.view(-1)[:shape[-1]] = False
        for adv in (torch.randn(*shape, generator=g), torch.randn(*shape[:-1], 1, generator=g)):
            got = formulas.clip_fractions(ratio, adv, mask, 0.2, 0.28, dims)
            low = (ratio < 0.8) & (adv < 0)
            high = (ratio > 1.28) & (adv > 0)
            region = (ratio < 0.8) | (ratio > 1.28)
            for key, hits in (("low", low), ("high", high), ("region", region)):
                want = formulas.masked_mean(hits.float(), mask, dims)  # the definition, as a float32 mean
                assert got[key].dtype == torch.float32 and torch.equal(got[key], want), (shape, key)
            host = formulas.clip_fractions(ratio.numpy(), adv.numpy(), mask.numpy(), 0.2, 0.28, dims)  # numpy path
            for key in ("low", "high", "region"):
                assert host[key].dtype == np.float32 and torch.equal(torch.as_tensor(host[key]), got[key]), key


@pytest.mark.parametrize("loop_values", [0, formulas.ZERO_VARIANCE_LOOP_VALUES])
def test_zero_variance_groups_counted_in_a_loop_or_with_arrays_agree(monkeypatch, loop_values):
    # the submodule whose zero_variance_counts reads it (the package only re-exports the value)
    monkeypatch.setattr(formulas.advantages, "ZERO_VARIANCE_LOOP_VALUES", loop_values)
    g = torch.Generator().manual_seed(9)
    rewards = torch.round(torch.rand(6, 10, generator=g) * 2) / 2
    rewards[2, 3] = float("nan")
    ids = torch.randint(0, 4, (6, 10), generator=g) * 5 - 7  # unsorted, negative, gaps
    want_groups, want_zero = [], []
    for r, i in zip(rewards.tolist(), ids.tolist()):
        members: dict[int, list[float]] = {}
        for gid, value in zip(i, r):
            members.setdefault(gid, []).append(value)
        want_groups.append(len(members))
        want_zero.append(sum(all(v == m[0] for v in m) for m in members.values()))  # NaN == NaN is False
    groups, zero = formulas.zero_variance_groups(rewards, ids)
    assert groups.dtype == zero.dtype == torch.long
    assert groups.tolist() == want_groups and zero.tolist() == want_zero
    assert formulas.zero_variance_counts(rewards, ids) == (want_groups, want_zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_batched_summaries_equal_the_per_step_torch_formulas_bit_for_bit(dtype):
    """Each batched summary value is exactly what the formulas give one step at a time (the means
    as float32 masked means, the quantiles by masked_quantiles' torch sort, the clip fractions,
    the NaN counts), so headers written by the batch path and summaries recomputed from tensors
    by the reader agree to the last bit."""
    g = torch.Generator().manual_seed(11)
    steps = []
    for s in range(9):
        B, T = 4, 16
        policy = -3 * torch.rand(B, T, generator=g)
        old = policy + 0.05 * torch.randn(B, T, generator=g)
        mask = torch.rand(B, T, generator=g) > 0.3
        t = {"completion_mask": mask, "ratio": torch.exp(policy - old), "approx_kl_k2": 0.5 * (policy - old) ** 2,
             "old_logprobs": old, "sampler_logprobs": old + 0.01 * torch.randn(B, T, generator=g),
             "rewards": torch.round(torch.rand(B, generator=g)), "advantages": torch.randn(B, T, generator=g)}
        t = {n: v.to(dtype) if v.is_floating_point() else v for n, v in t.items()}
        mask = t["completion_mask"]
        if s % 3 == 1:
            t["ratio"][0, 2], mask[0, 2] = float("nan"), True
            t["rewards"][1] = float("inf")
        steps.append((t, {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "num_generations": 2}))
    for (t, meta), got in zip(steps, summaries.compute_summaries(steps)):
        mask = t["completion_mask"]
        token = {"ratio": t["ratio"], "approx_kl_k2": t["approx_kl_k2"],
                 "mismatch": t["old_logprobs"].float() - t["sampler_logprobs"].float(), "advantage": t["advantages"]}
        for name, values in token.items():
            assert _same(_f64(got[f"mean_{name}"]), formulas.masked_mean(values.float(), mask).double()), name
            qs = formulas.masked_quantiles(values.float(), mask, QS)
            assert _same(_f64([got[f"{name}_{q}"] for q in summary_format.QUANTILES]), qs), name
        rewards = t["rewards"].float()
        assert _same(_f64(got["mean_reward"]), formulas.masked_mean(rewards, torch.ones_like(mask[:, 0])).double())
        assert _same(_f64([got[f"reward_{q}"] for q in summary_format.QUANTILES]),
                     formulas.masked_quantiles(rewards, None, QS))
        fr = formulas.clip_fractions(t["ratio"].float(), t["advantages"].float(), mask, 0.2, 0.28)
        assert (got["clip_fraction_low"], got["clip_fraction_high"], got["clip_region"]) == (
            fr["low"].item(), fr["high"].item(), fr["region"].item())  # NaN ratios are never clipped
        bad = [~torch.isfinite(v.float()) for v in token.values()]
        assert got["nonfinite_values"] == sum(int(b.sum()) for b in bad) + int((~torch.isfinite(rewards)).sum())
        assert got["nonfinite_kept"] == sum(int((b & mask).sum()) for b in bad)
        assert got["kept_tokens"] == int(mask.sum())
        text = summary_format.header_text(got)
        assert encode_metadata({"summary": text})["summary"] == text == json.dumps(summary_format.header_value(got))


def test_an_empty_batch_has_the_masked_means_of_nothing(tmp_path):
    """A step of B = 0 sequences: every mean is formulas.masked_mean of nothing kept (0, its count
    clamped to 1), the per-sequence ones too (torch's mean of nothing would be NaN)."""
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}) as writer:
        writer.record(0, {"policy_logprobs": torch.zeros(0, 3), "old_logprobs": torch.zeros(0, 3),
                          "rewards": torch.zeros(0), "advantages": torch.zeros(0),
                          "completion_mask": torch.ones(0, 3, dtype=torch.bool)})
    nothing = formulas.masked_mean(torch.zeros(0), torch.ones(0, dtype=torch.bool)).item()
    assert nothing == 0.0
    row = Trace(tmp_path / "run").step_summary().iloc[0]
    assert row["summary_source"] == "header"
    assert (row["mean_reward"], row["mean_advantage"], row["mean_ratio"]) == (nothing, nothing, nothing)


def test_non_finite_values_summarised_without_a_numpy_warning(tmp_path):
    """inf - inf (a mismatch of two infinite logprobs) is data, counted by the summary, as torch
    computed it silently: no RuntimeWarning from the writer thread, so a run under ``-W error``
    (a test suite's filterwarnings) keeps its summaries in the headers."""
    inf = float("inf")
    logprobs = torch.tensor([[-1.0, -inf], [-2.0, -3.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}) as writer:
            writer.record(0, {"policy_logprobs": logprobs, "old_logprobs": logprobs, "sampler_logprobs": logprobs,
                              "rewards": torch.tensor([1.0, 0.0]),
                              "completion_mask": torch.ones(2, 2, dtype=torch.bool)})
    row = Trace(tmp_path / "run").step_summary().iloc[0]
    assert row["summary_source"] == "header"
    assert np.isnan(row["mean_mismatch"]) and row["nonfinite_kept"] >= 1


def test_a_small_step_file_is_whole_after_short_writes_and_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """``write_new`` writes with plain ``os`` calls (no ``fstat`` of ``open()``): a write that takes
    fewer bytes than asked (a signal, a nearly full disk) is continued, and a failing one closes the
    file it opened."""
    data = bytes(range(256)) * 9
    real_write, calls = os.write, []

    def short_write(fd, view):
        calls.append(len(view))
        return real_write(fd, bytes(view[:100]))  # at most 100 bytes a call

    monkeypatch.setattr(files.os, "write", short_write)
    files.write_new(str(tmp_path / "a.bin"), data, fsync=False)
    assert (tmp_path / "a.bin").read_bytes() == data
    assert len(calls) == -(-len(data) // 100)  # 24 calls for 2304 bytes
    opened = set(os.listdir("/proc/self/fd"))

    def failing_write(fd, view):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        files.write_new(str(tmp_path / "b.bin"), data, fsync=False)
    assert set(os.listdir("/proc/self/fd")) == opened  # its descriptor closed
