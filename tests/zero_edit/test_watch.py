"""Zero-edit tracing (``tracer run``, ``tracer.watch``): unmodified seed-style scripts in
tests/scripts/ are traced by name at each backward, and their traces equal the explicit-API traces
of the demo loops they mirror (same seed, same random draws)."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import tracer
from tracer import Trace, TraceError
from tracer.cli import main as cli_main
from tracer.demo import dpo_loop, grpo_loop, ppo_loop
from tracer.zero_edit.name_maps import NameMapError, load_name_map
from tracer.testing import assert_traces_match
from tracer.zero_edit.step_clock import StepClock

from tests.fixtures.loops import tiny_loop
from tests.fixtures.paths import SCRIPTS

REWARD_NAMES = json.dumps(["accuracy", "length", "scorer"])
# step metadata the demo loops write that a script's frame cannot tell (given with --meta below where it can)
NOT_IN_FRAME = ["top_p", "top_k", "old_logprobs_source", "advantage_rule"]


@pytest.fixture(scope="module")
def demo_traces(model_dir, tmp_path_factory):
    """Explicit-API traces of the demo loops (PPO without early stop: a stopped minibatch never
    reaches backward, so a zero-edit trace cannot hold it)."""
    root = tmp_path_factory.mktemp("demo")
    return {
        "ppo": ppo_loop.run(root / "ppo", ppo_loop.PPOConfig(steps=2, target_kl=1e9), model_dir),
        "grpo": grpo_loop.run(root / "grpo", grpo_loop.GRPOConfig(steps=2), model_dir),
        "cispo": grpo_loop.run(root / "cispo", grpo_loop.GRPOConfig(loss_type="cispo", steps=2), model_dir),
        "dpo": dpo_loop.run(root / "dpo", dpo_loop.DPOConfig(steps=2), model_dir),
    }


def common_fields(a, b):
    ta, tb = Trace(a), Trace(b)
    return sorted(set(ta.fields(ta.steps()[0])) & set(tb.fields(tb.steps()[0])))


SCRIPT_RUNS = {  # algo: (script, its extra argv, --meta the frame cannot give, metadata ignored)
    "ppo": ("minimind_ppo.py", ["--target_kl", "1e9"], ["loss_reduction=token_mean"], []),
    "grpo": ("minimind_grpo.py", [], ["loss_reduction=sequence_mean"], []),
    # the demo stores CISPO's bound as clip_epsilon_high = bound - 1; MiniMind's args give cispo_epsilon_high
    "cispo": ("minimind_grpo.py", ["--loss_type", "cispo"], ["loss_reduction=sequence_mean"], ["clip_epsilon_high"]),
    "dpo": ("minimind_dpo.py", [], ["loss_reduction=sequence_mean"], []),
}


@pytest.mark.parametrize("algo", list(SCRIPT_RUNS))
def test_tracer_run_traces_an_unmodified_script_like_the_explicit_api(algo, model_dir, demo_traces, tmp_path, capsys):
    script, argv, meta, ignored = SCRIPT_RUNS[algo]
    source = (SCRIPTS / script).read_text()
    assert "Tracer(" not in source and "watch" not in source and ".record(" not in source  # no tracing code
    out = tmp_path / algo
    meta_args = [a for m in [*meta, f"reward_component_names={REWARD_NAMES}"] for a in ("--meta", m)]
    code = cli_main(["run", "--algo", algo, "--out", str(out), *meta_args, "--",
                     str(SCRIPTS / script), "--model_dir", str(model_dir), *argv])
    assert code == 0
    assert "tracer: traced" in capsys.readouterr().err
    fields = common_fields(demo_traces[algo], out)
    expected_fields = {"dpo": {"chosen_policy_logprobs", "rejected_ref_logprobs", "chosen_mask", "dpo_logits", "loss"},
                       "ppo": {"policy_logprobs", "old_logprobs", "values", "returns", "advantages", "row_ids",
                               "ratio", "ref_kl_k3", "approx_kl_k2", "loss"}}
    assert expected_fields.get(algo, {"policy_logprobs", "old_logprobs", "ref_logprobs", "ratio", "ref_kl_k3",
                                      "advantages", "group_ids", "rewards", "completion_mask"}) <= set(fields)
    if algo == "dpo":  # DPO metadata: the demo has no reward components
        ignored = [*ignored, "reward_component_names"]
    assert_traces_match(out, demo_traces[algo], fields=fields, ignore_metadata=NOT_IN_FRAME + ignored)
    assert Trace(out).status == "finished"


def test_user_map_traces_a_loop_with_other_names(model_dir, demo_traces, tmp_path):
    out = tmp_path / "custom"
    code = cli_main(["run", "--algo", "grpo", "--out", str(out), "--map", str(SCRIPTS / "custom_names.toml"),
                     "--", str(SCRIPTS / "custom_names_grpo.py"), "--model_dir", str(model_dir)])
    assert code == 0
    trace = Trace(out)
    assert trace.manifest["config"]["field_sources"]["policy_logprobs"] == "logp_new"
    assert trace.manifest["config"]["group_size"] == 4  # the script's argparse Namespace, kept as config
    assert [(k.step, k.inner_step) for k in trace.steps()] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # update, sweep
    fields = common_fields(demo_traces["grpo"], out)
    assert {"policy_logprobs", "old_logprobs", "ref_logprobs", "group_ids", "per_token_loss", "loss"} <= set(fields)
    assert_traces_match(out, demo_traces["grpo"], fields=fields,
                        ignore_metadata=NOT_IN_FRAME + ["loss_reduction", "reward_component_names", "temperature"])


def test_a_bad_map_is_refused_before_the_script_runs(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[fields]\nlogp = ["logp_new"]\n')
    code = cli_main(["run", "--algo", "grpo", "--out", str(tmp_path / "t"), "--map", str(bad), "--",
                     str(SCRIPTS / "eval_only.py")])
    assert code == 2
    assert "[fields] has unknown key 'logp'; canonical fields are listed in tracer/format/schema.py" in capsys.readouterr().err
    with pytest.raises(NameMapError, match=r"'old_resp_logp\[inds\]\]' is not a variable expression"):
        load_name_map({"fields": {"old_logprobs": ["old_resp_logp[inds]]"]}})


def test_a_script_that_never_calls_backward_gets_a_clear_message(model_dir, tmp_path, capsys):
    out = tmp_path / "t"
    assert cli_main(["run", "--algo", "grpo", "--out", str(out), "--", str(SCRIPTS / "eval_only.py"),
                     "--model_dir", str(model_dir)]) == 3
    err = capsys.readouterr().err
    assert "nothing was traced: the code never called backward()" in err
    assert f"no trace was written to {out}" in err and not out.exists()
    # backward without RL tensors in the frame: the message names what was looked for and what was there
    assert cli_main(["run", "--algo", "grpo", "--out", str(out), "--", str(SCRIPTS / "eval_only.py"),
                     "--model_dir", str(model_dir), "--sft"]) == 3
    err = capsys.readouterr().err
    assert "backward() ran 1 time(s), but no calling frame held the policy logprobs" in err
    assert "eval_only.py:16 in evaluate(), tensor variables ['input_ids [1, 7]']" in err and not out.exists()
    # the script's own exit code wins
    assert cli_main(["run", "--algo", "grpo", "--out", str(out), "--", str(SCRIPTS / "eval_only.py"),
                     "--model_dir", str(model_dir), "--exit_code", "5"]) == 5


def test_a_script_that_raises_keeps_exit_code_traceback_and_the_steps_before(model_dir, tmp_path):
    out = tmp_path / "t"
    proc = subprocess.run(
        [sys.executable, "-m", "tracer", "run", "--algo", "grpo", "--out", str(out), "--",
         str(SCRIPTS / "minimind_grpo.py"), "--model_dir", str(model_dir), "--crash_at_step", "1"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("Traceback (most recent call last):") == 1
    tb = proc.stderr[proc.stderr.index("Traceback"):]
    assert 'minimind_grpo.py", line' in tb.splitlines()[1]  # starts at the script, as `python SCRIPT` does
    assert "runpy" not in tb and "RuntimeError: reward server went away at step 1" in tb
    assert "tracer: traced 2 step file(s)" in proc.stderr
    trace = Trace(out)
    assert [(k.step, k.inner_step) for k in trace.steps()] == [(0, 0), (0, 1)]
    # the script's exception ended the run: the trace says crashed, with it and the last step recorded
    assert trace.status == "crashed"
    ended = trace.manifest["ended"]
    assert (ended["exception"], ended["message"], ended["last_step"]) == (
        "RuntimeError", "reward server went away at step 1", 0)


def test_watch_from_python_equals_the_explicit_api_in_the_same_run(model_dir, tmp_path):
    """grpo_loop.train records through tracer.Tracer; tracer.watch reads the same frame at backward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = grpo_loop.GRPOConfig(steps=2)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir).eval().requires_grad_(False)
    demo_names = {"fields": {"old_logprobs": ["batch.old_logprobs"], "completion_mask": ["batch.completion_mask"],
                             "completion_ids": ["batch.completion_ids"], "group_ids": ["batch.group_ids"],
                             "reward_components": ["components"]},
                  "indices": {"inner_step": ["inner"]}, "metadata": {"num_generations": ["cfg.num_generations"]}}
    original = torch.Tensor.backward
    with tracer.Tracer(tmp_path / "explicit", algorithm="grpo", tokenizer=tokenizer) as tr:
        with tracer.watch(algo="grpo", out=tmp_path / "watched", name_map=demo_names) as w:
            assert torch.Tensor.backward is not original
            grpo_loop.train(model, ref_model, tokenizer, cfg, tr)
    assert torch.Tensor.backward is original and torch.autograd.backward.__name__ == "backward"
    assert (w.backward_calls, w.steps_recorded) == (4, 4)
    fields = common_fields(tmp_path / "explicit", tmp_path / "watched")
    assert {"policy_logprobs", "old_logprobs", "ref_logprobs", "reward_components", "per_token_loss"} <= set(fields)
    assert_traces_match(tmp_path / "watched", tmp_path / "explicit", fields=fields, atol=0, rtol=0,
                        ignore_metadata=["num_generations"])
    assert Trace(tmp_path / "watched").tokens is not None  # the frame's tokenizer


def test_watch_numbers_steps_dedupes_repeats_and_warns_when_nothing_is_traced(tmp_path):
    with tracer.watch(algo="grpo", out=tmp_path / "w") as w:
        tiny_loop(steps=3, second_backward=True)
    assert (w.backward_calls, w.steps_recorded, w.repeated_calls) == (6, 3, 3)
    trace = Trace(tmp_path / "w")
    assert [k.step for k in trace.steps()] == [0, 1, 2]  # no step variable: every new backward is a step
    assert trace.load_step(trace.steps()[0])["completion_mask"].tolist() == [[True] * 3, [True, False, False]]
    with pytest.warns(RuntimeWarning, match="nothing was traced: the code never called backward"):
        with tracer.watch(algo="grpo", out=tmp_path / "empty"):
            pass
    assert not (tmp_path / "empty").exists()


def test_a_failed_capture_never_stops_training_unless_strict(tmp_path):
    blocker = tmp_path / "a_file"  # the trace directory cannot be created: every capture fails
    blocker.write_text("")
    # the warning names the loop's own backward line (tiny_loop's, in tests/fixtures/loops.py), not tracer's
    with pytest.warns(RuntimeWarning, match=r"step not traced \(\d so far\): backward at .*fixtures/loops\.py:\d+"):
        with tracer.watch(algo="grpo", out=blocker, nothing_traced="ignore") as w:
            tiny_loop(steps=2)
    assert (w.failures, w.steps_recorded) == (2, 0)
    with pytest.raises(TraceError, match="tracer.watch: backward at"):
        with tracer.watch(algo="grpo", out=blocker, strict=True):
            tiny_loop(steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TraceError, match="already active"):
            with tracer.watch(algo="grpo", out=tmp_path / "a"), tracer.watch(algo="grpo", out=tmp_path / "b"):
                pass


def test_step_clock():
    clock = StepClock()
    # MiniMind: `step` restarts every data epoch; minibatches numbered by the clock within (step, ppo_epoch)
    keys = [clock.key(i) for i in [{"step": 1, "inner_step": 0}, {"step": 1, "inner_step": 0},
                                   {"step": 1, "inner_step": 1}, {"step": 2}, {"step": 1}]]
    assert keys == [(1, 0, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0), (3, 0, 0)] and clock.offset == 2
    clock = StepClock()  # no step variable: a new step when (inner_step, micro_batch) does not advance
    keys = [clock.key(i) for i in [{"inner_step": 0}, {"inner_step": 1}, {"inner_step": 0}, {"inner_step": 0}]]
    assert keys == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (2, 0, 0)]


def test_pauses_nest_and_a_watcher_ended_during_a_pause_stays_off(tmp_path):
    import tracer

    weight = torch.nn.Parameter(torch.zeros(3))

    def train_step():
        policy_logprobs = torch.log_softmax(weight.expand(2, 3), dim=-1)
        completion_mask = torch.ones(2, 3, dtype=torch.bool)
        (-(policy_logprobs * completion_mask).mean()).backward()
        return completion_mask

    original = torch.Tensor.backward
    with tracer.watch(algo="grpo", out=tmp_path / "run", nothing_traced="ignore") as w:
        train_step()
        with w.paused():  # an evaluation helper that pauses, called inside a paused probe
            with w.paused():
                train_step()
            assert torch.Tensor.backward is original  # leaving the inner pause does not resume tracing
            train_step()
        train_step()
    assert w.steps_recorded == 2 and w.backward_calls == 2
    assert torch.Tensor.backward is original

    other = tracer.watch(algo="grpo", out=tmp_path / "other", nothing_traced="ignore")
    other.__enter__()
    pause = other.paused()
    pause.__enter__()
    other.__exit__(None, None, None)  # the watcher's block ends inside the pause
    pause.__exit__(None, None, None)
    assert torch.Tensor.backward is original, "a finished watcher was put back on backward"
