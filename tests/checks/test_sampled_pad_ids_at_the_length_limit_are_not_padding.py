"""`masks.padding` tells pad ids a completion *sampled* (a row that ran to the generation length limit
without EOS, whose last tokens happen to be the pad id) from padding *appended after the row ended*.

A new user's healthy run got an error for a row that ran to `max_new_tokens` and whose last two sampled
tokens were the pad id (and an info for one). The rollout here is a real `model.generate` of the tiny
local model, in a hand-written loop that builds its mask the way MiniMind's train_grpo.py does (keep up
to and including the first EOS, the whole row without one) and records what it ran with
(`max_new_tokens`, the tokenizer's pad and EOS ids) through the trace writer. A logits processor stands
in for a policy that puts its mass on the pad id at the end of some rows (an untrained or collapsing
policy does it on its own, by chance): rows 0, 1, 2 run to the limit with 1, 2 and 5 trailing sampled
pad ids, row 3 ends with EOS at token 2 and is padded after it, row 4 runs to the limit with no pad id.
The real bugs (a mask that keeps the padding after EOS, built from the attention mask or as
`ids != pad` shifted by one; a row padded past the limit) still fail at the right token. A TRL
GRPOTrainer run whose sampler emits nothing but the pad id passes too."""

from __future__ import annotations

import pytest
import torch

import tracer
from tracer.checks import ERROR, INFO, run_checks

MAX_NEW_TOKENS = 6
EOS_AT = 2  # row 3 samples EOS at this completion position
TRAILING_PADS = {0: 1, 1: 2, 2: MAX_NEW_TOKENS - 1}  # row -> pad ids it samples at the end (no EOS)


def _forced_tail(prompt_width: int, pad: int, eos: int):
    """A ``LogitsProcessor``: rows 0-2 sample the pad id on their last ``TRAILING_PADS[row]`` steps and never
    EOS; row 3 samples EOS at step ``EOS_AT``; elsewhere neither pad nor EOS (so the counts below are exact)."""
    from transformers import LogitsProcessor

    class ForcedTail(LogitsProcessor):
        def __call__(self, input_ids, scores):
            j = input_ids.shape[1] - prompt_width  # completion position being sampled
            scores = scores.clone()
            scores[:, [pad, eos]] = -float("inf")
            for row, k in TRAILING_PADS.items():
                if j >= MAX_NEW_TOKENS - k:
                    scores[row] = -float("inf")
                    scores[row, pad] = 0.0
            if j == EOS_AT:
                scores[3] = -float("inf")
                scores[3, eos] = 0.0
            return scores

    return ForcedTail()


@pytest.fixture(scope="module")
def rollout(model_dir):
    """``(tokenizer, completion_ids [5, 6], healthy completion_mask [5, 6])`` from one ``generate`` call."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(0)
    enc = tokenizer(["2 + 3 ="] * 5, return_tensors="pt", padding=True, padding_side="left")
    L = enc["input_ids"].shape[1]
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, top_k=0, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=pad,
                             eos_token_id=eos, logits_processor=LogitsProcessorList([_forced_tail(L, pad, eos)]))
    completion_ids = out[:, L:]  # (B, T)
    is_eos = completion_ids == eos
    completion_mask = (is_eos.int().cumsum(dim=1) - is_eos.int()) == 0  # MiniMind: up to the first EOS, all without
    return tokenizer, completion_ids, completion_mask


def _check(root, tokenizer, ids, mask, config=None, **hyper):
    with tracer.Tracer(root, algorithm="grpo", tokenizer=tokenizer, config=config, hyperparameters=hyper) as writer:
        writer.record(0, {"completion_ids": ids, "completion_mask": mask})
    return [f for f in run_checks(root, select=["masks"]) if f.check.startswith("masks.") and f.severity != "skipped"]


def test_the_rollout_holds_the_rows_of_the_report(rollout):
    tokenizer, ids, mask = rollout
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert pad != eos and ids.shape == (5, MAX_NEW_TOKENS)  # T = the limit: rows ran to it
    for row, k in TRAILING_PADS.items():
        assert ids[row, -k:].tolist() == [pad] * k and ids[row, -k - 1] != pad and not (ids[row] == eos).any()
    assert ids[3, EOS_AT] == eos and ids[3, EOS_AT + 1:].tolist() == [pad] * (MAX_NEW_TOKENS - EOS_AT - 1)
    assert not (ids[4] == pad).any() and not (ids[4] == eos).any()
    # the healthy mask keeps rows 0, 1, 2, 4 whole and row 3 up to its EOS
    assert mask.sum(dim=1).tolist() == [6, 6, 6, EOS_AT + 1, 6]


@pytest.mark.parametrize("limit_key", ["max_new_tokens", "max_completion_length"])
def test_sampled_pad_ids_before_the_recorded_limit_pass(tmp_path, rollout, limit_key):
    tokenizer, ids, mask = rollout
    assert _check(tmp_path / "r", tokenizer, ids, mask, **{limit_key: MAX_NEW_TOKENS}) == []


def test_the_limit_among_a_scripts_arguments_counts(tmp_path, rollout):
    tokenizer, ids, mask = rollout  # `tracer run -- train_grpo.py --max_new_tokens 6` keeps the args as config
    assert _check(tmp_path / "r", tokenizer, ids, mask, config={"max_new_tokens": MAX_NEW_TOKENS}) == []


def test_without_the_limit_the_message_names_the_missing_key(tmp_path, rollout):
    tokenizer, ids, mask = rollout
    findings = _check(tmp_path / "r", tokenizer, ids, mask)
    error, info = [f for f in findings if f.severity == ERROR], [f for f in findings if f.severity == INFO]
    # 2 and 5 trailing pad ids without EOS: padding unless the row ran to the limit, which is not recorded
    assert [(f.check, f.sequence, f.token, f.details["rows"]) for f in error] == [("masks.padding", 1, 4, [1, 2])]
    assert "Seq 1 has no EOS" in error[0].message and "max_new_tokens" in error[0].message
    assert [(f.check, f.sequence, f.token) for f in info] == [("masks.padding", 0, 5)]
    assert "No generation length limit is recorded" in info[0].message


def test_a_mask_that_keeps_the_padding_after_eos_fails_at_its_first_pad(tmp_path, rollout):
    tokenizer, ids, _ = rollout
    pad = tokenizer.pad_token_id
    attention = torch.ones_like(ids, dtype=torch.bool)  # generate's attention mask over the completion: all ones
    keep = ids != pad
    shifted = torch.cat([torch.ones(5, 1, dtype=torch.bool), keep[:, :-1]], dim=1)  # ids != pad, one to the right
    for name, mask in (("attention", attention), ("shifted", shifted)):
        findings = _check(tmp_path / name, tokenizer, ids, mask, max_new_tokens=MAX_NEW_TOKENS)
        (padding,) = [f for f in findings if f.check == "masks.padding"]
        # row 3: EOS at 2, padding from 3; the attention mask keeps 3 pad ids, the shifted one the first
        kept = MAX_NEW_TOKENS - EOS_AT - 1 if name == "attention" else 1
        assert (padding.severity, padding.sequence, padding.token) == (ERROR, 3, EOS_AT + 1)
        assert padding.details["rows"] == [3] and padding.details["tokens"] == kept
        assert f"after its EOS (id {tokenizer.eos_token_id}) at token {EOS_AT}" in padding.message


def test_a_row_padded_past_the_recorded_limit_fails_at_the_limit(tmp_path, rollout):
    tokenizer, ids, mask = rollout
    pad = tokenizer.pad_token_id
    wide = torch.nn.functional.pad(ids, (0, 2), value=pad)  # (5, 8): a loop that pads to a fixed width
    # its mask keeps rows without EOS whole: the two pad ids past the limit are padding, kept
    keep = torch.nn.functional.pad(mask, (0, 2), value=False) | ~(ids == tokenizer.eos_token_id).any(dim=1, keepdim=True)
    findings = _check(tmp_path / "r", tokenizer, wide, keep, max_new_tokens=MAX_NEW_TOKENS)
    (padding,) = [f for f in findings if f.check == "masks.padding"]
    # rows 0, 1, 2, 4 keep positions 6 and 7 (4 rows x 2); rows 0-2's sampled pad ids before 6 are not counted
    assert (padding.severity, padding.sequence, padding.token) == (ERROR, 0, MAX_NEW_TOKENS)
    assert padding.details["rows"] == [0, 1, 2, 4] and padding.details["tokens"] == 8
    assert "past the generation length limit (max_new_tokens = 6" in padding.message


def test_a_row_without_eos_that_stops_before_the_limit_keeps_padding(tmp_path, rollout):
    tokenizer, ids, mask = rollout
    # the same rows recorded under a limit of 8: T = 6 < 8, so no row ran to the limit (rows 0-2 stopped otherwise)
    findings = _check(tmp_path / "r", tokenizer, ids, mask, max_new_tokens=8)
    error, info = ([f for f in findings if f.check == "masks.padding" and f.severity == s] for s in (ERROR, INFO))
    assert [(f.sequence, f.token, f.details["rows"], f.details["tokens"]) for f in error] == [(1, 4, [1, 2], 7)]
    assert "before the generation length limit max_new_tokens = 8" in error[0].message
    assert [(f.sequence, f.token) for f in info] == [(0, 5)] and "at T = 6, before" in info[0].message


def test_trl_grpo_run_whose_sampler_emits_only_pad_ids_passes(tmp_path):
    pytest.importorskip("trl")
    from tracer import Trace
    from tracer.demo import grpo_trl
    from tracer.demo.tiny_model import build_tiny_model, torch_threads

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    with torch_threads(1):
        trainer = grpo_trl.make_trainer(model_dir, tmp_path / "scratch", steps=1, seed=0, progress=False)
        pad, eos = trainer.processing_class.pad_token_id, trainer.processing_class.eos_token_id
        # the policy puts all its mass on the pad id and never samples EOS: every row runs to the limit
        trainer.generation_config.suppress_tokens = [eos]
        trainer.generation_config.sequence_bias = [[[pad], 50.0]]
        tracer.attach(trainer, tmp_path / "trace")
        trainer.train()
    trace = Trace(tmp_path / "trace")
    key = trace.steps()[0]
    data, meta = trace.load_step(key), trace.metadata(key)
    ids, keep = data["completion_ids"], data["completion_mask"]
    # the precondition: rows of pad ids only, no EOS, T = the recorded limit, and TRL's mask keeps them whole
    assert meta["max_completion_length"] == ids.shape[1] and bool((ids == pad).all()) and bool(keep.all())
    findings = [f for f in run_checks(tmp_path / "trace", select=["masks"]) if f.severity in (ERROR, INFO)]
    assert [f for f in findings if f.check == "masks.padding"] == []
