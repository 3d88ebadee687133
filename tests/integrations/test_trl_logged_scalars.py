"""TRL's logs (``on_log``) of a real GRPOTrainer run become ``scalars/<name>`` of the step they close:
TRL's logged loss, entropy, reward-function means and completion length equal what the trace
recorded for that step (computed here from the step files), the learning rate follows the linear
schedule written out by hand, and a torn last line of the log file is skipped."""

from __future__ import annotations

import json
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

from tracer import Trace
from tracer.demo import grpo_trl
from tracer.format.scalar_log import scalars_name

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_dir):
    """Two optimizer steps, num_iterations=2 (step 1 reuses step 0's rollout), a log every step."""
    out = tmp_path_factory.mktemp("logged") / "grpo"
    grpo_trl.run_grpo_demo(out, steps=2, seed=0, progress=False, model_dir=model_dir)
    return out


def test_each_log_lands_on_the_step_it_closes(run):
    trace = Trace(run)
    frame = trace.step_summary().set_index("step")
    for step in (0, 1):
        (key,) = [k for k in trace.steps() if k.step == step]  # step 1 is inner step 1 of step 0's rollout
        data = trace.load_step(key, ["loss", "completion_mask", "entropy", "reward_components"])
        # Trainer rounds the logged loss to 4 decimals (transformers Trainer._maybe_log_save_evaluate)
        assert frame.loc[step, "scalars/loss"] == pytest.approx(float(data["loss"]), abs=5e-5)
        mask = data["completion_mask"]
        entropy = float(data["entropy"][mask].sum() / mask.sum())
        assert frame.loc[step, "scalars/entropy"] == pytest.approx(entropy, rel=1e-4)
        # linear decay from LEARNING_RATE to 0 over max_steps = 2, read after each step's update: lr * (1 - s / 2)
        assert frame.loc[step, "scalars/learning_rate"] == pytest.approx(grpo_trl.LEARNING_RATE * (1 - step / 2))
        assert frame.loc[step, "scalars/grad_norm"] > 0
    # generation metrics are logged on the step that generated (inner step 0), not on the reused rollout
    data = trace.load_step(trace.step_key(0), ["completion_mask", "reward_components"])
    names = trace.metadata(trace.step_key(0))["reward_component_names"]
    for f, name in enumerate(names):
        assert frame.loc[0, f"scalars/rewards/{name}/mean"] == pytest.approx(
            float(data["reward_components"][:, f].mean()), abs=1e-6)
    assert frame.loc[0, "scalars/completions/mean_length"] == pytest.approx(
        float(data["completion_mask"].sum(dim=1).float().mean()))
    assert frame["scalars/completions/mean_length"].isna().tolist() == [False, True]
    assert not any(c.startswith("scalars/train_") for c in frame.columns)  # the end-of-training summary


def test_a_torn_last_line_and_a_foreign_value_are_skipped(run, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    path = copy / scalars_name(0)
    lines = path.read_text().splitlines(keepends=True)
    bad = json.dumps({"step": 1, "scalars": {"loss": "high", "grad_norm": 123.0}}) + "\n"
    path.write_text("".join(lines) + bad + '{"step": 0, "scalars": {"loss": 99')
    before = Trace(run).step_summary()
    after = Trace(copy).step_summary()
    assert after["scalars/loss"].tolist() == before["scalars/loss"].tolist()
    assert after["scalars/grad_norm"].tolist() == [before["scalars/grad_norm"][0], 123.0]  # a later line wins
