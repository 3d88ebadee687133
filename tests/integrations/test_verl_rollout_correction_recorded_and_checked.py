"""verl's rollout correction (``algorithm.rollout_correction``: ``rollout_is``, ``rollout_is_threshold``,
``rollout_is_batch_normalize``, ``rollout_rs_threshold``) is recorded as it ran on the driver's
rollout files, whose hyperparameters the joined trace carries to the worker files whose policy loss
received ``rollout_is_weights``: sampler.is_weights runs there (info), and a verl run with the correction
on no longer opens with "not checked: importance-sampling correction". Run through verl 0.9.1's own functions (tests/integrations/test_verl_configs.py's
``run_case``, in the order of ``RayPPOTrainer.fit``); needs .venv-verl (``make test-verl``)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

from tests.integrations.test_verl_configs import Case, run_case  # noqa: E402
from tracer.checks.coverage import NOT_CHECKED  # noqa: E402
from tracer.read.reader import Trace  # noqa: E402

# rollout_is_batch_normalize = True is recorded too (_rollout_correction), but left out here: verl divides by the
# mean weight of the whole batch, and sampler.is_weights recomputes it over a worker's micro-batch (a known gap)
CORRECTIONS = {
    "token-tis": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "sequence-rs": {"rollout_is": "sequence", "rollout_is_threshold": 3.0,
                    "rollout_rs": "seq_max_k2", "rollout_rs_threshold": 2e-4},
}


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_rollout_correction_settings_are_recorded_and_the_run_is_not_said_unchecked(traced, name):
    settings = CORRECTIONS[name]
    findings = run_case(Case(rollout_correction=settings), traced)
    workers = Trace(traced / "workers")
    assert workers.steps() and all("rollout_is_weights" in workers.load_step(k) for k in workers.steps())
    rollout = Trace(traced / "rollout")
    joined = Trace(traced / "joined")  # the driver's settings reach the worker files through the manifest
    for meta in [rollout.metadata(k) for k in rollout.steps()] + [joined.manifest["hyperparameters"]]:
        assert meta["rollout_is"] == settings["rollout_is"]
        assert float(meta["rollout_is_threshold"]) == settings["rollout_is_threshold"]
        assert meta["rollout_is_batch_normalize"] is settings.get("rollout_is_batch_normalize", False)
        assert meta.get("rollout_rs_threshold") == settings.get("rollout_rs_threshold")
    ran = [f for f in findings["joined"] if f.check == "sampler.is_weights"]
    assert ran and all(f.severity == "info" for f in ran), [f.message[:200] for f in ran]
    notes = [f.message for kind in ("joined", "rollout") for f in findings[kind] if f.check == NOT_CHECKED]
    assert not [m for m in notes if "importance-sampling" in m], notes
