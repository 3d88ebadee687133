"""tracer.attach on a real TRL GRPOTrainer with tools=[add] (CPU, the tiny tool-calling model of
tracer.demo.agent_model): turn_ids, token_roles and mask_reasons agree with the token ids and with
TRL's own tool_mask, and a run that leaks the tool results into the loss shows kept tool tokens.
No mocks: real trainer, real tool calls, real files."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

from tracer import Trace  # noqa: E402
from tracer.demo import agent_trl, grpo_trl  # noqa: E402
from tracer.demo.agent_model import add, build_agent_model  # noqa: E402
from tracer.format.turns import ROLE_NAMES, row_spans  # noqa: E402
from tracer.integrations import trl_tools  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
ASSISTANT, TOOL = ROLE_NAMES.index("assistant"), ROLE_NAMES.index("tool")
REASON = {name: code for code, name in enumerate(trl_tools.TRL_MASK_REASON_NAMES)}


@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory):
    return build_agent_model(tmp_path_factory.mktemp("agent") / "model", seed=0, warmup_steps=300)


@pytest.fixture(scope="module")
def tokenizer(agent_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(agent_model_dir)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, agent_model_dir) -> Trace:
    out = tmp_path_factory.mktemp("trace") / "agent"
    agent_trl.run_agent_demo(out, steps=2, seed=0, progress=False, model_dir=agent_model_dir)
    return Trace(out)


@pytest.fixture(scope="module")
def leaky(tmp_path_factory, agent_model_dir) -> Trace:
    out = tmp_path_factory.mktemp("trace") / "agent-leak"
    agent_trl.run_agent_demo(out, steps=2, seed=0, progress=False, model_dir=agent_model_dir, leak=True)
    return Trace(out)


def _steps(trace: Trace):
    for key in trace.steps():
        yield trace.load_step(key), trace.metadata(key)


def _unpadded(ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """[B, T] bool: positions before the trailing pad run (pad is not EOS in the agent tokenizer)."""
    is_pad = ids == pad_token_id  # (B, T)
    trailing = is_pad.flip(1).cumprod(dim=1).flip(1).bool()  # (B, T)
    return ~trailing


def assert_turn_fields(data, meta) -> None:
    """A tool-calling step records turn_ids, token_roles and mask_reasons [B, T] int64, with TRL's role
    and reason names and one outcome advantage per episode (also used by test_trl_environment.py)."""
    B, T = data["completion_ids"].shape
    for name in ("turn_ids", "token_roles", "mask_reasons"):
        assert data[name].shape == (B, T) and data[name].dtype == torch.int64, name
    assert meta["role_names"] == list(ROLE_NAMES)
    assert meta["mask_reason_names"] == list(trl_tools.TRL_MASK_REASON_NAMES)
    assert meta["advantage_assignment"] == "episode"


def test_tool_calling_steps_record_turns_roles_and_reasons(healthy):
    assert healthy.manifest["dropped_steps"] == 0 and healthy.status == "finished"
    for data, meta in _steps(healthy):
        assert_turn_fields(data, meta)
    turns = torch.cat([d["turn_ids"].max(dim=1).values for d, _ in _steps(healthy)])
    assert (turns >= 2).float().mean() >= 0.5  # most episodes call the tool at least once


def test_roles_agree_with_trl_s_tool_mask_and_the_mask_is_the_loss_mask(healthy, tokenizer):
    for data, _ in _steps(healthy):
        ids, roles, tool_mask = data["completion_ids"], data["token_roles"], data["tool_mask"]
        unpadded = _unpadded(ids, tokenizer.pad_token_id)  # (B, T)
        # TRL 1.16: completion_mask is 1 on every unpadded token (mask_truncated_completions off); the loss
        # keeps completion_mask * tool_mask
        assert torch.equal(data["completion_mask"], unpadded & (tool_mask == 1))
        # the roles were read from the ids alone, yet say tool exactly where TRL's tool_mask is 0
        assert torch.equal(roles == TOOL, unpadded & (tool_mask == 0))
        assert torch.equal(roles == ASSISTANT, unpadded & (tool_mask == 1))
        assert torch.equal(roles == -1, ~unpadded) and torch.equal(data["turn_ids"] == -1, ~unpadded)
        reasons = data["mask_reasons"]
        assert torch.equal(reasons == REASON["kept"], data["completion_mask"])
        assert torch.equal(reasons == REASON["tool_output"], roles == TOOL)
        assert torch.equal(reasons == REASON["padding"], ~unpadded)


def _expected_tool_text(assistant_text: str) -> str:
    """What TRL's tool loop answers to this assistant turn: add(**arguments) of its tool call, or an error."""
    call = json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", assistant_text, re.S).group(1))
    try:
        return str(add(**call["arguments"]))
    except TypeError:
        return "error"


def test_each_tool_span_holds_the_result_of_the_call_before_it(healthy, tokenizer):
    tool_spans = 0
    for data, meta in _steps(healthy):
        for row in range(data["completion_ids"].shape[0]):
            ids = data["completion_ids"][row].tolist()
            spans = row_spans(data["turn_ids"][row].tolist(), data["token_roles"][row].tolist(),
                              data["completion_mask"][row].tolist(), meta["role_names"])
            texts = [tokenizer.decode(ids[s.start:s.end]) for s in spans]
            assert [s.turn for s in spans] == sorted(s.turn for s in spans) and spans[0].turn == 1
            for k, (span, text) in enumerate(zip(spans, texts)):
                if span.role == "assistant" and k + 1 < len(spans):
                    assert text.endswith("<|im_end|>") and "<tool_call>" in text, text
                if span.role == "tool":
                    tool_spans += 1
                    assert spans[k - 1].role == "assistant" and spans[k - 1].turn == span.turn
                    assert text.startswith("\n<|im_start|>user\n<tool_response>\n"), text
                    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"), text
                    result = text.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
                    assert _expected_tool_text(texts[k - 1]) in result, (texts[k - 1], text)
                    assert span.kept == 0
    assert tool_spans >= 8


def test_a_leaked_tool_output_shows_as_kept_tool_tokens(leaky, tokenizer):
    leaked = 0
    for data, _ in _steps(leaky):
        roles, reasons, tool_mask = data["token_roles"], data["mask_reasons"], data["tool_mask"]
        assert bool((tool_mask == 1).all())  # the bug: TRL's tool_mask is all ones
        kept_tool = (roles == TOOL) & data["completion_mask"]  # (B, T)
        assert torch.equal(kept_tool, roles == TOOL)  # every tool token is in the loss ...
        assert bool((reasons[roles == TOOL] == REASON["kept"]).all())  # ... and its reason says so
        for row, pos in kept_tool.nonzero().tolist()[:3]:
            segment = data["completion_ids"][row, pos:pos + 6].tolist()
            assert "<tool_response>" in tokenizer.decode(segment)
        leaked += int(kept_tool.sum())
    assert leaked > 0


def test_truncated_episodes_masked_by_trl_read_truncated(tmp_path, agent_model_dir, tokenizer):
    out = tmp_path / "agent-truncated"
    # 12 tokens cannot hold a tool call: every first turn is cut, TRL masks the whole row
    agent_trl.run_traced(out, agent_trl.make_trainer, {}, "test", 1, 0, False, agent_model_dir,
                         max_completion_length=12, mask_truncated_completions=True)
    (data, meta), = _steps(Trace(out))
    last = data["completion_ids"][:, -1]  # (B,)
    truncated = (last != tokenizer.pad_token_id) & (last != tokenizer.eos_token_id)  # TRL's own test
    assert bool(truncated.any())
    assistant = data["token_roles"][truncated] == ASSISTANT  # (b, T)
    assert bool((data["mask_reasons"][truncated][assistant] == REASON["truncated"]).all())
    assert not bool(data["completion_mask"][truncated].any())


def test_single_turn_runs_record_no_turn_fields(tmp_path, model_dir):
    out = tmp_path / "grpo"
    grpo_trl.run_grpo_demo(out, steps=1, seed=0, progress=False, model_dir=model_dir, num_iterations=1)
    (data, meta), = _steps(Trace(out))
    assert not {"turn_ids", "token_roles", "mask_reasons", "tool_mask"} & set(data)
    assert not {"role_names", "mask_reason_names", "advantage_assignment"} & set(meta)


def test_episode_roles_by_hand():
    # eos 2, pad 0, generation prompt (5, 6). Row 0: turn 1 = [10, 11, EOS], its tool block [7, 8, 5, 6], turn 2 =
    # [12, EOS], then padding. Row 1: turn 1 then a tool block, turn 2 cut (no EOS): truncated, no padding.
    markers = trl_tools.ChatMarkers(eos_token_ids=(2,), pad_token_id=0, generation_prompt=(5, 6))
    ids = torch.tensor([[10, 11, 2, 7, 8, 5, 6, 12, 2, 0, 0],
                        [10, 2, 7, 5, 6, 12, 13, 14, 15, 16, 17]])
    turn_ids, token_roles, truncated = trl_tools.episode_roles(ids, markers)
    A, O, P = ASSISTANT, TOOL, -1
    assert turn_ids.tolist() == [[1, 1, 1, 1, 1, 1, 1, 2, 2, -1, -1], [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]]
    assert token_roles.tolist() == [[A, A, A, O, O, O, O, A, A, P, P], [A, A, O, O, O, A, A, A, A, A, A]]
    assert truncated.tolist() == [False, True]
    # kept: turn tokens; row 1 masked as truncated (TRL's mask_truncated_completions), except a leaked tool token
    keep = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    reasons = trl_tools.mask_reasons(token_roles, keep, truncated)
    K, T_, X, D = REASON["kept"], REASON["tool_output"], REASON["truncated"], REASON["padding"]
    assert reasons.tolist() == [[K, K, K, T_, T_, T_, T_, K, K, D, D], [X, X, K, T_, T_, X, X, X, X, X, X]]


def test_episode_roles_when_pad_is_the_eos():
    # pad == eos == 2: the first 2 of the trailing run is the row's own EOS (assistant), the rest padding
    markers = trl_tools.ChatMarkers(eos_token_ids=(2,), pad_token_id=2, generation_prompt=(5, 6))
    turn_ids, token_roles, truncated = trl_tools.episode_roles(torch.tensor([[10, 2, 7, 5, 6, 12, 2, 2, 2]]), markers)
    assert turn_ids.tolist() == [[1, 1, 1, 1, 1, 2, 2, -1, -1]]
    assert token_roles.tolist() == [[ASSISTANT, ASSISTANT, TOOL, TOOL, TOOL, ASSISTANT, ASSISTANT, -1, -1]]
    assert truncated.tolist() == [False]


def test_chat_markers_read_the_agent_template(agent_model_dir, tokenizer):
    from types import SimpleNamespace

    trainer = SimpleNamespace(processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    markers = trl_tools.chat_markers(trainer)
    assert tokenizer.decode(list(markers.generation_prompt)) == "<|im_start|>assistant\n"
    assert markers.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert markers.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
