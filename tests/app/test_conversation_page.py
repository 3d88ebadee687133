"""The Conversation page through ``streamlit.testing.v1.AppTest`` on real traces written by
``TraceWriter``: a packed multi-turn agent trace (turns and roles recorded, or read from the mask)
and a single-turn GRPO trace; the Step page's turn labels and the token tables' placeholders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from plotly.colors import sample_colorscale

from app.components.colour_scale import SCALE, sample_colours
from app.components.conversation import chat_html, page_count, role_label, turns_on_page
from tracer.read import Trace
from tracer.views import conversation

from tests.fixtures.agent_traces import TOOL, write_agent_trace
from tests.fixtures.toy_traces import TOKENS_PAGE, ToyTokenizer, start, write_trace

PAGE = "app_pages/conversation.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("conversation")
    write_agent_trace(root / "agent")
    write_agent_trace(root / "agent_inferred", record_turns=False, record_ratio=False)
    write_trace(root / "single", tokenizer=ToyTokenizer(), steps=1)
    write_agent_trace(root / "agent_leak", leak_tool_output=True)
    return root


def open_conversation(monkeypatch, root: Path, run: str, seq: int = 0, **extra):
    at = start(monkeypatch, root, query={"run": run, "step": "0", "seq": str(seq), **extra})
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def chat(at) -> str:
    """The chat's HTML (the st.html element holding the turn headings)."""
    bodies = [el.proto.body for el in at.get("html")]
    return next(b for b in bodies if "turn 1" in b)


def turns_table(at):
    return next(df.value for df in at.dataframe if "trained_tokens" in df.value.columns)


def test_multi_turn_episode_as_a_chat(monkeypatch, root):
    at = open_conversation(monkeypatch, root, "agent")
    assert at.title[0].value == "Conversation"
    assert any("2 assistant turn(s)" in t.value and "reward 1" in t.value for t in at.text)
    body = chat(at)
    # role labels, a tool call and a tool result as blocks of their own, what is not trained and why
    for label in ("system · not trained: prompt", "user · not trained: prompt", ">assistant<",
                  "assistant · tool call", "tool · tool result · not trained: tool output"):
        assert label in body, label
    assert body.index("turn 1") < body.index("tool result") < body.index("turn 2")
    assert "&lt;tool_call&gt;" in body and "<tool_call>" not in body  # token text escaped, never markup


def test_turn_table_shows_the_means_over_trained_tokens(monkeypatch, root):
    at = open_conversation(monkeypatch, root, "agent")
    turns = turns_table(at).set_index("turn")
    assert list(turns["roles"]) == ["system, user", "assistant, tool", "assistant"]
    assert list(turns["trained_tokens"]) == [0, 5, 3]
    assert turns.loc[1, "mean_ratio"] == pytest.approx(1.2)  # (1 + 1 + 1 + 1 + 2) / 5
    assert turns.loc[2, "reward"] == 1.0 and math.isnan(turns.loc[1, "reward"])
    # each turn links to its first trained token on the Tokens page
    assert turns.loc[1, "open"].startswith("tokens?run=agent&step=0") and turns.loc[1, "open"].endswith("token=5")
    assert turns.loc[2, "open"].endswith("token=13")


def test_placeholders_are_not_shown_as_numbers(monkeypatch, root):
    at = open_conversation(monkeypatch, root, "agent")
    body = chat(at)
    for position in TOOL:  # the hover of a tool-output token: no ratio, k2 or old / sampler logprob
        hover = body[body.index(f"position {position} · tool_output"):]
        hover = hover[:hover.index('" style=')]
        for name in ("ratio =", "approx_kl_k2 =", "old_logprobs =", "sampler_logprobs =", "abs_old_sampler ="):
            assert name not in hover, (position, hover)
    # the Tokens page's table: empty cells there, numbers on trained tokens
    tokens = start(monkeypatch, root, query={"run": "agent", "step": "0", "seq": "0"}, page=TOKENS_PAGE)
    table = next(df.value for df in tokens.dataframe if {"position", "ratio", "mask_reason"} <= set(df.value.columns))
    tool_rows = table[table["mask_reason"] == "tool_output"]
    assert len(tool_rows) == 3 and tool_rows[["ratio", "old_logprobs", "approx_kl_k2"]].isna().all().all()
    assert table.loc[table["position"] == 9, "ratio"].iloc[0] == pytest.approx(2.0)
    assert {"turn", "role"} <= set(table.columns)  # an episode's token table says each token's turn and role


def test_turns_read_from_the_mask(monkeypatch, root):
    at = open_conversation(monkeypatch, root, "agent_inferred")
    body = chat(at)
    assert "environment · not trained: environment message" in body
    assert "prompt · not trained: prompt" in body
    assert any("read from the mask" in c.value for c in at.caption)


def test_single_turn_trace_is_one_assistant_turn(monkeypatch, root):
    at = open_conversation(monkeypatch, root, "single", seq=2)
    assert any("1 assistant turn(s)" in t.value for t in at.text)
    turns = turns_table(at)
    assert list(turns["turn"]) == [1]
    assert ">assistant<" in chat(at)


def test_colour_choice_and_token_link(monkeypatch, root):
    at = open_conversation(monkeypatch, root, "agent", colour="ref_kl_k3")
    assert at.selectbox(key="conversation_colour").value == "ref_kl_k3"
    at.number_input(key="conversation_token").set_value(13).run()
    assert any("position 13 · turn 2 · assistant · kept" in t.value for t in at.text)
    link = next(el.proto for el in at.get("page_link"))
    assert link.page.endswith("tokens") or "tokens" in link.page
    assert "token=13" in link.query_string and "seq=0" in link.query_string


def test_step_heatmap_labels_the_turns(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "agent", "step": "0"})
    at.switch_page("app_pages/step.py").run()
    assert not at.exception, [e.value for e in at.exception]
    specs = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
    heatmap = next(s for s in specs if any(t.get("type") == "heatmap" for t in s["data"]))
    labels = next(t for t in heatmap["data"] if t.get("name") == "turns")
    assert labels["text"] == ["T1", "T2", "T1", "T2"]
    assert "turn 1 · positions 5–12 · assistant, tool" in labels["hovertext"][0]


# -- pure builders ------------------------------------------------------------------------------


def test_sample_colours_are_plotlys():
    # the numpy sampler of the chat gives Plotly's strings exactly: random points, the stops, the ends
    ts = [*np.random.default_rng(0).random(2000).tolist(), 0.0, 0.1, 0.5, 0.30000000000000004, 0.9, 1.0,
          *[i / 255 for i in range(256)]]
    assert sample_colours(ts) == sample_colorscale(SCALE, ts)
    assert sample_colours([]) == []


def test_chat_of_some_turns_and_the_labels(root):
    trace = Trace(root / "agent")
    episode = conversation(trace, trace.steps()[0], 0)
    assert page_count(episode, per_page=1) == 2
    assert turns_on_page(episode, 0, per_page=1) == [0, 1] and turns_on_page(episode, 1, per_page=1) == [2]
    second = chat_html(episode, "ratio", ["ratio"], turns=[2])
    assert "turn 2" in second and "turn 1" not in second and "prompt" not in second
    labels = [role_label(s) for s in episode.spans]
    assert labels == ["system · not trained: prompt", "user · not trained: prompt", "assistant",
                      "assistant · tool call", "tool · tool result · not trained: tool output", "assistant"]


def test_bundled_agent_sample(monkeypatch):
    """The bundled TRL ``tools=`` trace (sample_traces/agent-trl-tiny): the chat shows its tool call and
    tool result, the turn table its two turns."""
    from tests.fixtures.paths import SAMPLES

    if not (SAMPLES / "agent-trl-tiny").is_dir():
        pytest.skip("sample_traces/agent-trl-tiny is not in this checkout")
    at = open_conversation(monkeypatch, SAMPLES, "agent-trl-tiny")
    body = chat(at)
    assert "assistant · tool call" in body and "tool · tool result · not trained: tool output" in body
    assert "prompt (prompt_ids) · not trained: prompt" in body  # TRL keeps the prompt in prompt_ids
    assert any("as recorded (turn_ids, token_roles, mask_reasons)" in c.value for c in at.caption)
    assert turns_table(at)["turn"].tolist()[-1] >= 2


def test_tool_output_in_the_loss_is_flagged_on_its_block(monkeypatch, root):
    at = open_conversation(monkeypatch, root, "agent_leak")
    assert any("3 tokens of 1 tool result / environment block(s) are in the loss" in e.value and "turn 1" in e.value
               for e in at.error)
    assert "tool · tool result · TRAINED: 3 of 3 tokens in the loss" in chat(at)
    assert any("here tool results too" in c.value for c in at.caption)
    healthy = open_conversation(monkeypatch, root, "agent")
    assert not healthy.error and "TRAINED" not in chat(healthy)
