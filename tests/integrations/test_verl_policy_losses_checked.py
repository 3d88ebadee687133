"""verl's registered policy losses on verl 0.9.1's own worker path (CPU, tiny model; tests/integrations/
test_verl_configs.py's loop): each loss tracer models (vanilla with dual clip, gspo, cispo, gpg) is checked
per token on every worker step file (``recompute.per_token_loss`` runs on ``verl_pg_losses``, no finding); a loss
tracer does not model opens the report with "not checked: verl policy loss '<name>'" and
``--strict-coverage`` exits 1 on it; verl's vanilla loss run without its dual clip while ``clip_ratio_c`` is
the config's is an error naming the dual clip first.

Runs in the verl venv (``make test-verl``); skipped in the main venv, where verl is not installed.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("verl")
from verl.trainer.ppo import core_algos  # noqa: E402

import tracer.integrations.verl as tv  # noqa: E402
from tracer.checks import CheckOptions  # noqa: E402
from tracer.checks.context import StepContext  # noqa: E402
from tracer.checks.coverage import NOT_CHECKED  # noqa: E402
from tracer.checks.finding import CHECKS  # noqa: E402
from tracer.checks.runner import check_step  # noqa: E402
from tracer.cli import main  # noqa: E402
from tracer.read.reader import Trace  # noqa: E402

from tests.integrations.test_verl_configs import Case, run_case  # noqa: E402

CHECK = "recompute.per_token_loss"
MODELLED = {
    "vanilla": Case(actor={"clip_ratio_c": 1.05}),  # the dual clip binds at lr 0.5 (below)
    "gspo": Case(loss_mode="gspo", actor={"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
                                          "loss_agg_mode": "seq-mean-token-mean"}),
    "cispo": Case(loss_mode="cispo", actor={"clip_ratio_low": 1.0, "clip_ratio_high": 4.0}),
    "gpg": Case(loss_mode="gpg"),
}


def dual_clip_binds(workers: Trace, c: float) -> int:
    n = 0
    for key in workers.steps():
        d = workers.load_step(key)
        r = torch.exp(d["policy_logprobs"].double() - d["old_logprobs"].double())
        adv = d["token_advantages"] if "token_advantages" in d else d["advantages"].unsqueeze(1)
        n += int((d["completion_mask"].bool() & (adv < 0) & (r > c)).sum())
    return n


@pytest.mark.parametrize("loss_mode", sorted(MODELLED))
def test_each_modelled_policy_loss_is_checked_per_token_on_every_worker_file(traced, loss_mode):
    findings = run_case(MODELLED[loss_mode], traced)["joined"]
    workers = Trace(traced / "workers")
    assert workers.steps()
    for key in workers.steps():
        assert workers.metadata(key)["loss_mode"] == loss_mode
        result = check_step(StepContext(workers, key, CheckOptions()), [CHECKS[CHECK]])
        assert result.ran == [CHECK], result.skipped
        assert result.findings == []
    assert [f for f in findings if f.check == CHECK] == []
    assert [f for f in findings if f.check == NOT_CHECKED and "objective" in f.details] == []
    if loss_mode == "vanilla":
        assert dual_clip_binds(workers, 1.05) > 0  # the healthy run's loss holds the cap on some token


def test_a_policy_loss_tracer_does_not_model_is_said_not_checked(traced, capsys):
    findings = run_case(Case(loss_mode="clip_cov"), traced)["joined"]
    (note,) = [f for f in findings if f.check == NOT_CHECKED and "objective" in f.details]
    assert note.message.startswith("not checked: verl policy loss 'clip_cov' — tracer recomputes vanilla, gspo, "
                                   "cispo, gpg; the per-token loss of this one is not checked")
    capsys.readouterr()
    assert main(["check", str(traced / "joined"), "--strict-coverage"]) == 1


@pytest.fixture
def vanilla_without_dual_clip(monkeypatch):
    """verl's vanilla loss called with clip_ratio_c pushed out of reach (no dual clip) while the config it
    received, the one tracer records, keeps its own clip_ratio_c."""
    original = core_algos.POLICY_LOSS_REGISTRY["vanilla"]

    def vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        edited = copy.copy(config)
        object.__setattr__(edited, "clip_ratio_c", 1e9)
        return original(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, edited, rollout_is_weights)

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "vanilla", vanilla)
    monkeypatch.delitem(core_algos.POLICY_LOSS_REGISTRY, tv.PREFIX + "vanilla")
    tv.register_tracing_losses()  # tracer_vanilla now wraps the edited loss
    yield
    core_algos.POLICY_LOSS_REGISTRY.pop(tv.PREFIX + "vanilla", None)


def test_vanilla_loss_run_without_its_dual_clip_is_named(traced, vanilla_without_dual_clip, capsys):
    findings = run_case(MODELLED["vanilla"], traced)["joined"]
    workers = Trace(traced / "workers")
    assert dual_clip_binds(workers, 1.05) > 0
    errors = [f for f in findings if f.check == CHECK and f.severity == "error"]
    assert errors
    for f in errors:
        assert f.message.startswith("dual clip missing: the recorded pg_losses are the clipped surrogate without the "
                                    "dual clip, while clip_ratio_c = 1.05 is the config's"), f.message
    capsys.readouterr()
    assert main(["check", str(traced / "joined")]) == 1
