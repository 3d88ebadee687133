"""The Steps page plots any per-step scalar the user chooses: smoothed as TensorBoard smooths
(checked against the plain loop), on a log axis only when every value is positive, against the step
or the wall-clock time, with other runs overlaid quantity by quantity (a run whose ratio the reader
derived overlays one that recorded it), every choice in the URL. The runs: ``baseline`` and ``mine``,
two hand-written GRPO runs (the second without ratio, with a user scalar), and ``dpo``
(tests/fixtures/steps_runs.py). Pages through ``AppTest``."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest

from app.components.step_curves import smooth, split_names
from tests.fixtures.steps_runs import (
    BASELINE,
    DPO,
    grad_norm,
    step_files,
    write_steps_root,
)
from tests.fixtures.toy_traces import start

pytestmark = pytest.mark.skipif(not BASELINE.is_dir() or not DPO.is_dir(),
                                reason="sample_traces/grpo-diff-baseline, dpo-tiny are not in this checkout")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_steps_root(tmp_path_factory.mktemp("steps_root"))


def decoded(values) -> np.ndarray:
    """A Plotly JSON array as numbers: a list, or a typed array ``{dtype, bdata[, shape]}``."""
    if isinstance(values, dict):
        array = np.frombuffer(base64.b64decode(values["bdata"]), dtype=np.dtype(values["dtype"]))
        shape = values.get("shape")
        return array.reshape([int(n) for n in str(shape).split(",")]) if shape else array
    return np.asarray(values, dtype=np.float64)


def chart(at) -> dict:
    (element,) = at.get("plotly_chart")
    return json.loads(element.proto.spec)


def traces_of(spec: dict, panel: int) -> list[dict]:
    """The traces of the ``panel``-th subplot (0-based, in layout order)."""
    axis = "y" if panel == 0 else f"y{panel + 1}"
    return [t for t in spec["data"] if t.get("yaxis", "y") == axis]


def line(spec: dict, panel: int, name: str, smoothed: bool = True) -> np.ndarray:
    """The y values of the line ``name`` in ``panel`` (its smoothed trace, or the faint raw one)."""
    (trace,) = [t for t in traces_of(spec, panel) if t["name"] == name and (t.get("opacity") != 0.25) == smoothed]
    return decoded(trace["y"])


def masked_mean(values, completion_mask) -> float:
    values, keep = values.double(), completion_mask.bool()
    return float(values[keep].sum() / keep.sum())


def test_a_chosen_user_scalar_plots_the_values_recorded(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "mine", "y": "scalars/grad_norm"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.multiselect(key="step_columns").value == ["scalars/grad_norm"]
    assert "scalars/grad_norm" in at.multiselect(key="step_columns").options
    spec = chart(at)
    assert spec["layout"]["annotations"][0]["text"] == "scalars/grad_norm"  # the one panel's title
    for inner in (0, 1):
        assert line(spec, 0, f"inner step {inner}").tolist() == [grad_norm(s, inner) for s in range(3)]


def test_smoothing_is_tensorboards_debiased_ema(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "baseline", "y": "mean_reward", "smooth": "0.6"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.slider(key="step_smoothing").value == pytest.approx(0.6)
    files = step_files(BASELINE)
    raw = [float(files[s, 0]["rewards"].double().mean()) for s in range(3)]  # inner step 0's mean reward
    # TensorBoard's classicSmoothing, written out: last = 0.6 last + 0.4 r, shown as last / (1 - 0.6^n)
    expected, last = [], 0.0
    for n, value in enumerate(raw, start=1):
        last = 0.6 * last + 0.4 * value
        expected.append(last / (1 - 0.6 ** n))
    spec = chart(at)
    assert line(spec, 0, "inner step 0").tolist() == pytest.approx(expected, rel=1e-9)
    assert line(spec, 0, "inner step 0", smoothed=False).tolist() == pytest.approx(raw, rel=1e-6)  # raw, faint
    assert expected[0] == pytest.approx(raw[0]) and expected[1] != pytest.approx(raw[1])  # debiased, yet smoothed
    assert any("weight 0.6" in c.value and "faint lines are the raw values" in c.value for c in at.caption)


def test_smooth_skips_non_finite_values_and_keeps_constant_series():
    # [1, nan, 3] at weight 0.5: 1; nan stays; then (0.5 * 0.5 + 0.5 * 3) / (1 - 0.25) = 1.75 / 0.75
    out = smooth([1.0, math.nan, 3.0], 0.5)
    assert out[0] == pytest.approx(1.0) and math.isnan(out[1]) and out[2] == pytest.approx(1.75 / 0.75)
    assert smooth([0.1] * 5, 0.9).tolist() == [0.1] * 5  # no rounding drift on a flat line
    assert smooth([1.0, 2.0], 0.0).tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"smoothing weight 1.0 is outside \[0, 1\)"):
        smooth([1.0], 1.0)


def test_url_lists_match_names_that_hold_commas():
    # a run folder or a scalar may be named "a,b": the longest run of comma-separated pieces that is a name wins
    options = ["a,b", "a", "c"]
    assert split_names("a,b,c,x", options) == (["a,b", "c"], ["x"])
    assert split_names("a,c,c", options) == (["a", "c"], [])
    assert split_names("", options) == ([], []) and split_names(None, options) == ([], [])


def test_log_scale_is_refused_for_a_series_with_values_at_or_below_zero(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "baseline", "y": "mean_ratio,mean_ref_kl_k3",
                                         "log": "mean_ratio,mean_ref_kl_k3"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception, [e.value for e in at.exception]
    files = step_files(BASELINE)
    k3 = {key: masked_mean(t["ref_kl_k3"], t["completion_mask"]) for key, t in files.items()}
    at_or_below = sorted(key for key, value in k3.items() if value <= 0)
    assert at_or_below == [(0, 0)]  # policy == ref before the first update: k3 is exactly 0
    spec = chart(at)
    assert spec["layout"]["yaxis"].get("type") == "log"  # mean ratio: every value > 0
    assert spec["layout"]["yaxis2"].get("type") in (None, "linear")
    notes = [i.value for i in at.info]
    assert f"mean ref KL (k3, nats): log scale not applied: 1 of {len(files)} values are ≤ 0 " \
           "(smallest 0 at step 0, inner step 0)." in notes
    assert at.multiselect(key="step_log").value == ["mean_ratio", "mean_ref_kl_k3"]  # the choice stays


@pytest.mark.parametrize("main, other", [("baseline", "mine"), ("mine", "baseline")])
def test_a_run_with_derived_ratio_overlays_one_that_recorded_it(monkeypatch, root, main, other):
    at = start(monkeypatch, root, query={"run": main, "overlay": other, "y": "mean_ratio,clip_fraction"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not any("not overlaid" in c.value for c in at.caption)
    spec = chart(at)
    titles = [a["text"] for a in spec["layout"]["annotations"]]
    assert titles == ["mean ratio (derived for mine)", "clip fraction (derived for mine)"]
    assert any(c.value.startswith("mine: approx_kl_k2, ratio, ref_kl_k3: derived by the reader") for c in at.caption)
    files = step_files(BASELINE)
    for inner in (0, 1):  # the same logprobs: the recorded ratio and the derived one agree
        expected = [masked_mean(files[s, inner]["ratio"], files[s, inner]["completion_mask"]) for s in range(3)]
        for run in (main, other):
            assert line(spec, 0, f"{run} · inner step {inner}") == pytest.approx(expected, rel=1e-5)
    assert line(spec, 0, "baseline · inner step 1")[0] != pytest.approx(1.0)  # inner step 1: the policy moved


def test_an_overlaid_run_of_another_algorithm_draws_what_it_shares_and_names_the_rest(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "mine", "overlay": "dpo", "y": "mean_ratio,clip_fraction"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception, [e.value for e in at.exception]
    captions = [c.value for c in at.caption]
    assert any(c.startswith("dpo (a dpo run) records none of the chosen quantities; its own: loss, "
                            "scalars/loss, scalars/grad_norm, scalars/learning_rate, pairs, "  # the DPO loop's scalars
                            "margin (chosen − rejected reward), preference accuracy, DPO loss") for c in captions), captions
    assert {t["name"] for t in chart(at)["data"]} == {"mine · inner step 0", "mine · inner step 1"}
    # the loss both record, the ratio of GRPO, the margin of DPO: one panel each, the runs that have it
    at.multiselect(key="step_columns").set_value(["loss", "mean_ratio", "margin"]).run()
    assert not at.exception, [e.value for e in at.exception]
    spec = chart(at)
    assert [a["text"] for a in spec["layout"]["annotations"]] == [
        "loss", "mean ratio (derived)", "margin (chosen − rejected reward)"]
    dpo_loss = [float(t["loss"]) for _, t in sorted(step_files(DPO).items())]
    assert line(spec, 0, "dpo · inner step 0") == pytest.approx(dpo_loss, rel=1e-6)
    mine_loss = [float(step_files(BASELINE)[s, 1]["loss"]) for s in range(3)]
    assert line(spec, 0, "mine · inner step 1") == pytest.approx(mine_loss, rel=1e-6)
    assert {t["name"] for t in traces_of(spec, 1)} == {"mine · inner step 0", "mine · inner step 1"}
    assert {t["name"] for t in traces_of(spec, 2)} == {"dpo · inner step 0"}
    captions = [c.value for c in at.caption]
    assert "Not in dpo (a dpo run): mean ratio." in captions
    assert "Not in mine (a grpo run): margin (chosen − rejected reward)." in captions


def test_a_run_without_wall_clock_time_says_so_and_plots_against_steps(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "legacy", "y": "mean_reward", "x": "wall_time"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "legacy recorded no wall-clock time per step (written before the trace stored wall_time): " \
           "the x-axis is the step." in [i.value for i in at.info]
    spec = chart(at)
    assert spec["layout"]["xaxis"]["title"]["text"] == "step"
    assert decoded(traces_of(spec, 0)[0]["x"]).tolist() == [0, 1, 2]


def test_time_since_the_first_step_is_the_recorded_wall_time_and_a_click_still_opens_the_step(monkeypatch, root):
    from tracer.read import Trace

    summary = Trace(root / "mine").step_summary().sort_values(["inner_step", "step"])
    wall = summary[summary["inner_step"] == 1]["wall_time"].to_numpy()
    assert np.isfinite(wall).all()
    at = start(monkeypatch, root, query={"run": "mine", "y": "mean_reward", "x": "relative_time"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception, [e.value for e in at.exception]
    spec = chart(at)
    assert spec["layout"]["xaxis"]["title"]["text"] == "time since the run's first step (s)"  # a run of seconds
    (inner_1,) = [t for t in spec["data"] if t["name"] == "inner step 1"]
    origin = summary["wall_time"].min()
    assert decoded(inner_1["x"]) == pytest.approx(wall - origin, abs=1e-6)
    # a click on the inner-1 point of step 2 (x is a time now): the Step page opens on step 2, inner 1
    curve = spec["data"].index(inner_1)
    point = {"x": float(decoded(inner_1["x"])[2]), "y": 1.0, "curve_number": curve, "point_number": 2,
             "point_index": 2}
    at.session_state["step_curves"] = {"selection": {"points": [point], "point_indices": [2], "box": [], "lasso": []}}
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Step"
    assert at.selectbox(key="step_file").value == "step 2 · inner 1 · mb 0 · rank 0"


def test_every_choice_round_trips_through_the_url(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "mine"})
    at.switch_page("app_pages/steps.py").run()
    assert at.multiselect(key="step_columns").value == ["mean_ratio", "mean_ref_kl_k3", "mean_reward",
                                                        "clip_fraction"]  # the defaults
    at.multiselect(key="step_columns").set_value(["scalars/grad_norm", "mean_ratio"]).run()
    at.multiselect(key="overlay").set_value([root / "baseline"]).run()  # more options: the choice stays
    at.slider(key="step_smoothing").set_value(0.35).run()
    at.multiselect(key="step_log").set_value(["scalars/grad_norm"]).run()
    at.radio(key="step_x").set_value("relative_time").run()
    assert not at.exception, [e.value for e in at.exception]
    params = dict(at.query_params)
    assert {k: params[k] for k in ("run", "overlay", "y", "smooth", "log", "x")} == {
        "run": "mine", "overlay": "baseline", "y": "scalars/grad_norm,mean_ratio", "smooth": "0.35",
        "log": "scalars/grad_norm", "x": "relative_time"}
    again = start(monkeypatch, root, query={k: str(v) for k, v in params.items()})
    again.switch_page("app_pages/steps.py").run()
    assert not again.exception, [e.value for e in again.exception]
    assert again.multiselect(key="overlay").value == [root / "baseline"]
    assert again.multiselect(key="step_columns").value == ["scalars/grad_norm", "mean_ratio"]
    assert again.slider(key="step_smoothing").value == pytest.approx(0.35)
    assert again.multiselect(key="step_log").value == ["scalars/grad_norm"]
    assert again.radio(key="step_x").value == "relative_time"
    assert chart(again) == chart(at)
    again.switch_page("app_pages/step.py").run()  # another page: the Steps page's parameters leave the URL
    assert not {"overlay", "y", "smooth", "log", "x"} & set(again.query_params)


def test_trls_logged_scalars_are_offered_and_plotted(monkeypatch, tmp_path_factory, model_dir):
    """A real GRPOTrainer run (TRL's on_log captured by the integration): the learning rate it logged
    is a quantity of the Steps page, plotted as TRL's linear schedule gives it, on a log axis (> 0)."""
    pytest.importorskip("trl")
    from tracer.demo import grpo_trl

    root = tmp_path_factory.mktemp("trl_steps")
    grpo_trl.run_grpo_demo(root / "trl", steps=2, seed=0, progress=False, model_dir=model_dir)
    at = start(monkeypatch, root, query={"run": "trl", "y": "scalars/learning_rate,scalars/grad_norm",
                                         "log": "scalars/learning_rate"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception, [e.value for e in at.exception]
    options = at.multiselect(key="step_columns").options
    assert {"scalars/learning_rate", "scalars/grad_norm", "scalars/loss", "loss"} <= set(options)
    spec = chart(at)
    # step 1 is inner step 1 of step 0's rollout: one point per line; the linear decay from
    # LEARNING_RATE to 0 over max_steps = 2, read after each step's update: lr * (1 - step / 2)
    drawn = {t["name"]: (decoded(t["x"]).tolist(), decoded(t["y"]).tolist()) for t in traces_of(spec, 0)}
    assert drawn == {"inner step 0": ([0], [pytest.approx(grpo_trl.LEARNING_RATE)]),
                     "inner step 1": ([1], [pytest.approx(grpo_trl.LEARNING_RATE / 2)])}
    assert spec["layout"]["yaxis"]["type"] == "log" and not at.info
    assert decoded(traces_of(spec, 1)[0]["y"]).min() > 0  # grad norms


def test_another_run_keeps_the_quantities_it_has_else_opens_on_its_defaults(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "mine", "y": "scalars/grad_norm,mean_ratio"})
    at.switch_page("app_pages/steps.py").run()
    at.selectbox(key="run").select(root / "legacy").run()  # an older trace: no user scalars
    assert not at.exception, [e.value for e in at.exception]
    assert at.multiselect(key="step_columns").value == ["mean_ratio"] and at.query_params["y"] == "mean_ratio"
    at.selectbox(key="run").select(root / "dpo").run()  # none of them: DPO's own curves
    assert at.multiselect(key="step_columns").value == ["margin", "preference_accuracy", "mean_dpo_loss",
                                                        "mean_chosen_logps", "mean_rejected_logps"]
    assert not any(c.value.startswith("Named in the link") for c in at.caption)


@pytest.mark.parametrize("steps, kind", [(2000, "scatter"), (2001, "scattergl")])
def test_long_runs_are_drawn_with_webgl_and_a_click_reads_the_step_of_its_point(steps, kind):
    import pandas as pd

    from app.components.step_curves import Layout, clicked_step, step_curves_figure

    # steps 10, 20, 30...: the step of a point is not its index, nor its x on a time axis
    summary = pd.DataFrame({"step": [10 * (s + 1) for s in range(steps)], "inner_step": 1,
                            "wall_time": [1.7e9 + 3.0 * s for s in range(steps)],
                            "mean_reward": [s / steps for s in range(steps)]})
    fig, notes = step_curves_figure({"run": summary}, Layout(["mean_reward"], smoothing=0.5, x="relative_time"))
    assert [t.type for t in fig.data] == [kind, kind] and not notes.x  # the raw line, then the smoothed one
    sent = json.loads(fig.to_json())["data"]
    assert [decoded(t["customdata"]).shape for t in sent] == [(steps, 2), (steps, 2)]  # [step, files], typed
    # 3 s a step: about 100 minutes, shown in minutes since the first step
    assert fig.layout.xaxis.title.text == "time since the run's first step (min)"
    assert decoded(sent[1]["x"])[-1] == pytest.approx(3.0 * (steps - 1) / 60)
    point = {"x": 3.0 * (steps - 2) / 60, "curve_number": 1, "point_index": steps - 2}
    assert clicked_step(fig, point) == (10 * (steps - 1), 1, 0)  # [inner step, run] from the trace's meta


def test_a_constant_scalar_is_drawn_at_its_value_not_on_the_zero_line():
    import pandas as pd

    from app.components.step_curves import Layout, step_curves_figure

    summary = pd.DataFrame({"step": [0, 1, 2], "inner_step": 0, "scalars/learning_rate": [1e-3] * 3,
                            "mean_reward": [0.1, 0.5, 0.2]})
    fig, _ = step_curves_figure({"run": summary}, Layout(["scalars/learning_rate", "mean_reward"]))
    assert list(fig.layout.yaxis.range) == [pytest.approx(5e-4), pytest.approx(1.5e-3)]  # around 0.001
    assert fig.layout.yaxis2.range is None  # a varying series keeps Plotly's own range
