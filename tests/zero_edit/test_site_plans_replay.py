"""Call-site plans (tracer/zero_edit/site_plans.py) on inputs where a plan's replay could give another
capture than the full read: a stacked candidate read on one side from its own variable, a seeded loop
whose frame changes at random between backwards, one backward line reached from frames of many kinds
(helpers, class loops, recursion, generators, lambdas), a loop with its own name map. (The f_locals
release: test_locals_release.py.)

Each test runs its loop twice (tests/fixtures/site_plans.py's ``assert_same_runs``): with plans,
every plan's capture also compared with a full read of the same frame, and with plans off. Both traces,
capture reports and warnings must be equal, and the values asserted are worked out by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tracer import Trace

from tests.fixtures.paths import SCRIPTS
from tests.fixtures.site_plans import assert_same_runs, run_in


# -- DPO: a stacked candidate of which one side was read from its own variable ---------------------

def dpo_half_masks(masks: list[str]) -> None:
    """A DPO loop with ``mask_chosen`` (bool) but no ``mask_rejected``: the rejected side's mask comes
    from the stacked float ``mask`` (rows ``[chosen; rejected]``), whose chosen half the full read never
    checks (chosen_mask is read already). ``masks[step]``: which half of ``mask`` holds a 0.5."""
    weight = torch.nn.Parameter(torch.zeros(4, 3, 5))
    mask_chosen = torch.tensor([[True, True, False]] * 2)
    for step, bad in enumerate(masks):
        policy_log_probs = weight.log_softmax(-1)[..., 0]  # [2 pairs stacked, T=3]
        ref_log_probs = policy_log_probs.detach() - 0.1
        mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
        mask[0 if bad == "chosen" else 2, 0] = 0.5
        loss = -(policy_log_probs * mask).sum()
        loss.backward()
        assert ref_log_probs is not None and mask_chosen is not None


def test_a_stacked_candidate_is_value_checked_on_the_rows_the_full_read_checks(tmp_path):
    """Step 0: ``mask``'s rejected half holds 0.5: refused, and chosen_mask (from mask_chosen) then
    lacks its other side. Steps 1-2: its *chosen* half holds 0.5, which the full read does not look at
    (chosen_mask came from mask_chosen): rejected_mask is read from ``mask``. A replay of step 0's plan
    must not check the chosen half (it did, and refused rejected_mask, dropping both masks)."""
    order = ["rejected", "chosen", "chosen", "rejected"]
    planned = assert_same_runs(lambda w: run_in(w, lambda: dpo_half_masks(order)), tmp_path, algo="dpo",
                                hyperparameters={"beta": 0.1})
    trace = Trace(tmp_path / "planned")
    keys = trace.steps()
    has_masks = [{"chosen_mask", "rejected_mask"} <= set(trace.fields(k)) for k in keys]
    assert has_masks == [False, True, True, False]
    step1 = trace.load_step(keys[1])
    assert step1["chosen_mask"].tolist() == [[True, True, False]] * 2
    assert step1["rejected_mask"].tolist() == [[True, True, False]] * 2  # mask[2:] != 0
    assert "dpo_loss" in step1 and "dpo_loss" not in trace.load_step(keys[0])  # the DPO terms need both masks
    assert planned.plans.hits == 2  # step 2 by step 1's plan, step 3 by step 0's


# -- a seeded loop whose frame changes at random between backwards -----------------------------

ABSENT = object()
ROWS, T = 6, 4


def _tensor(kind: str, rows: int) -> object:
    return {"absent": ABSENT, "none": None, "list": [0.0] * rows, "t": -torch.rand(rows, T),
            "f64": -torch.rand(rows, T, dtype=torch.float64), "short": -torch.rand(rows, T - 1),
            "view": (-torch.rand(T, rows)).t(), "param": torch.nn.Parameter(-torch.rand(rows, T)),
            "1d": -torch.rand(rows)}[kind]


def _mask(kind: str, rows: int) -> object:
    base = torch.ones(rows, T)
    base[:, -1] = 0
    bad_first, bad_last = base.clone(), base.clone()
    bad_first[0, 0] = bad_last[-1, 0] = 0.5
    return {"absent": ABSENT, "bool": base.bool(), "f01": base, "i01": base.long(), "bad_first": bad_first,
            "bad_last": bad_last, "short": base[:, :-1].bool()}[kind]


def _index(kind: str, B: int) -> object:
    return {"absent": ABSENT, "t": torch.randperm(ROWS)[:B], "bool": torch.ones(ROWS, dtype=torch.bool),
            "list": list(range(B)), "np": np.arange(B), "out_of_range": torch.tensor([0] * (B - 1) + [99]),
            "float": torch.arange(B).float(), "i32": torch.arange(B, dtype=torch.int32)}[kind]


CHOICES = {
    "ppo": {"old_resp_logp": ["absent", "t", "none", "list", "f64", "short", "view", "param", "1d"],
            "old_per_token_logps": ["absent", "t", "f64", "short"], "ratio": ["absent", "t", "1d"],
            "advantages": ["absent", "t", "1d"], "mb_resp_logp": ["absent", "absent", "t"],
            "completion_mask": ["absent", "bool", "f01", "i01", "bad_first", "short"],
            "resp_policy_mask": ["absent", "absent", "bool", "f01", "bad_last"],
            "inds": ["absent", "t", "t", "bool", "list", "np", "out_of_range", "float", "i32"],
            "whole": [True, False], "B": [3, 3, 2]},
    "dpo": {"mask": ["absent", "bool", "f01", "bad_first", "bad_last", "short"],
            "mask_chosen": ["absent", "bool", "f01", "bad_first", "short"],
            "mask_rejected": ["absent", "absent", "bool", "f01", "bad_last"],
            "ref_log_probs": ["absent", "t", "odd"], "y": ["absent", "t", "float"], "B": [2, 2, 3]},
}
VALUE_KINDS = ("f01", "bad_first", "bad_last")


def schedule(algo: str, seed: int, steps: int = 12) -> list[dict]:
    """``steps`` frames drawn from three kinds, a float mask's values redrawn now and then (so plans are
    replayed, and the value checks flip)."""
    rng = random.Random(seed)
    pool = [{k: rng.choice(v) for k, v in CHOICES[algo].items()} for _ in range(3)]
    out = []
    for _ in range(steps):
        s = dict(rng.choice(pool))
        for k, v in s.items():
            if v in VALUE_KINDS and rng.random() < 0.5:
                s[k] = rng.choice(VALUE_KINDS)
        out.append(s)
    return out


def random_ppo_loop(plan: list[dict]) -> None:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(ROWS, T, 5))
    for s in plan:
        B = s["B"]
        rows = ROWS if s["whole"] else B  # a whole-rollout tensor, read at `inds`, or the minibatch's own
        per_token_logps = weight[:B].log_softmax(-1)[..., 0]
        inds = _index(s["inds"], B)
        old_resp_logp = _tensor(s["old_resp_logp"], rows)
        old_per_token_logps = _tensor(s["old_per_token_logps"], B)
        ratio, advantages = _tensor(s["ratio"], B), _tensor(s["advantages"], B)
        mb_resp_logp = per_token_logps * 1.0 if s["mb_resp_logp"] == "t" else ABSENT
        completion_mask, resp_policy_mask = _mask(s["completion_mask"], rows), _mask(s["resp_policy_mask"], B)
        if inds is ABSENT:
            del inds
        if old_resp_logp is ABSENT:
            del old_resp_logp
        if old_per_token_logps is ABSENT:
            del old_per_token_logps
        if ratio is ABSENT:
            del ratio
        if advantages is ABSENT:
            del advantages
        if mb_resp_logp is ABSENT:
            del mb_resp_logp
        if completion_mask is ABSENT:
            del completion_mask
        if resp_policy_mask is ABSENT:
            del resp_policy_mask
        loss = per_token_logps.sum()
        loss.backward()


def random_dpo_loop(plan: list[dict]) -> None:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(ROWS, T, 5))
    for s in plan:
        B = s["B"]
        policy_log_probs = weight[:2 * B].log_softmax(-1)[..., 0]
        mask = _mask(s["mask"], 2 * B)
        mask_chosen, mask_rejected = _mask(s["mask_chosen"], B), _mask(s["mask_rejected"], B)
        ref_log_probs = {"absent": ABSENT, "t": -torch.rand(2 * B, T), "odd": -torch.rand(2 * B + 1, T)}[s["ref_log_probs"]]
        y = {"absent": ABSENT, "t": torch.randint(0, 5, (2 * B, T)), "float": torch.rand(2 * B, T)}[s["y"]]
        if mask is ABSENT:
            del mask
        if mask_chosen is ABSENT:
            del mask_chosen
        if mask_rejected is ABSENT:
            del mask_rejected
        if ref_log_probs is ABSENT:
            del ref_log_probs
        if y is ABSENT:
            del y
        loss = policy_log_probs.sum()
        loss.backward()


@pytest.mark.parametrize("algo,seed", [("ppo", s) for s in (0, 3, 7, 11)] + [("dpo", s) for s in (16, 17, 28, 58)])
def test_a_frame_that_changes_at_random_is_captured_as_the_full_read_captures_it(algo, seed, tmp_path):
    loop = random_ppo_loop if algo == "ppo" else random_dpo_loop
    plan = schedule(algo, seed)
    assert_same_runs(lambda w: run_in(w, lambda: loop(plan)), tmp_path, algo=algo, hyperparameters={"beta": 0.1})


# -- one backward line reached from frames of many kinds ---------------------------------------

def train_step(per_token_logps, completion_mask, old_logps=None):
    """A helper both loops below call: its one backward line sees the caller's tensors by parameter."""
    if old_logps is None:
        del old_logps
    loss = -(per_token_logps * completion_mask).sum()
    loss.backward()


class Trainer:
    """A TRL-like class loop: ``training_step``'s code object is shared by the subclasses."""

    rows = 2

    def logps(self, weight):
        return weight[:self.rows].log_softmax(-1)[..., 0]

    def training_step(self, weight):
        per_token_logps = self.logps(weight)
        completion_mask = torch.ones_like(per_token_logps, dtype=torch.bool)
        torch.autograd.backward([(-per_token_logps * completion_mask).sum()])


class WideTrainer(Trainer):
    rows = 3


def recursive(weight, depth):
    """The same line at several recursion depths, with and without ``old_logps`` in the frame."""
    per_token_logps = weight[:depth].log_softmax(-1)[..., 0]
    if depth % 2:
        old_logps = per_token_logps.detach() + 0.0
    per_token_logps.sum().backward()
    if depth > 1:
        recursive(weight, depth - 1)


def generator_loop(weight, steps):
    for i in range(steps):  # no step / micro_batch index anywhere: every recorded backward is a step of its own
        per_token_logps = weight[:2].log_softmax(-1)[..., 0]
        for _ in range(2):  # gradient accumulation: two backwards from one line, one policy tensor
            (per_token_logps.sum() / 2).backward(retain_graph=True)
        yield i


def many_frames() -> None:
    """Every kind of frame above, twice over."""
    weight = torch.nn.Parameter(torch.zeros(4, 3, 5))
    for _ in range(2):
        for B in (2, 3):
            logp = weight[:B].log_softmax(-1)[..., 0]
            train_step(logp, torch.ones(B, 3), old_logps=logp.detach() if B == 3 else None)
        for trainer in (Trainer(), WideTrainer(), Trainer()):
            trainer.training_step(weight)
        recursive(weight, 3)
        for _ in generator_loop(weight, 2):
            pass
        per_token_logps = weight[:1].log_softmax(-1)[..., 0]
        closure = lambda: per_token_logps.sum().backward()  # noqa: E731  (a lambda's frame: a free variable)
        closure()


def test_one_line_reached_from_many_kinds_of_frame_is_captured_as_the_full_read_captures_it(tmp_path):
    planned = assert_same_runs(lambda w: run_in(w, many_frames), tmp_path, algo="grpo")
    trace = Trace(tmp_path / "planned")
    keys = trace.steps()
    # the policy rows of each backward: train_step (2, 3), the trainers (2, 3, 2), recursion (3, 2, 1), the
    # generator (2, 2: each step's second backward is the same policy tensor, not recorded again), the lambda
    assert [trace.load_step(k)["policy_logprobs"].shape[0] for k in keys] == [2, 3, 2, 3, 2, 3, 2, 1, 2, 2, 1] * 2
    assert planned.repeated_calls == 4
    # old_logprobs where the frame holds them: train_step with B = 3, recursive at depths 3 and 1
    with_old = [i for i, k in enumerate(keys) if "old_logprobs" in trace.fields(k)]
    assert with_old == [i + o for o in (0, 11) for i in (1, 5, 7)]


def test_plans_give_what_the_full_read_gives_on_a_loop_with_its_own_map(tmp_path):
    """The custom-names GRPO script (``--map custom_names.toml``: attribute and indexed expressions of
    its own), as a baseline beside the MiniMind scripts of tests/zero_edit/test_site_plans.py."""
    import contextlib
    import io

    from tracer.demo.tiny_model import build_tiny_model
    from tracer.zero_edit.script_runner import run_script

    scripts = SCRIPTS
    model_dir = build_tiny_model(tmp_path / "model", seed=0)

    def run(watcher):
        with contextlib.redirect_stdout(io.StringIO()):
            assert run_script(scripts / "custom_names_grpo.py", ["--model_dir", str(model_dir)], watcher) == 0

    planned = assert_same_runs(run, tmp_path, algo="grpo", name_map=scripts / "custom_names.toml")
    assert planned.steps_recorded == 4 and planned.report()["fields_mapped"]["policy_logprobs"] == "logp_new"
