"""Zero-edit tracing of MiniMind's agentic loop (tests/scripts/minimind_agent.py, train_agent.py's
rollout_single / rl_train_epoch): each episode is packed into one row of `input_ids` [B, L] (prompt,
assistant turns, tool results) and the per-token tensors are [B, L-1], so the shipped name map reads the
token ids as the slice `input_ids[:, 1:]`. The script dumps its own tensors at each backward
(`--dump_dir`), which the trace must equal; the slice syntax of name maps is pinned on its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file

from tracer import Trace
from tracer.checks import ERROR, run_checks
from tracer.format.turns import infer_turn_ids
from tracer.zero_edit.frame_lookup import _MISSING, resolve_in
from tracer.zero_edit.name_maps import NameMapError, load_name_map, parse_expression
from tracer.zero_edit.watch import Watcher

from tests.fixtures.paths import SCRIPTS

SCRIPT = SCRIPTS / "minimind_agent.py"


@pytest.fixture(scope="module")
def agent_run(model_dir, tmp_path_factory):
    """`python -m tracer run --algo cispo` of the unmodified agent script: (trace dir, dump dir, stderr)."""
    root = tmp_path_factory.mktemp("agent")
    out, dump = root / "trace", root / "dump"
    proc = subprocess.run(
        [sys.executable, "-m", "tracer", "run", "--algo", "cispo", "--out", str(out),
         "--meta", "loss_reduction=sequence_mean", "--", str(SCRIPT), "--model_dir", str(model_dir),
         "--dump_dir", str(dump)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    return out, dump, proc.stderr


def _steps(out, dump):
    """(the step's recorded fields, the script's own tensors at that backward), in step order."""
    trace = Trace(out)
    keys = trace.steps()
    dumps = sorted(dump.glob("step_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
    assert len(keys) == len(dumps) == 2  # 4 prompts, batch_size 2: two steps of one backward each
    return [(trace.load_step(k, derive=False), load_file(str(p))) for k, p in zip(keys, dumps)]


def _kept_runs(keep: list[bool]) -> int:
    return sum(1 for t, k in enumerate(keep) if k and (t == 0 or not keep[t - 1]))


def test_the_script_holds_no_tracing_code_and_packs_as_minimind_does():
    source = SCRIPT.read_text()
    assert "tracer" not in source.split('"""', 2)[2]  # only its docstring names tracer
    for line in ("completion_mask = full_response_masks[:, 1:]",
                 "old_logps = [0.0] * max(len(p) - 1, 0) + old_lp",
                 "pairs = [(t, lp) for t, lp in zip(new_ids, new_logps) if t != tokenizer.pad_token_id and t != tokenizer.eos_token_id]",
                 "per_token_logps = F.log_softmax(logits, dim=-1).gather(2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)"):
        assert line in source


def test_completion_ids_are_the_packed_rows_shifted_by_one(agent_run):
    out, dump, stderr = agent_run
    assert "completion_ids <- input_ids[:, 1:]" in stderr and "token ids not captured" not in stderr
    assert Trace(out).manifest["config"]["field_sources"]["completion_ids"] == "input_ids[:, 1:]"
    for data, own in _steps(out, dump):
        B, L = own["input_ids"].shape
        assert data["completion_ids"].shape == (B, L - 1) and data["completion_ids"].dtype == torch.int64
        assert torch.equal(data["completion_ids"], own["input_ids"][:, 1:])


def test_logprobs_masks_rewards_are_the_loops_tensors(agent_run):
    out, dump, _ = agent_run
    pairs = {"policy_logprobs": "per_token_logps", "old_logprobs": "old_per_token_logps",
             "ref_logprobs": "ref_per_token_logps", "rewards": "rewards", "advantages": "advantages"}
    for data, own in _steps(out, dump):
        for field, name in pairs.items():
            assert torch.equal(data[field], own[name].float()), field
        assert data["completion_mask"].dtype == torch.bool
        assert torch.equal(data["completion_mask"], own["completion_mask"].bool())


def test_old_logprobs_are_the_rollouts_at_kept_tokens_and_zero_elsewhere(agent_run):
    # independent of the capture: the engine scored each turn in its own context, the trainer scores the
    # packed row; the weights are the same at both (the rollout runs just before the update), so the kept
    # tokens agree to float error, and the prompt / tool-result positions hold MiniMind's 0.0 placeholders
    out, dump, _ = agent_run
    for data, _ in _steps(out, dump):
        keep = data["completion_mask"]
        assert keep.any()
        diff = (data["policy_logprobs"] - data["old_logprobs"])[keep].abs().max()
        assert diff < 1e-4, diff
        assert (data["old_logprobs"][~keep] == 0).all()


def test_rows_are_packed_episodes_with_tool_results_between_turns(agent_run, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)  # as the script does
    out, dump, _ = agent_run
    turns_seen = set()
    for data, own in _steps(out, dump):
        ids, keep = data["completion_ids"], data["completion_mask"]
        turn_ids = infer_turn_ids(ids, keep, tokenizer.pad_token_id, tokenizer.eos_token_id)
        for b in range(ids.shape[0]):
            runs = _kept_runs(keep[b].tolist())
            turns_seen.add(runs)
            assert int(turn_ids[b].max()) == runs  # the reader finds the episode's assistant turns
            if runs > 1:  # a tool result, masked, between the first two kept runs
                first_gap_start = keep[b].tolist().index(False, keep[b].tolist().index(True))
                between = tokenizer.decode(ids[b, first_gap_start:].tolist())
                assert '<|im_start|>tool\n{"result": ' in between
    assert {1, 2} <= turns_seen  # single-turn answers and tool-calling episodes (seed 0 also has 3-turn ones)


def test_tracer_check_finds_no_error_on_the_healthy_run(agent_run):
    # kl.k1_negative_step may warn at step 2: the engine's forced tool-call tokens were not sampled from the
    # policy (step 1 lowered their logprobs), which is what that warning is about; no check may call it an error
    out, _, _ = agent_run
    errors = [f for f in run_checks(out) if f.severity == ERROR]
    assert errors == []


@pytest.mark.parametrize("bug, check, says", [
    ("tool_output_in_mask", "turns.tool_output_trained", "the tool span at tokens"),
    ("first_turn_only", "turns.untrained_turn", "none of its"),
    ("turn_shift", "turns.turn_shift", "fit policy_logprobs shifted by +1"),
])
def test_an_agentic_bug_in_the_unmodified_loop_is_named_with_its_turn(model_dir, tmp_path, bug, check, says):
    out = tmp_path / bug
    proc = subprocess.run(
        [sys.executable, "-m", "tracer", "run", "--algo", "cispo", "--out", str(out), "--meta",
         "loss_reduction=sequence_mean", "--", str(SCRIPT), "--model_dir", str(model_dir), "--inject", bug],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    findings = run_checks(out)
    named = [f for f in findings if f.check == check and f.severity == ERROR]
    assert named and says in named[0].message and f"turn {named[0].details['turn']}" in named[0].message
    assert named[0].details["turn"] >= 1


def test_a_run_without_token_ids_says_so_with_the_fix(tmp_path, caplog):
    name_map = {"extends": "", "fields": {"policy_logprobs": ["per_token_logps"],
                                          "completion_mask": ["completion_mask"]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Watcher("grpo", tmp_path / "t", name_map) as watcher:
            weight = torch.nn.Parameter(torch.zeros(2, 4, 5))
            input_ids = torch.tensor([[3, 1, 2, 3, 4], [3, 4, 2, 0, 0]])  # noqa: F841  (unmapped: no ids)
            completion_mask = torch.tensor([[True, True, False, True], [True, True, False, False]])
            per_token_logps = weight.log_softmax(-1)[..., 0]
            (per_token_logps * completion_mask).sum().backward()
    lines = watcher.summary_lines()
    assert lines[1] == (
        "tracer: token ids not captured: the map names no variable for completion_ids, so `tracer check` skips "
        "every check that reads them (EOS and padding masks, the "
        "completion's start, turns of packed rows) and no token text is shown. Fix: map completion_ids to them, "
        "e.g. `completion_ids = [\"input_ids[:, 1:]\"]` (a packed row [B, L] whose logprobs are [B, L-1]) under "
        "[fields] in a name map passed with --map FILE (tracer.watch(name_map=FILE))")


# -- the slice syntax of name maps ------------------------------------------------------------------

def test_slices_parse_with_offsets_and_read_views_of_the_variable():
    x = torch.arange(2 * 6).reshape(2, 6)  # [[0..5], [6..11]]
    scope = {"x": x, "obj": type("O", (), {"ids": x})()}
    cases = {
        "x[:, 1:]": x[:, 1:],
        "x[:, :-1]": x[:, :-1],
        "x[..., 2:-1]": x[..., 2:-1],
        "x[1:, ::2]": x[1:, ::2],
        "x[ : , -3 : ]": x[:, -3:],
        "obj.ids[:, 1:]": x[:, 1:],
    }
    for text, expected in cases.items():
        value = resolve_in(parse_expression(text, "test"), scope, {})
        assert torch.equal(value, expected), text
        assert value.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view, not a copy
    assert parse_expression("x[:, 1:]", "t").slices == ((None, None, None), (1, None, None))
    assert parse_expression("x[-4:-1:2]", "t").slices == ((-4, -1, 2),)
    assert parse_expression("x[inds]", "t").index == "inds"  # a name is still a row index
    # more slices than dimensions, no tensor, or no such variable: no value (the candidate is passed over)
    assert resolve_in(parse_expression("x[:, :, 1:]", "t"), scope, {}) is _MISSING
    assert resolve_in(parse_expression("y[:, 1:]", "t"), {"y": [[1, 2]]}, {}) is _MISSING
    assert resolve_in(parse_expression("z[:, 1:]", "t"), scope, {}) is _MISSING


@pytest.mark.parametrize("entry, why", [
    ("input_ids[:, 1]", r"'1' is not a slice; a subscript is one row-index variable"),
    ("input_ids[:, a+1:]", r"'a\+1:' is not a slice"),
    ("input_ids[::-1]", r"slice step -1 in '::-1'; tensors take positive steps only"),
    ("input_ids[..., ...]", r"has more than one `...`"),
    ("input_ids[:, 1:]]", r"is not a variable expression"),
])
def test_a_bad_slice_is_refused_naming_the_map_entry(entry, why):
    with pytest.raises(NameMapError, match=rf"^name map dict \[fields\] completion_ids: {re.escape(repr(entry))}.*{why}"):
        load_name_map({"fields": {"completion_ids": [entry]}}, "grpo")


def test_a_sliced_candidate_is_replayed_by_the_call_sites_plan(tmp_path):
    name_map = {"fields": {"completion_ids": ["input_ids[:, 1:]"]}}
    with Watcher("grpo", tmp_path / "t", name_map) as watcher:
        watcher.plan_differences = []
        weight = torch.nn.Parameter(torch.zeros(2, 4, 8))
        for step in range(3):
            input_ids = torch.tensor([[3, 1, 2, 3, 4], [3, 4, 2, 1, 0]]) + step
            completion_mask = input_ids[:, 1:] != 0
            per_token_logps = weight.log_softmax(-1).gather(2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            (per_token_logps * completion_mask).sum().backward()
    assert watcher.plan_differences == [] and watcher.plans.hits == 2
    trace = Trace(tmp_path / "t")
    for k in trace.steps():
        expected = torch.tensor([[1, 2, 3, 4], [4, 2, 1, 0]]) + k.step
        assert torch.equal(trace.load_step(k)["completion_ids"], expected)
