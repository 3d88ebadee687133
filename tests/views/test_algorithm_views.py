"""tracer.views on small traces written by TraceWriter in tmp_path; expected values by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tracer import views
from tracer.errors import TraceFormatError
from tracer.read import Trace
from tracer.record.writer import TraceWriter

from tests.fixtures.view_traces import EOS, PAD, ToyTokenizer, grpo_step, write_grpo


# -- PPO ------------------------------------------------------------------------------------------


def ppo_minibatch(row_ids: list[int], shift: float) -> dict[str, torch.Tensor]:
    """A minibatch of len(row_ids) rows, T = 3, the last position masked. policy - old = shift on
    every token, so approx_kl_k2 = 0.5 * shift^2; the masked slot holds 100 to prove it is ignored."""
    b = len(row_ids)
    completion_mask = torch.tensor([[True, True, False]] * b)  # (b, T)
    old = torch.full((b, 3), -1.0)
    policy = old + shift
    approx_kl_k2 = torch.where(completion_mask, 0.5 * (policy - old) ** 2, torch.tensor(100.0))
    return {
        "row_ids": torch.tensor(row_ids), "completion_ids": torch.tensor([[2, EOS, PAD]] * b),
        "completion_mask": completion_mask, "policy_logprobs": policy, "old_logprobs": old,
        "approx_kl_k2": approx_kl_k2, "values": torch.zeros(b, 3), "returns": torch.zeros(b, 3),
        "advantages": torch.zeros(b, 3), "rewards": torch.tensor([float(r) for r in row_ids]),
    }


@pytest.fixture(scope="module")
def ppo_trace(tmp_path_factory) -> Trace:
    """One step, 2 epochs x 2 minibatches over 4 rollout rows; epoch 1 minibatch 0 stops early,
    so epoch 1 minibatch 1 never runs. target_kl 0.01."""
    out = tmp_path_factory.mktemp("ppo") / "run"
    with TraceWriter(out, "ppo", hyperparameters={"target_kl": 0.01}, async_write=False) as w:
        w.record(0, ppo_minibatch([3, 0], 0.1), inner_step=0, micro_batch=0, metadata={"early_stop": False})
        w.record(0, ppo_minibatch([2, 1], 0.0), inner_step=0, micro_batch=1, metadata={"early_stop": False})
        w.record(0, ppo_minibatch([1, 3], 0.2), inner_step=1, micro_batch=0, metadata={"early_stop": True})
        w.record(1, ppo_minibatch([0, 1], 0.0), inner_step=0, micro_batch=0, metadata={"early_stop": False})
    return Trace(out)


def test_rollout_rows_point_to_the_minibatch_file_that_holds_each_row(ppo_trace):
    rows = views.rollout_rows(ppo_trace, step=0, inner_step=0)
    # row_ids [3, 0] in mb 0 and [2, 1] in mb 1
    assert [(r.row_id, r.key.micro_batch, r.index) for r in rows] == [(0, 0, 1), (1, 1, 1), (2, 1, 0), (3, 0, 0)]
    epoch1 = views.rollout_rows(ppo_trace, step=0, inner_step=1)
    assert [(r.row_id, r.key.micro_batch, r.index) for r in epoch1] == [(1, 0, 0), (3, 0, 1)]
    assert views.rollout_rows(ppo_trace, step=5) == []


def test_rollout_rows_without_row_ids_count_on_across_minibatches(tmp_path):
    out = tmp_path / "run"
    with TraceWriter(out, "ppo", async_write=False) as w:
        for mb in range(2):
            tensors = ppo_minibatch([7, 8], 0.0)
            del tensors["row_ids"]
            w.record(0, tensors, micro_batch=mb)
    rows = views.rollout_rows(Trace(out), 0)
    assert [(r.row_id, r.key.micro_batch, r.index) for r in rows] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]


def test_ppo_minibatch_table_marks_the_early_stop_and_what_never_ran(ppo_trace):
    table = views.ppo_minibatch_table(ppo_trace, 0)
    assert list(zip(table["epoch"], table["minibatch"], table["status"])) == [
        (0, 0, "ran"), (0, 1, "ran"), (1, 0, "early stop"), (1, 1, "not run")]
    assert table["early_stop"].tolist() == [False, False, True, False]
    # k2 = 0.5 * shift^2 on the two kept tokens: 0.5 * 0.01, 0, 0.5 * 0.04; the masked 100 is ignored
    assert table["mean_approx_kl_k2"].iloc[:3].tolist() == pytest.approx([0.005, 0.0, 0.02])
    assert math.isnan(table["mean_approx_kl_k2"].iloc[3])
    assert table["above_target_kl"].tolist() == [False, False, True, False]
    assert table["target_kl"].iloc[0] == pytest.approx(0.01)
    assert table["row_ids"].tolist() == ["3 0", "2 1", "1 3", ""]
    # step 1 has only epoch 0 mb 0: the grid comes from the whole trace; the rest is "no file"
    assert views.ppo_minibatch_table(ppo_trace, 1)["status"].tolist() == ["ran", "no file", "no file", "no file"]


def test_ppo_early_stops_one_row_per_step(ppo_trace):
    stops = views.ppo_early_stops(ppo_trace)
    assert stops[["step", "epochs", "files", "early_stop", "stop_epoch", "stop_minibatch"]].values.tolist() == [
        [0, 2, 3, True, 1, 0], [1, 1, 1, False, -1, -1]]


# -- groups ---------------------------------------------------------------------------------------


def test_group_frame_stats_and_zero_variance(tmp_path):
    trace = write_grpo(tmp_path / "g", [(0, grpo_step([1.0, 1.0, 1.0, 0.0, 1.0, 2.0], [0, 0, 0, 1, 1, 1]), 0)])
    frame = views.group_frame(trace, trace.steps()[0])
    assert frame["group"].tolist() == [0, 1] and frame["size"].tolist() == [3, 3]
    assert frame["sequences"].tolist() == ["0 1 2", "3 4 5"]
    assert frame["zero_variance"].tolist() == [True, False]
    assert frame["reward_mean"].tolist() == pytest.approx([1.0, 1.0])
    # population std of (0, 1, 2): sqrt((1 + 0 + 1) / 3)
    assert frame["reward_std"].tolist() == pytest.approx([0.0, math.sqrt(2 / 3)])
    assert frame[["reward_min", "reward_max"]].values.tolist() == [[1.0, 1.0], [0.0, 2.0]]


def test_group_std_is_unbiased_when_the_trace_says_so(tmp_path):
    trace = write_grpo(tmp_path / "g", [(0, grpo_step([1.0, 1.0, 1.0, 0.0, 1.0, 2.0], [0, 0, 0, 1, 1, 1]), 0)],
                       metadata={"advantage_std": "unbiased"})
    # Bessel: sqrt((1 + 0 + 1) / 2) = 1
    assert views.group_frame(trace, trace.steps()[0])["reward_std"].tolist() == pytest.approx([0.0, 1.0])


def test_group_completions_rows_text_components_and_advantage(tmp_path):
    trace = write_grpo(tmp_path / "g", [(0, grpo_step([3.0, 1.0, 2.0, 5.0, 5.0, 5.0], [0, 0, 0, 1, 1, 1]), 0)])
    key = trace.steps()[0]
    rows = views.group_completions(trace, key, 0)
    assert rows["sequence"].tolist() == [0, 1, 2]
    # filler (after EOS, padding) left out; "<script>" stays the literal token string
    assert rows["completion_text"].tolist() == ["a<script><eos>", "bc", "bc"]
    assert rows["kept_tokens"].tolist() == [3, 2, 2]
    assert rows["reward"].tolist() == [3.0, 1.0, 2.0]
    assert rows["accuracy"].tolist() == [3.0, 1.0, 2.0] and rows["format"].tolist() == [0.0, 0.0, 0.0]
    assert rows["advantage"].tolist() == pytest.approx([0.0, 0.1, 0.2])
    assert rows["group_mean"].tolist() == pytest.approx([2.0] * 3)
    assert not rows["zero_variance"].any()
    assert views.group_completions(trace, key, 1)["zero_variance"].all()
    assert views.group_prompt_text(trace, key, 0) == "a"  # prompt padding left out
    with pytest.raises(KeyError, match="no group 7"):
        views.group_completions(trace, key, 7)


def test_groups_from_num_generations_without_group_ids(tmp_path):
    trace = write_grpo(tmp_path / "g", [(0, grpo_step([1.0, 2.0, 3.0, 4.0, 4.0, 4.0]), 0)], algorithm="rloo")
    frame = views.group_frame(trace, trace.steps()[0])
    assert frame["sequences"].tolist() == ["0 1 2", "3 4 5"]  # G = 3 consecutive rows
    assert frame["zero_variance"].tolist() == [False, True]


def test_group_ids_of_says_what_to_record():
    data = {"rewards": torch.zeros(4)}
    with pytest.raises(TraceFormatError, match="record group_ids .B. or set num_generations"):
        views.group_ids_of(data, {"num_generations": 3}, "step.safetensors")
    assert views.group_ids_of(data, {"num_generations": 2}).tolist() == [0, 0, 1, 1]


def test_zero_variance_shares_per_step_pool_micro_batches(tmp_path):
    trace = write_grpo(tmp_path / "g", [
        # step 0: groups 0 (zero variance) and 1
        (0, grpo_step([1.0, 1.0, 1.0, 0.0, 1.0, 2.0], [0, 0, 0, 1, 1, 1]), 0),
        # step 1: group 5 split over two micro-batches with equal rewards (one zero-variance group),
        # group 6 split with different rewards, group 7 whole and zero variance
        (1, grpo_step([2.0, 2.0, 0.0], [5, 5, 6]), 0),
        (1, grpo_step([2.0, 1.0, 3.0, 3.0, 3.0], [5, 6, 7, 7, 7]), 1),
    ])
    shares = views.zero_variance_shares(trace)
    assert shares["step"].tolist() == [0, 1]
    assert shares["groups"].tolist() == [2, 3]
    assert shares["zero_variance_groups"].tolist() == [1, 2]
    assert shares["zero_variance_share"].tolist() == pytest.approx([1 / 2, 2 / 3])


# -- DPO ------------------------------------------------------------------------------------------


def dpo_step(with_terms: bool = True) -> dict[str, torch.Tensor]:
    """Two pairs, T = 3, the last chosen position masked.

    Pair 0: π_c = -1 - 2 = -3 (the masked -50 ignored), π_r = -4, ref_c = ref_r = -3.5.
    Pair 1: both sides identical -> every term 0 (a tie).
    """
    chosen_mask = torch.tensor([[True, True, False], [True, True, False]])
    rejected_mask = torch.tensor([[True, True, True], [True, True, False]])
    chosen_policy = torch.tensor([[-1.0, -2.0, -50.0], [-1.0, -1.0, -50.0]])
    rejected_policy = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -1.0, -50.0]])
    chosen_ref = torch.tensor([[-1.5, -2.0, -9.0], [-1.0, -1.0, -9.0]])
    rejected_ref = torch.tensor([[-1.0, -1.5, -1.0], [-1.0, -1.0, -9.0]])
    out = {
        "chosen_ids": torch.tensor([[2, 4, PAD], [2, 3, PAD]]),
        "rejected_ids": torch.tensor([[3, 3, EOS], [2, 3, PAD]]),
        "chosen_mask": chosen_mask, "rejected_mask": rejected_mask,
        "chosen_policy_logprobs": chosen_policy, "rejected_policy_logprobs": rejected_policy,
        "chosen_ref_logprobs": chosen_ref, "rejected_ref_logprobs": rejected_ref,
    }
    if with_terms:  # what a trainer would record, written out by hand for beta = 0.5
        out.update({"dpo_logits": torch.tensor([1.0, 0.0]),
                    "dpo_loss": torch.tensor([math.log1p(math.exp(-0.5)), math.log(2.0)]),
                    "chosen_rewards": torch.tensor([0.25, 0.0]), "rejected_rewards": torch.tensor([-0.25, 0.0])})
    return out


def write_dpo(out, with_terms=True):
    with TraceWriter(out, "dpo", tokenizer=ToyTokenizer(), hyperparameters={"beta": 0.5}, async_write=False) as w:
        w.record(0, dpo_step(with_terms))
        w.record(1, dpo_step(with_terms))
    return Trace(out)


def test_dpo_pair_tokens_side_by_side(tmp_path):
    trace = write_dpo(tmp_path / "d")
    table = views.dpo_pair_tokens(trace, trace.steps()[0], 0)
    assert table["position"].tolist() == [0, 1, 2]
    assert table["chosen_token_text"].tolist() == ["a", "<script>", "<pad>"]
    assert table["rejected_token_text"].tolist() == ["b", "b", "<eos>"]
    assert table["chosen_kept"].tolist() == [True, True, False]
    assert table["rejected_kept"].tolist() == [True, True, True]
    assert table["chosen_policy_logprobs"].tolist() == [-1.0, -2.0, -50.0]
    assert table["rejected_ref_logprobs"].tolist() == [-1.0, -1.5, -1.0]


def test_dpo_pair_terms_recorded_and_recomputed_by_hand(tmp_path):
    trace = write_dpo(tmp_path / "d")
    terms = views.dpo_pair_terms(trace, trace.steps()[0], 0).set_index("quantity")
    recomputed = terms["recomputed"]
    # sums over kept tokens: π_c = -3, π_r = -4, ref_c = -3.5, ref_r = -3.5
    assert recomputed["chosen policy sum π_c"] == pytest.approx(-3.0)
    assert recomputed["rejected policy sum π_r"] == pytest.approx(-4.0)
    assert recomputed["chosen ref sum ref_c"] == pytest.approx(-3.5)
    assert recomputed["rejected ref sum ref_r"] == pytest.approx(-3.5)
    # logits = (-3 + 4) - (-3.5 + 3.5) = 1; loss = -logsigmoid(0.5 * 1) = log(1 + e^-0.5)
    assert recomputed["dpo_logits"] == pytest.approx(1.0)
    assert recomputed["dpo_loss"] == pytest.approx(math.log1p(math.exp(-0.5)))
    # implicit rewards 0.5 * (-3 + 3.5) = 0.25 and 0.5 * (-4 + 3.5) = -0.25, margin 0.5
    assert recomputed["chosen_rewards"] == pytest.approx(0.25)
    assert recomputed["rejected_rewards"] == pytest.approx(-0.25)
    assert recomputed["margin"] == pytest.approx(0.5)
    assert terms.loc["dpo_logits", "recorded"] == pytest.approx(1.0)
    assert terms.loc["margin", "recorded"] == pytest.approx(0.5)
    assert math.isnan(terms.loc["chosen policy sum π_c", "recorded"])  # sums are not stored


def test_dpo_step_summary_margin_and_accuracy(tmp_path):
    for with_terms in (True, False):  # recorded, or recomputed from the per-token fields
        trace = write_dpo(tmp_path / f"d{with_terms}", with_terms)
        summary = views.dpo_step_summary(trace)
        assert summary["step"].tolist() == [0, 1] and summary["pairs"].tolist() == [2, 2]
        # margins 0.5 and 0 (a tie counts as wrong): mean 0.25, accuracy 1/2
        assert summary["margin"].tolist() == pytest.approx([0.25, 0.25])
        assert summary["preference_accuracy"].tolist() == pytest.approx([0.5, 0.5])
        assert summary["mean_dpo_logits"].tolist() == pytest.approx([0.5, 0.5])
        assert summary["mean_dpo_loss"].iloc[0] == pytest.approx((math.log1p(math.exp(-0.5)) + math.log(2)) / 2)


def test_hostile_metadata_is_treated_as_unknown_not_a_crash(tmp_path):
    # beta = "x", target_kl = "x", reward_component_names = 5: the views show unknowns, never raise
    from tracer.views import dpo_pair_terms, group_frame, ppo_minibatch_table

    side = torch.ones(1, 2)
    with TraceWriter(tmp_path / "dpo", "dpo", hyperparameters={"beta": "x"}) as w:
        w.record(0, chosen_ids=torch.tensor([[5, 1]]), rejected_ids=torch.tensor([[6, 1]]), chosen_mask=side,
                 rejected_mask=side, chosen_policy_logprobs=-side, rejected_policy_logprobs=-2 * side,
                 chosen_ref_logprobs=-side, rejected_ref_logprobs=-side)
    trace = Trace(tmp_path / "dpo")
    dpo_pair_terms(trace, trace.steps()[0], 0)
    with TraceWriter(tmp_path / "ppo", "ppo", hyperparameters={"target_kl": "x"}) as w:
        w.record(0, completion_ids=torch.ones(2, 2, dtype=torch.long), completion_mask=torch.ones(2, 2),
                 policy_logprobs=-torch.ones(2, 2), old_logprobs=-torch.ones(2, 2), row_ids=torch.tensor([0, 1]))
    table = ppo_minibatch_table(Trace(tmp_path / "ppo"), 0)
    assert table["target_kl"].isna().all()
    with TraceWriter(tmp_path / "grpo", "grpo", hyperparameters={"reward_component_names": 5,
                                                                 "num_generations": 2}) as w:
        w.record(0, rewards=torch.tensor([1.0, 0.0]), reward_components=torch.tensor([[1.0], [0.0]]),
                 group_ids=torch.tensor([0, 0]), advantages=torch.tensor([1.0, -1.0]))
    grpo = Trace(tmp_path / "grpo")
    assert len(group_frame(grpo, grpo.steps()[0])) == 1
    from tracer.views import group_completions

    assert len(group_completions(grpo, grpo.steps()[0], 0)) == 2
