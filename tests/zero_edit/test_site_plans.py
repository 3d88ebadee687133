"""Call-site plans of zero-edit capture (tracer/zero_edit/site_plans.py): a backward from a call site seen
before is read by the plan of its first read, and that gives exactly what the full read gives.

Each run below is made twice: with plans, every plan's capture also compared with a full read of the
same frame (``Watcher.plan_differences``), and with plans switched off (every frame read in full, as
before plans existed). The two traces must be equal bit for bit, with the same capture report and
the same warnings."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import tracer
from tracer import Trace
from tracer.zero_edit.name_maps import load_name_map
from tracer.zero_edit.script_runner import run_script

from tests.fixtures.paths import SCRIPTS
from tests.fixtures.site_plans import assert_same_runs, run_in


SCRIPT_RUNS = {  # algo: (script, argv)
    "ppo": ("minimind_ppo.py", ["--target_kl", "1e9"]),
    "grpo": ("minimind_grpo.py", []),
    "dpo": ("minimind_dpo.py", []),
}


@pytest.mark.parametrize("algo", list(SCRIPT_RUNS))
def test_plans_give_what_the_full_read_gives_on_the_minimind_scripts(algo, model_dir, tmp_path):
    script, argv = SCRIPT_RUNS[algo]

    def run(watcher):
        with contextlib.redirect_stdout(io.StringIO()):
            assert run_script(SCRIPTS / script, ["--model_dir", str(model_dir), *argv], watcher) == 0

    planned = assert_same_runs(run, tmp_path, algo=algo)
    # one call site: its first backward is read in full, a later one by a plan unless the frame changed
    # (GRPO's completions are of another length T in its second step: a new plan); PPO's T is fixed
    plans = planned.plans
    assert plans.built == plans.misses + 1 and plans.hits + plans.built == planned.backward_calls
    assert plans.misses == 0 if algo == "ppo" else plans.hits >= 1


def changing_loop(steps: int = 9) -> None:
    """One backward line whose frame changes between calls: the batch size (a last, smaller batch),
    a name that appears (``ratio``) and goes, a candidate that stops being a tensor (``old_logprobs``),
    a float mask whose values a mask cannot hold (refused, then the next candidate is read), an index
    of another kind (``inds`` as a bool mask: ``ref_all[inds]`` is not read) and one out of range."""
    weight = torch.nn.Parameter(torch.zeros(6, 4, 5))
    ref_all = -torch.linspace(0.5, 3.0, 24).reshape(6, 4)
    completion_ids = torch.tensor([[1, 2, 3, 0]] * 6)
    for step in range(steps):
        B = 2 if step % 3 == 2 else 3
        per_token_logps = weight[:B].log_softmax(-1).gather(2, completion_ids[:B].unsqueeze(-1)).squeeze(-1)
        old_per_token_logps = per_token_logps.detach() - 0.01 * step
        old_logps = old_per_token_logps.clone()
        if step in (4, 5):
            old_per_token_logps = None  # not a tensor: the next candidate, old_logps, is read
        completion_mask = (completion_ids[:B] != 0).float()
        if step == 6:
            completion_mask = completion_mask * 0.5  # values a mask cannot hold: refused
        inds = torch.arange(B)
        if step == 7:
            inds = torch.ones(B, dtype=torch.bool)
        if step == 8:
            inds = torch.tensor([0, 1, 9])
        if step % 2:
            ratio = torch.exp(per_token_logps - old_logps).detach()
        elif "ratio" in locals():
            del ratio
        rewards = torch.arange(B, dtype=torch.float32)
        loss = -(per_token_logps * (completion_ids[:B] != 0)).mean()
        loss.backward()
        assert ref_all is not None and rewards is not None


CHANGING_MAP = {"fields": {"ref_logprobs": ["ref_all[inds]"]}}


def test_a_call_site_whose_frame_changes_falls_back_to_the_full_read(tmp_path):
    planned = assert_same_runs(lambda w: run_in(w, changing_loop), tmp_path, algo="grpo", name_map=CHANGING_MAP)
    # steps 1, 2 and 4-8 each change the frame (step 3 is step 1 again): read in full, a plan made
    assert (planned.plans.misses, planned.plans.built, planned.plans.hits) == (7, 8, 1)
    trace = Trace(tmp_path / "planned")
    keys = trace.steps()
    assert [trace.load_step(k)["policy_logprobs"].shape[0] for k in keys] == [3, 3, 2] * 3
    assert ["ref_logprobs" in trace.fields(k) for k in keys] == [True] * 7 + [False, False]  # inds: bool, out of range
    assert ["completion_mask" in trace.fields(k) for k in keys] == [True] * 6 + [False, True, True]
    assert any("0 and 1" in entry for entry in planned.report()["map_entries_unused"])
    assert trace.manifest["config"]["field_sources"]["completion_mask"] == "completion_mask[inds]"
    assert planned.report()["fields_mapped"]["completion_mask"] == "completion_mask"  # step 8: inds out of range
    assert trace.load_step(keys[4])["old_logprobs"].tolist() == trace.load_step(keys[4])["policy_logprobs"].sub(
        0.04).tolist()  # old_logps, read when old_per_token_logps is None


def test_a_new_name_map_is_not_read_by_the_old_plans(tmp_path):
    seen = []

    def loop(watcher):
        weight = torch.nn.Parameter(torch.zeros(2, 3))
        for step in range(4):
            if step == 2:
                watcher.name_map = load_name_map({"fields": {"policy_logprobs": ["logp_new"]}}, "grpo")
            logp_new = torch.log_softmax(weight, dim=-1) * 1.0
            per_token_logps = torch.log_softmax(weight, dim=-1)
            (per_token_logps.sum() + logp_new.sum()).backward()
            seen.append(dict(watcher.sources))

    def run(watcher):
        with watcher:
            loop(watcher)

    planned = assert_same_runs(run, tmp_path, algo="grpo")
    assert seen[1]["policy_logprobs"] == "per_token_logps" and seen[3]["policy_logprobs"] == "logp_new"
    assert planned.plans.built == 2 and planned.plans.hits == 2


def test_the_locals_snapshot_is_released_after_a_capture(tmp_path):
    """A tensor the loop drops after its backward is freed then, not kept until the next backward by the
    frame's f_locals dict that the capture read (CPython < 3.13 keeps that dict on the frame), unless
    the loop holds that dict itself (``locals()``): then it is left as it is."""
    import sys
    import weakref

    def loop(keep_locals: bool):
        weight = torch.nn.Parameter(torch.zeros(2, 3))
        kept = locals() if keep_locals else None
        per_token_logps = torch.log_softmax(weight, dim=-1)
        per_token_logps.sum().backward()
        alive = weakref.ref(per_token_logps)
        del per_token_logps
        return alive() is not None, kept

    with tracer.watch(algo="grpo", out=tmp_path / "a") as w:
        alive, _ = loop(False)
        _, kept = loop(True)
    assert w.steps_recorded == 2 and not alive
    if sys.version_info < (3, 13):
        assert "per_token_logps" in kept  # the loop's own locals() dict: not emptied


def test_a_loop_at_module_level_keeps_its_namespace(tmp_path):
    """A script whose loop is at module level: its frame's f_locals is the module's namespace, which
    is never emptied (only a function frame's snapshot is), and its call site gets a plan like any."""
    script = tmp_path / "flat_loop.py"
    script.write_text(
        "import torch\n"
        "weight = torch.nn.Parameter(torch.zeros(2, 3))\n"
        "completion_mask = torch.ones(2, 3, dtype=torch.bool)\n"
        "for step in range(3):\n"
        "    per_token_logps = torch.log_softmax(weight, dim=-1)\n"
        "    (-(per_token_logps * completion_mask).mean()).backward()\n"
        "    assert completion_mask.all() and per_token_logps.shape == (2, 3) and weight.grad is not None\n"
        "assert step == 2\n")

    def run(watcher):
        assert run_script(script, [], watcher) == 0

    planned = assert_same_runs(run, tmp_path, algo="grpo")
    assert (planned.steps_recorded, planned.plans.hits) == (3, 2)
