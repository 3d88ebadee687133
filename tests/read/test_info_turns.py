"""``tracer info`` reports the turns and roles of a multi-turn trace (recorded, or read from the mask
when a packed trace records none) and says nothing of turns for a single-turn trace."""

from tracer.read.trace_info import describe_turns, trace_info

from tests.checks.test_turn_checks import episode
from tests.fixtures.check_traces import case1_tensors, write_trace


def test_recorded_turns_and_roles_are_counted_per_role(tmp_path):
    facts = trace_info(write_trace(tmp_path / "t", "grpo", [(0, 0, episode())]))["turns"]
    # two packed rows of: system 3, user 4, assistant 5, tool 6, assistant 7 tokens, 3 pad
    assert facts["recorded"] == ["turn_ids", "token_roles", "mask_reasons"]
    assert facts["turns"] == {"min": 2, "mean": 2.0, "max": 2} and facts["episodes"] == 2
    assert facts["roles"] == {"system": {"tokens": 6, "trained": 0}, "user": {"tokens": 8, "trained": 0},
                              "assistant": {"tokens": 24, "trained": 24}, "tool": {"tokens": 12, "trained": 0}}
    assert facts["not_trained"] == {"prompt": 14, "tool_output": 12, "padding": 6}
    assert describe_turns(facts)[0].startswith("turns (step 0 · inner 0 · mb 0 · rank 0): 2 episodes, 2..2 assistant")


def test_a_packed_trace_without_turn_fields_has_its_turns_read_from_the_mask(tmp_path):
    tensors = {k: v for k, v in episode().items() if k not in ("turn_ids", "token_roles", "mask_reasons")}
    facts = trace_info(write_trace(tmp_path / "u", "grpo", [(0, 0, tensors)]))["turns"]
    assert facts["recorded"] == [] and facts["turns"]["max"] == 2
    assert facts["roles"]["assistant"] == {"tokens": 24, "trained": 24}
    assert facts["not_trained"] == {"prompt": 14, "environment": 12, "padding": 6}
    assert "read from the mask" in describe_turns(facts)[0]


def test_a_single_turn_trace_reports_no_turns(tmp_path):
    assert trace_info(write_trace(tmp_path / "s", "grpo", [(0, 0, case1_tensors())]))["turns"] is None
