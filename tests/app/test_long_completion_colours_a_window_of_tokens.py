"""A completion of thousands of tokens: the Tokens page colours at most ``MAX_COLOURED_TOKENS`` of them
at a time (a 32,768-token completion sent ~10 MB of coloured HTML and took a minute to show in a
browser), on the colour scale of the whole completion, from a position the user picks; a link that
marks a token opens the window around it. The per-token chart of such a completion names no token in
its hover and sends its values as float32 (9 MB -> ~2 MB at 32,768 tokens), masked positions still gaps.
Expected spans and values are worked out from the recorded tensors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

import tracer
from app.components.coloured_text import MAX_COLOURED_TOKENS
from app.components.figures import MAX_HOVER_TOKENS, token_values_figure
from tracer.read import Trace

from tests.fixtures.toy_traces import APP

T = 5000
KEPT = 4800  # the last 200 positions are masked


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("long") / "run"
    ids = torch.arange(T) % 50 + 2
    ids[KEPT:] = 0
    mask = torch.arange(T) < KEPT
    policy = -(torch.arange(T, dtype=torch.float32) % 7) / 10 - 0.05
    with tracer.Tracer(out, algorithm="grpo", vocabulary=["<pad>", "<eos>", *[f"t{i}" for i in range(50)]],
                       guard="off", hyperparameters={"num_generations": 1, "pad_token_id": 0, "eos_token_id": 1}) as tr:
        tr.record(0, {"completion_ids": ids[None], "completion_mask": mask[None], "policy_logprobs": policy[None],
                      "old_logprobs": policy[None] - 0.01, "rewards": torch.tensor([1.0]),
                      "advantages": torch.tensor([0.0])})
    return out


def _open(monkeypatch, run, **query):
    monkeypatch.setenv("TRACER_ROOT", str(run))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.query_params.update({"run": ".", "step": "0", "seq": "0", **query})
    at.switch_page("app_pages/tokens.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _coloured_positions(at) -> list[int]:
    (box,) = [str(h.proto.body) for h in at.get("html") if 'title="position ' in str(h.proto.body)]
    return [int(p) for p in re.findall(r'title="position (\d+) ', box)]


def test_the_coloured_text_shows_a_window_of_the_completion(monkeypatch, run):
    at = _open(monkeypatch, run)
    assert _coloured_positions(at) == list(range(MAX_COLOURED_TOKENS))
    assert any(f"Tokens 0-{MAX_COLOURED_TOKENS - 1:,} of {T:,} coloured" in c.value for c in at.caption)
    (box,) = [n for n in at.number_input if n.label == "Colour from token"]
    box.set_value(4000).run()  # the last window: 4000..4999 (4800.. masked, each its own span: no pad id known)
    assert _coloured_positions(at) == list(range(4000, T))
    assert any(f"Tokens 4,000-{T - 1:,} of {T:,} coloured" in c.value for c in at.caption)


def test_a_marked_token_opens_the_window_around_it(monkeypatch, run):
    at = _open(monkeypatch, run, token="3100")
    shown = _coloured_positions(at)
    assert shown == list(range(3100 - MAX_COLOURED_TOKENS // 2, 3100 + MAX_COLOURED_TOKENS // 2))


def test_the_chart_of_a_long_completion_sends_float32_values_with_gaps(run):
    trace = Trace(run)
    table = trace.token_table(trace.steps()[0], 0)
    assert T > MAX_HOVER_TOKENS
    fig = token_values_figure(table)
    (policy,) = [d for d in fig.data if d.name == "policy_logprobs"]
    y = np.asarray(policy.y)
    assert y.dtype == np.float32 and policy.customdata is None and "customdata" not in policy.hovertemplate
    expected = -(np.arange(KEPT) % 7) / 10 - 0.05
    assert np.allclose(y[:KEPT], expected, atol=1e-6) and np.isnan(y[KEPT:]).all()  # padding: gaps
