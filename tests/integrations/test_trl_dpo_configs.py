"""False-alarm sweep: `tracer check` on healthy runs of TRL's real DPOTrainer under valid DPOConfig
settings that tests/integrations/test_trl_dpo.py does not cover (other loss types, multi-loss mixes, precomputed
references, accumulation, truncation, length-desensitised sums, f-divergences, TR-DPO syncing).

A healthy, unmodified TRL run must yield no error or warning finding. Not covered because TRL 1.16's
DPOConfig has no such field (TypeError): ``rpo_alpha`` (its replacement, ``loss_type=["sigmoid",
"sft"]``, is in test_trl_dpo.py) and ``reference_free``."""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

import tracer  # noqa: E402
from tracer import Trace  # noqa: E402
from tracer.checks import INFO  # noqa: E402
from tracer.demo import dpo_trl  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:The `'keep_end'` truncation mode is deprecated:FutureWarning")]

# A prompt is 5 tokens ("6 + 6 =") and a completion 2-3 tokens + EOS, so a pair is 7-9 tokens long.
CASES = [
    pytest.param({"loss_type": ["robust"], "label_smoothing": 0.1}, id="robust"),
    pytest.param({"loss_type": ["bco_pair"]}, id="bco_pair"),
    # exo_pair: TRL raises a ValueError for label_smoothing 0
    pytest.param({"loss_type": ["exo_pair"], "label_smoothing": 1e-3}, id="exo_pair"),
    pytest.param({"loss_type": ["nca_pair"]}, id="nca_pair"),
    pytest.param({"loss_type": ["aot"]}, id="aot"),
    pytest.param({"loss_type": ["aot_unpaired"]}, id="aot_unpaired"),
    pytest.param({"loss_type": ["apo_zero"]}, id="apo_zero"),
    pytest.param({"loss_type": ["apo_down"]}, id="apo_down"),
    pytest.param({"loss_type": ["sppo_hard"]}, id="sppo_hard"),
    pytest.param({"loss_type": ["discopop"]}, id="discopop"),
    pytest.param({"loss_type": ["sigmoid_norm"]}, id="sigmoid_norm"),
    pytest.param({"loss_type": ["sigmoid", "bco_pair"], "loss_weights": [0.8, 0.2]}, id="sigmoid+bco_pair"),
    # TRL multiplies the sigmoid loss by its weight: not the plain DPO loss (was a recompute.dpo false alarm)
    pytest.param({"loss_type": ["sigmoid"], "loss_weights": [0.5]}, id="sigmoid_weighted"),
    # TRL keeps only per-pair reference sums (was a fields.required warning asking for per-token ones)
    pytest.param({"precompute_ref_log_probs": True}, id="precompute_ref"),
    pytest.param({"beta": 0.5}, id="beta_0.5"),
    pytest.param({"gradient_accumulation_steps": 2}, id="grad_accum_2"),
    pytest.param({"padding_free": True}, id="padding_free"),  # TRL 1.16 warns and falls back to padding
    pytest.param({"max_length": 7}, id="truncate_keep_start"),  # cuts the completion (and its EOS) of every pair
    # each side cut from the left on its own: the prompt sits at different offsets (was a masks.dpo_rule error)
    pytest.param({"max_length": 7, "truncation_mode": "keep_end"}, id="truncate_keep_end"),
    # completions at least max_length long: that side keeps no prompt at all, its mask starts at 0 (was a
    # masks.dpo_rule error)
    pytest.param({"max_length": 4, "truncation_mode": "keep_end"}, id="truncate_keep_end_prompt_cut_away"),
    pytest.param({"ld_alpha": 0.5}, id="ld_alpha"),
    pytest.param({"f_divergence_type": "forward_kl"}, id="forward_kl"),
    pytest.param({"f_divergence_type": "js_divergence"}, id="js_divergence"),
    pytest.param({"sync_ref_model": True, "ref_model_sync_steps": 1}, id="sync_ref_model"),
    pytest.param({"pad_to_multiple_of": 16}, id="pad_to_multiple_of"),
    pytest.param({"per_device_train_batch_size": 1}, id="one_pair_per_step"),
    pytest.param({"bf16": True}, id="bf16"),
]


@pytest.mark.parametrize("overrides", CASES)
def test_healthy_dpo_config_passes_check(tmp_path, model_dir, overrides):
    from tracer.checks import ERROR, WARNING, run_checks

    with torch_threads(1):
        trainer = dpo_trl.make_trainer(model_dir, tmp_path / "scratch", steps=2, seed=0, progress=False, **overrides)
        hook = tracer.attach(trainer, tmp_path / "trace")
        trainer.train()
    assert hook.capture_failures == 0
    findings = run_checks(tmp_path / "trace")
    bad = [f"{f.check} [{f.severity}]: {f.message}" for f in findings if f.severity in (ERROR, WARNING)]
    assert bad == [], "\n".join(bad)
    notes = {f.check for f in findings if f.severity == INFO}
    # the layouts that were false alarms now say what they are, as info findings
    if overrides.get("precompute_ref_log_probs"):
        assert "fields.required" in notes
    if overrides.get("truncation_mode") == "keep_end":
        assert "masks.dpo_rule" in notes
    if overrides.get("max_length") == 4:  # some side had its whole prompt cut away, and it is said so
        assert any(f.details.get("prompt_cut_away") for f in findings if f.check == "masks.dpo_rule")
    if overrides.get("loss_weights") == [0.5]:  # TRL's loss is half the plain DPO loss: not recorded as dpo_loss
        trace = Trace(tmp_path / "trace")
        meta = [trace.metadata(k) for k in trace.steps()]
        assert meta and not any(m["dpo_loss_is_sigmoid"] for m in meta)
