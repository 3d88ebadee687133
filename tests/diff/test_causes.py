"""The headline names the upstream cause (SPEC.md section 10's data-flow order), and token-aligned
fields are compared only where both traces sampled the same tokens. Real runs of the hand-written
GRPO loop (a reward change: the bundled pair; a seed change: two runs in tmp_path) and hand-built
traces whose differences are known."""

import pytest
import torch

from tracer import Trace, diff
from tracer.cli import main
from tracer.demo.diff_pair import BASELINE, VARIANT
from tracer.demo.runner import run_demo
from tracer.demo.tiny_model import build_tiny_model
from tracer.diff.causes import round_up
from tracer.format.schema import DATA_FLOW, FIELDS, flow_rank

from tests.fixtures.diff_traces import step_tensors, write_trace
from tests.fixtures.paths import SAMPLES


TOKEN_ALIGNED = [n for n, s in FIELDS.items() if s.dims == ("B", "T") and not n.endswith(("_ids", "_mask"))]


def test_data_flow_order_covers_every_field_once():
    flat = [n for stage in DATA_FLOW for n in stage]
    assert sorted(flat) == sorted(FIELDS) and len(flat) == len(set(flat))
    assert flow_rank("prompt_ids") < flow_rank("completion_ids") < flow_rank("rewards") < flow_rank("advantages")
    assert flow_rank("advantages") < flow_rank("old_logprobs") < flow_rank("policy_logprobs") < flow_rank("ratio")
    assert flow_rank("ratio") < flow_rank("per_token_loss") < flow_rank("loss") < flow_rank("my_custom_field")


def test_a_reward_change_is_headlined_by_rewards(capsys):
    # the bundled pair: the same GRPO loop, the scorer clipped at 2 instead of 3 (tracer/demo/diff_pair.py)
    a, b = SAMPLES / BASELINE, SAMPLES / VARIANT
    trace_a = Trace(a)
    step0 = trace_a.load_step(trace_a.steps()[0])
    scorer = step0["reward_components"][:, 2]  # (B,), clipped to [-3, 3] in a
    changed = (scorer > 2).nonzero().squeeze(1).tolist()  # the rows whose reward the new clip lowers
    assert changed, "the bundled pair must change at least one step-0 reward"
    seq = changed[0]
    a_value = float(step0["rewards"][seq])
    b_value = a_value - (float(scorer[seq]) - 2.0)  # clipped at 2 instead

    report = diff(a, b)
    assert report.cause.name == "rewards"
    loc = report.cause.first
    assert (loc.step, loc.sequence) == ((0, 0, 0, 0), seq)
    assert (loc.a, loc.b) == (pytest.approx(a_value), pytest.approx(b_value))
    # the same completions at step 0: nothing upstream of the rewards differs there
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        f = report.fields[name]
        assert f.first is None or f.first.step > (0, 0, 0, 0), name
    downstream = [f.name for f in report.downstream]
    assert "reward_components" in downstream and "advantages" in downstream and "per_token_loss" in downstream
    assert downstream == sorted(downstream, key=flow_rank)

    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"tracer diff: DIFFERENT: rewards diverges first, at step 0, seq {seq} ({loc.values()})"
    assert lines[5].startswith("cause: rewards (reward stage of the data flow): ")
    assert "follows from rewards" in out and f"--atol rewards={round_up(report.fields['rewards'].max_abs_diff):g}" in out
    assert len(lines) <= 30  # a screen


def test_round_up_gives_a_tolerance_that_passes():
    assert [round_up(x) for x in (0.5, 0.0873, 1.2e-5, 0.0)] == [0.5, 0.088, 1.2e-5, 0.0]
    assert all(round_up(x) >= x for x in (0.1 + 0.2, 7.3, 1 / 3, 9.99e-3))


@pytest.fixture(scope="module")
def seed_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    model_dir = build_tiny_model(root / "model", seed=0)
    return tuple(run_demo("grpo", root / f"seed{s}", steps=1, seed=s, progress=False, model_dir=model_dir)
                 for s in (0, 1))


def expected_alignment(trace_a: Trace, trace_b: Trace):
    """Independently: per step pair, positions both keep, with different tokens, and with the same
    prompt and the same tokens up to and including the position (row by row, in Python)."""
    kept = differ = same_context = 0
    for key_a, key_b in zip(trace_a.steps(), trace_b.steps()):
        da, db = trace_a.load_step(key_a), trace_b.load_step(key_b)
        for s in range(da["completion_ids"].shape[0]):
            # prompts are left-padded (widths may differ): the same prompt = the same kept ids
            prompt_same = (da["prompt_ids"][s][da["prompt_mask"][s]].tolist()
                           == db["prompt_ids"][s][db["prompt_mask"][s]].tolist())
            ids_a, ids_b = da["completion_ids"][s].tolist(), db["completion_ids"][s].tolist()
            keep_a, keep_b = da["completion_mask"][s].tolist(), db["completion_mask"][s].tolist()
            prefix_same = prompt_same
            for t in range(min(len(ids_a), len(ids_b))):  # past one side's width: not kept there
                prefix_same = prefix_same and ids_a[t] == ids_b[t]
                if keep_a[t] and keep_b[t]:
                    kept += 1
                    differ += ids_a[t] != ids_b[t]
                    same_context += prefix_same
    return kept, differ, same_context


def test_a_seed_change_is_headlined_by_the_prompts_and_compares_no_logprobs_of_other_tokens(seed_pair, capsys):
    a, b = seed_pair
    report = diff(a, b)
    assert report.cause.name in ("prompt_ids", "completion_ids")
    assert report.cause.first.step == (0, 0, 0, 0)
    kept, differ, same_context = expected_alignment(Trace(a), Trace(b))
    tokens = report.token_alignment["completion_ids"]
    assert (tokens.kept_both, tokens.differing_tokens, tokens.not_compared) == (kept, differ, kept - same_context)
    assert differ > 0
    for name in TOKEN_ALIGNED:
        if name in report.fields:
            assert report.fields[name].compared == same_context, name
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"tracer diff: DIFFERENT: {report.cause.name} diverges first, at step 0")
    assert f"completion_ids: different tokens at {differ} of {kept} positions both traces keep (first at step 0" in out


def test_logprobs_are_compared_only_where_the_tokens_so_far_agree(tmp_path):
    # step 1, seq 1: b samples ' dog' (7) instead of ' cat'... at tok 2 (a has ' sat' = 3); its later
    # logprobs are shifted by 2 nats (other context), and seq 0's tok 1 logprob by 0.5 (same tokens)
    def edit(step, t):
        if step == 1:
            t["completion_ids"][1, 2] = 2  # a: [1, 7, 3, 4, 1, 5] -> b: [1, 7, 2, 4, 1, 5]
            t["policy_logprobs"][1, 2:] -= 2.0
            t["policy_logprobs"][0, 1] += 0.5

    a, b = write_trace(tmp_path / "a"), write_trace(tmp_path / "b", edit=edit)
    report = diff(a, b)
    assert report.cause.name == "completion_ids"
    assert (report.cause.first.step, report.cause.first.index) == ((1, 0, 0, 0), (1, 2))
    tokens = report.token_alignment["completion_ids"]
    # only step 1 is read (steps 0 and 2: identical, verified checksums); it keeps 13 positions, and
    # seq 1 keeps all 6: tok 2..5 have another context
    assert report.identical_by_checksum == 2
    assert (tokens.kept_both, tokens.differing_tokens, tokens.not_compared) == (13, 1, 4)
    assert tokens.first.index == (1, 2) and (tokens.first.token_text, tokens.first.token_text_b) == (" sat", " cat")
    policy = report.fields["policy_logprobs"]
    assert policy.compared == 13 - 4
    assert policy.differing == 1 and policy.first.index == (0, 1) and policy.max_abs_diff == 0.5
    assert [f.name for f in report.downstream] == ["policy_logprobs"]
    assert "token-aligned fields are compared only at the 9 positions" in report.format()


def test_the_earliest_step_wins_over_upstream_fields_of_later_steps(tmp_path):
    # step 0: policy logprobs differ; step 2: rewards differ. Step 0 happened first: its cause is the headline
    def edit(step, t):
        if step == 0:
            t["policy_logprobs"][0, 0] += 0.25
        if step == 2:
            t["rewards"][2] = 9.0

    report = diff(write_trace(tmp_path / "a"), write_trace(tmp_path / "b", edit=edit))
    assert report.cause.name == "policy_logprobs" and report.cause.first.step == (0, 0, 0, 0)
    assert [f.name for f in report.downstream] == ["rewards"]
    # at one step, the upstream field wins whatever the sizes: rewards (+0.01) before advantages (+5)
    def same_step(step, t):
        t["rewards"][0] += 0.01
        t["advantages"][1] += 5.0

    report = diff(write_trace(tmp_path / "c"), write_trace(tmp_path / "d", edit=same_step))
    assert report.cause.name == "rewards" and [f.name for f in report.downstream] == ["advantages"]
    assert report.to_dict()["cause"] == "rewards" and report.to_dict()["downstream"] == ["advantages"]


def test_the_token_view_compares_only_where_the_tokens_so_far_agree(tmp_path):
    from tracer.diff import token_diff_table

    def edit(step, t):
        if step == 1:
            t["completion_ids"][1, 2] = 2  # seq 1: ' sat' -> ' cat' at tok 2
            t["policy_logprobs"][1, 3] -= 2.0  # after it: another context, not compared

    a, b = write_trace(tmp_path / "a"), write_trace(tmp_path / "b", edit=edit)
    table = token_diff_table(a, b, step=1, sequence=1).set_index("position")
    assert table["compared"].tolist() == [True, True, False, False, False, False]  # seq 1 keeps all 6
    assert table["id_differs"].tolist() == [False, False, True, False, False, False]
    assert not table["policy_logprobs_differs"].any()
    same = token_diff_table(a, b, step=1, sequence=0)
    assert same["compared"].tolist() == same["kept_a"].tolist()  # seq 0: the same tokens, kept ones compared


def test_the_documented_command_writes_the_pair(tmp_path):
    # `python -m tracer.demo.diff_pair ROOT` (make sample-diff-pair), one step here
    from tracer.demo.diff_pair import main as write_pair_main

    assert write_pair_main([str(tmp_path), "--steps", "1"]) == 0
    variant = Trace(tmp_path / VARIANT)
    assert variant.manifest["config"]["diff_baseline"] == f"../{BASELINE}"
    assert variant.manifest["config"]["scorer_clip"] == 2.0
    assert Trace(tmp_path / BASELINE).manifest["config"]["scorer_clip"] == 3.0
    report = diff(tmp_path / BASELINE, tmp_path / VARIANT)
    assert report.cause.name == "rewards" and report.cause.first.step == (0, 0, 0, 0)
