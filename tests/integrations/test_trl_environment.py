"""tracer.attach on a real TRL GRPOTrainer with ``environment_factory=`` (TRL 1.16, experimental; CPU, the
tiny tool-calling model of tracer.demo.agent_model): the environment's public method ``add`` is the tool,
its ``get_reward`` the only reward. The trace's turn_ids, token_roles and mask_reasons are checked
against what TRL itself returned from the rollout (its completion_mask and tool_mask, taken by a spy
on ``_generate_and_score_completions``) and against each environment instance's own call log (the tool
results in the row are the values the environment's method returned). No mocks: real trainer, real
environments, real files."""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from typing import Any

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

from tracer import Trace  # noqa: E402
from tracer.checks import ERROR, run_checks  # noqa: E402
from tracer.demo import agent_trl  # noqa: E402
from tracer.demo.trl_demo import cpu_trainer  # noqa: E402
from tracer.format.turns import ROLE_NAMES, row_spans  # noqa: E402
from tracer.integrations import trl_tools  # noqa: E402

# the agent model and its tokenizer, built once for this module as for test_trl_tools.py
from tests.integrations.test_trl_tools import agent_model_dir, assert_turn_fields, tokenizer  # noqa: E402,F401

pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:You are using 'environment_factory':UserWarning")]
ASSISTANT, TOOL = ROLE_NAMES.index("assistant"), ROLE_NAMES.index("tool")
REASON = {name: code for code, name in enumerate(trl_tools.TRL_MASK_REASON_NAMES)}
STEPS = 2


class AddEnvironment:
    """One rollout's calculator: ``add`` is its tool (TRL exposes the public methods), ``reset`` gets the
    dataset row (it keeps the expected ``answer``) and ``get_reward`` scores the rollout from the
    environment's state: ``1 / (1 + |last sum it computed - answer|)``, 0.0 when ``add`` was never called
    (graded, so that the tiny model's groups get different rewards)."""

    def __init__(self) -> None:
        self.answer: str | None = None
        self.calls: list[tuple[dict[str, Any], int]] = []  # (arguments, returned value), in call order

    def reset(self, **row: Any) -> None:
        self.answer, self.calls = row["answer"], []

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        result = int(a) + int(b)
        self.calls.append(({"a": a, "b": b}, result))
        return result

    def get_reward(self) -> float:
        return 1.0 / (1.0 + abs(self.calls[-1][1] - int(self.answer))) if self.calls else 0.0


def make_env_trainer(model_dir, output_dir, steps: int, seed: int, progress: bool, rollouts: list[dict[str, Any]]):
    """``GRPOTrainer(environment_factory=AddEnvironment)`` (no ``reward_funcs``: the environment owns the
    reward) with the agent demo's settings, one rollout per optimizer step; a spy on
    ``_generate_and_score_completions`` appends to ``rollouts`` what TRL returned (ids and masks) and
    each rollout environment's calls and reward, in generation-row order."""
    from trl import GRPOConfig, GRPOTrainer

    fields = dict(per_device_train_batch_size=agent_trl.NUM_GENERATIONS * agent_trl.PROMPTS_PER_STEP,
                  num_generations=agent_trl.NUM_GENERATIONS, max_completion_length=agent_trl.MAX_COMPLETION_LENGTH,
                  max_tool_calling_iterations=agent_trl.MAX_TOOL_CALLS, temperature=1.0,
                  learning_rate=agent_trl.LEARNING_RATE, beta=agent_trl.BETA, loss_type="grpo", num_iterations=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using 'environment_factory'", category=UserWarning)
        trainer = cpu_trainer(GRPOTrainer, GRPOConfig, model_dir, output_dir, steps, seed, progress, fields,
                              environment_factory=AddEnvironment, train_dataset=agent_trl.make_dataset(seed))
    original = trainer._generate_and_score_completions

    def generate_and_score(*args, **kwargs):
        output = original(*args, **kwargs)
        rollouts.append({
            "completion_ids": output["completion_ids"].detach().cpu().clone(),
            "completion_mask": output["completion_mask"].detach().cpu().clone(),
            "tool_mask": output["tool_mask"].detach().cpu().clone(),
            "calls": [list(env.calls) for env in trainer.environments],
            "rewards": [env.get_reward() for env in trainer.environments],
        })
        return output

    trainer._generate_and_score_completions = generate_and_score
    return trainer


@pytest.fixture(scope="module")
def env_run(tmp_path_factory, agent_model_dir):  # noqa: F811
    out = tmp_path_factory.mktemp("trace") / "agent-env"
    rollouts: list[dict[str, Any]] = []
    start = time.perf_counter()
    agent_trl.run_traced(out, make_env_trainer, {"environment_factory": f"{__name__}.AddEnvironment"},
                         f"{__name__}.env_run", STEPS, 0, False, agent_model_dir, rollouts=rollouts)
    print(f"environment_factory run: {time.perf_counter() - start:.1f} s")
    return Trace(out), rollouts


def _steps(trace: Trace):
    for key in trace.steps():
        yield trace.load_step(key), trace.metadata(key)


def _tool_calls(text: str) -> list[dict[str, Any] | None]:
    """The tool calls an assistant span wrote, as parsed JSON (None where it is not JSON)."""
    calls = []
    for body in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.DOTALL):
        try:
            calls.append(json.loads(body))
        except ValueError:
            calls.append(None)
    return calls


def test_environment_rows_record_turns_roles_and_reasons(env_run):
    trace, rollouts = env_run
    assert trace.status == "finished" and trace.manifest["dropped_steps"] == 0
    steps = list(_steps(trace))
    assert len(steps) == STEPS == len(rollouts)  # num_iterations=1: one rollout, one step file per optimizer step
    multi_turn_rows = 0
    for (data, meta), rollout in zip(steps, rollouts):
        assert_turn_fields(data, meta)
        assert meta["reward_component_names"] == ["AddEnvironment"] and meta["reward_weights"] == [1.0]
        rows = data["generation_row_ids"]  # (B,) the rows in TRL's generation order
        assert torch.equal(data["completion_ids"], rollout["completion_ids"][rows])
        multi_turn_rows += int((data["turn_ids"].max(dim=1).values >= 2).sum())
    assert multi_turn_rows >= STEPS * 4  # most episodes call the environment at least once


def test_kept_positions_are_trl_s_completion_mask_times_its_tool_mask(env_run):
    trace, rollouts = env_run
    for (data, _), rollout in zip(_steps(trace), rollouts):
        rows = data["generation_row_ids"]
        trl_keep = (rollout["completion_mask"] * rollout["tool_mask"])[rows].bool()  # (B, T) what TRL's loss keeps
        tool = (rollout["tool_mask"] == 0)[rows]  # (B, T) the tokens TRL appended for the environment's results
        assert bool(tool.any())
        assert torch.equal(data["completion_mask"].bool(), trl_keep)
        assert torch.equal(data["tool_mask"], rollout["tool_mask"][rows])
        assert torch.equal(data["mask_reasons"] == REASON["kept"], trl_keep)
        # roles, read by the tracer from the ids alone, say tool exactly where TRL's mask says environment output
        assert torch.equal(data["token_roles"] == TOOL, tool)
        assert torch.equal(data["mask_reasons"] == REASON["tool_output"], tool)
        unpadded = data["token_roles"] != -1  # (B, T)
        assert torch.equal(data["token_roles"] == ASSISTANT, unpadded & ~tool)
        assert torch.equal(data["turn_ids"] == -1, ~unpadded)
        assert torch.equal(data["mask_reasons"] == REASON["padding"], ~unpadded)


def test_each_tool_span_holds_what_the_environment_returned(env_run, tokenizer):  # noqa: F811
    trace, rollouts = env_run
    results_seen = 0
    for (data, meta), rollout in zip(_steps(trace), rollouts):
        rows = data["generation_row_ids"].tolist()
        for row, generation_row in enumerate(rows):
            ids = data["completion_ids"][row].tolist()
            spans = row_spans(data["turn_ids"][row].tolist(), data["token_roles"][row].tolist(),
                              data["completion_mask"][row].tolist(), meta["role_names"])
            texts = [tokenizer.decode(ids[s.start:s.end]) for s in spans]
            assert spans and spans[0].turn == 1 and spans[0].role == "assistant"
            returned = []  # (arguments, result text) of every successful call, in the row's order
            for k, (span, text) in enumerate(zip(spans, texts)):
                if span.role != "tool":
                    continue
                assert spans[k - 1].role == "assistant" and spans[k - 1].turn == span.turn and span.kept == 0
                assert text.startswith("\n<|im_start|>user\n<tool_response>\n"), text
                assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"), text
                results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
                calls = _tool_calls(texts[k - 1])
                assert len(results) == len(calls) >= 1, (texts[k - 1], text)
                returned += [(call["arguments"], result) for call, result in zip(calls, results)
                             if "error" not in result]
            # the environment instance of this row logged exactly these calls and returned these values; a
            # last call whose result TRL dropped (it would pass max_completion_length) is in the log only
            logged = [(arguments, str(result)) for arguments, result in rollout["calls"][generation_row]]
            assert logged[:len(returned)] == returned and len(logged) - len(returned) in (0, 1), (logged, texts)
            results_seen += len(returned)
            # the reward is the environment's, from its own state
            assert data["rewards"][row].item() == pytest.approx(rollout["rewards"][generation_row], rel=1e-6)
        assert data["reward_components"].shape == (len(rows), 1)  # the environment is the only reward source
        assert bool((data["advantages"] != 0).any())
    assert results_seen >= 8


def test_checks_find_no_error(env_run):
    trace, _ = env_run
    errors = [f for f in run_checks(trace) if f.severity == ERROR]
    assert not errors, [(f.check, f.message) for f in errors]
