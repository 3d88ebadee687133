"""The conversation view (``tracer.views.conversation``) and the token tables under it, on the packed
agent trace of ``tests.fixtures.agent_traces`` written by ``TraceWriter`` (recorded turns and roles;
turns read from the mask; recorded mask reasons) and on hand-built frames. Expected values are
worked out by hand in the comments."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from tracer.read import Trace
from tracer.read.tables import mask_reasons, without_placeholders
from tracer.views import conversation, conversation_from_table
from tracer.views.conversation import MESSAGE, PROMPT_BLOCK, TOOL_CALL, TOOL_RESULT, ENVIRONMENT_BLOCK, _tool_call_pieces

from tests.fixtures.agent_traces import EOS, PAD, TOOL, write_agent_trace


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Trace]:
    root = tmp_path_factory.mktemp("agent")
    return {
        "recorded": Trace(write_agent_trace(root / "recorded")),
        "inferred": Trace(write_agent_trace(root / "inferred", record_turns=False, record_ratio=False)),
        "reasons": Trace(write_agent_trace(root / "reasons", record_reasons=True)),
    }


def episode(trace: Trace, sequence: int = 0):
    return conversation(trace, trace.steps()[0], sequence)


def test_spans_of_a_recorded_episode(traces):
    spans = [(s.turn, s.role, s.block, s.start, s.end, s.kept, s.mask_reason, s.text)
             for s in episode(traces["recorded"]).spans]
    assert spans == [
        (0, "system", PROMPT_BLOCK, 0, 3, 0, "prompt", "<|system|> be brief"),
        (0, "user", PROMPT_BLOCK, 3, 5, 0, "prompt", "<|user|> 6x7?"),
        (1, "assistant", MESSAGE, 5, 7, 2, "kept", " I call"),
        (1, "assistant", TOOL_CALL, 7, 10, 3, "kept", "<tool_call> calc</tool_call>"),  # its own block
        (1, "tool", TOOL_RESULT, 10, 13, 0, "tool_output", "<|tool|> 42\n"),
        (2, "assistant", MESSAGE, 13, 16, 3, "kept", " It is 42<eos>"),
    ]  # padding (16..19) is no span


def test_turn_table_means_over_trained_tokens_only(traces):
    turns = episode(traces["recorded"]).turns.set_index("turn")
    assert list(turns.index) == [0, 1, 2]
    assert turns.loc[0, "roles"] == "system, user" and turns.loc[1, "roles"] == "assistant, tool"
    assert list(turns["tokens"]) == [5, 8, 3] and list(turns["trained_tokens"]) == [0, 5, 3]
    # turn 1: ratio (1, 1, 1, 1, 2) -> 6 / 5 = 1.2; the tool result's ratio (from a 0.0 placeholder) is left out
    assert turns.loc[1, "mean_ratio"] == pytest.approx(1.2)
    # turn 2: ratio (0.5, 1, 1) -> 2.5 / 3
    assert turns.loc[2, "mean_ratio"] == pytest.approx(2.5 / 3)
    # k3 = exp(d) - d - 1 with d = ref - policy: turn 1 d = 0 -> 0; turn 2 d = (ln 2, 0, 0) -> (1 - ln 2) / 3
    assert turns.loc[1, "mean_ref_kl_k3"] == pytest.approx(0.0, abs=1e-7)
    assert turns.loc[2, "mean_ref_kl_k3"] == pytest.approx((1 - math.log(2)) / 3, rel=1e-5)
    # |old - sampler|: turn 1 all 0.1 -> 0.1; turn 2 (0.3, 0, 0) -> 0.1
    assert turns.loc[1, "mean_abs_old_sampler"] == pytest.approx(0.1, rel=1e-5)
    assert turns.loc[2, "mean_abs_old_sampler"] == pytest.approx(0.1, rel=1e-5)
    assert turns.loc[1, "advantage"] == pytest.approx(0.5) and turns.loc[2, "advantage"] == pytest.approx(0.5)
    assert math.isnan(turns.loc[0, "mean_ratio"])  # the prompt trains nothing
    # the sequence's reward on its last turn only
    assert math.isnan(turns.loc[1, "reward"]) and turns.loc[2, "reward"] == 1.0
    assert episode(traces["recorded"], 1).turns["reward"].iloc[-1] == 0.0


def test_turns_read_from_the_mask_when_none_recorded(traces):
    conv = episode(traces["inferred"])
    blocks = [(s.turn, s.role, s.block, s.start, s.end, s.mask_reason) for s in conv.spans]
    assert blocks == [
        (0, "", PROMPT_BLOCK, 0, 5, "prompt"),
        (1, "assistant", MESSAGE, 5, 7, "kept"),
        (1, "assistant", TOOL_CALL, 7, 10, "kept"),
        (1, "environment", ENVIRONMENT_BLOCK, 10, 13, "environment"),  # a masked gap between turns
        (2, "assistant", MESSAGE, 13, 16, "kept"),
    ]
    # derived ratio (the reader computes it) gives the same means as the recorded one
    assert conv.turns.set_index("turn").loc[1, "mean_ratio"] == pytest.approx(1.2)


def test_recorded_mask_reasons_are_read_by_name(traces):
    rows = episode(traces["reasons"]).tokens
    assert rows["mask_reason"].tolist() == ["prompt"] * 5 + ["kept"] * 5 + ["tool_output"] * 3 + ["kept"] * 3 + \
        ["padding"] * 4


def test_placeholders_and_what_they_give_show_empty(traces):
    rows = episode(traces["recorded"]).tokens.set_index("position")
    tool = list(TOOL)
    # old and sampler are 0.0 there: no logprob, and no ratio / k2 / |old - sampler| from them
    for column in ("old_logprobs", "sampler_logprobs", "ratio", "approx_kl_k2", "abs_old_sampler"):
        assert rows.loc[tool, column].isna().all(), column
    # the policy and the reference are real at those positions: their values (and k3) stay
    assert rows.loc[tool, "policy_logprobs"].tolist() == [-1.0] * 3
    assert rows.loc[tool, "ref_kl_k3"].notna().all()
    # trained positions keep their numbers
    assert rows.loc[9, "ratio"] == pytest.approx(2.0) and rows.loc[5, "old_logprobs"] == -1.0


def test_a_kept_zero_logprob_is_a_value():
    ids = torch.tensor([[5, 6, PAD]])
    data = {"completion_ids": ids, "completion_mask": torch.tensor([[True, False, False]]),
            "old_logprobs": torch.tensor([[0.0, 0.0, -2.0]]), "ratio": torch.tensor([[1.0, 3.0, 4.0]])}
    out = without_placeholders(data)
    # position 0 is trained (0.0 is its logprob), 1 a placeholder, 2 masked with a real logprob
    assert out["old_logprobs"][0, 0] == 0.0 and math.isnan(out["old_logprobs"][0, 1]) and out["old_logprobs"][0, 2] == -2.0
    assert out["ratio"][0].tolist()[0] == 1.0 and math.isnan(out["ratio"][0, 1]) and out["ratio"][0, 2] == 4.0
    assert data["old_logprobs"][0, 1] == 0.0  # the input is left alone


def test_single_turn_reasons_are_unchanged():
    # a completion "a b <eos> x <pad>" kept up to the EOS: after_eos after it, padding on the pad
    ids = torch.tensor([[7, 8, EOS, 9, PAD]])
    keep = torch.tensor([[True, True, True, False, False]])
    assert mask_reasons(ids, keep, EOS, PAD) == [["kept", "kept", "kept", "after_eos", "after_eos"]]
    assert mask_reasons(ids, torch.tensor([[True, True, False, False, False]]), None, PAD) == [
        ["kept", "kept", "masked", "masked", "padding"]]


def test_a_single_turn_sequence_is_one_assistant_turn():
    table = pd.DataFrame({
        "section": "completion", "position": [0, 1, 2, 3], "token_text": ["4", "2", "<eos>", "<pad>"],
        "kept": [True, True, True, False], "mask_reason": ["kept", "kept", "kept", "padding"],
        "turn": [1, 1, 1, -1], "role": ["assistant", "assistant", "assistant", ""],
        "ratio": [1.0, 3.0, 2.0, float("nan")],
    })
    conv = conversation_from_table(table, reward=0.25)
    assert [(s.turn, s.block, s.start, s.end) for s in conv.spans] == [(1, MESSAGE, 0, 3)]
    assert conv.assistant_turns == 1
    row = conv.turns.iloc[0]
    assert (row["turn"], row["tokens"], row["trained_tokens"]) == (1, 3, 3)
    assert row["mean_ratio"] == pytest.approx(2.0) and row["reward"] == 0.25  # (1 + 3 + 2) / 3


def test_tool_call_marker_split_across_tokens():
    # "ok" "<tool" "_call>" "f()" "</tool_call>" "bye": the call runs from the token holding "<" to
    # the one holding the closing ">", the rest are messages
    texts = ["ok", "<tool", "_call>", "f()", "</tool_call>", "bye"]
    assert _tool_call_pieces(0, 6, texts) == [(0, 1, MESSAGE), (1, 5, TOOL_CALL), (5, 6, MESSAGE)]
    assert _tool_call_pieces(0, 2, ["plain", " text"]) == [(0, 2, MESSAGE)]
    assert _tool_call_pieces(0, 2, ["<tool_call>", "x"]) == [(0, 2, TOOL_CALL)]  # never closed: to the end


def test_step_table_gives_turns_roles_and_no_placeholder_values(traces):
    from tracer.views.step import step_token_frame

    frame = step_token_frame(traces["recorded"], 0)
    row = frame[frame["sequence"] == 0].set_index("position")
    assert row.loc[[5, 10, 13, 16], "turn"].tolist() == [1, 1, 2, -1]
    assert row.loc[[0, 3, 5, 10, 16], "role"].tolist() == ["system", "user", "assistant", "tool", ""]
    assert row.loc[list(TOOL), "mask_reason"].tolist() == ["tool_output"] * 3
    # at the tool result: old and sampler are placeholders, so |policy - old|, ratio, k2 and
    # |old - sampler| are empty; trained positions keep theirs (position 9: ratio 2, |old - sampler| 0.1)
    for column in ("abs_policy_old", "ratio", "approx_kl_k2", "abs_old_sampler", "old_minus_sampler"):
        assert row.loc[list(TOOL), column].isna().all(), column
    assert row.loc[9, "ratio"] == pytest.approx(2.0) and row.loc[9, "abs_old_sampler"] == pytest.approx(0.1, rel=1e-5)
