"""The Runs table shows no "None": the guard cell of a run no guard watched is empty (the column's
help says so), and the last mean reward of a DPO run (no reward recorded) reads "—", the number of
a GRPO run its value to 4 significant digits."""

from __future__ import annotations

import io
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from safetensors.torch import load_file

from app.components import runs, trace_cache
from tests.fixtures.toy_traces import SAMPLES, frame_with, start

pytestmark = pytest.mark.skipif(not (SAMPLES / "dpo-tiny").is_dir(), reason="sample_traces/ is not in this checkout")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for name in ("dpo-tiny", "grpo-tiny"):
        shutil.copytree(SAMPLES / name, root / name)
    return root


@pytest.fixture(autouse=True)
def fresh_caches():
    trace_cache.clear_caches()
    runs.run_status.clear()


def display_values(element):
    """The texts the browser draws in each cell (the pandas Styler's display values sent with the table)."""
    data = element.proto.arrow_data.styler.display_values
    return pa.ipc.open_stream(io.BytesIO(data)).read_pandas()


def test_no_none_in_the_runs_table(monkeypatch, root):
    at = start(monkeypatch, root)
    assert not at.exception, [e.value for e in at.exception]
    element = frame_with(at, {"run", "check", "guard"})
    table = element.value.set_index("run")
    assert list(table["guard"]) == ["", ""]  # no guard ran on the sample runs
    assert math.isnan(table.loc["dpo-tiny", "last mean reward"])  # the value itself: not recorded
    shown = display_values(element)
    shown.index = list(element.value["run"])
    column = list(element.value.columns).index("last mean reward")
    assert shown.loc["dpo-tiny"].iloc[column] == "—"
    last = max((SAMPLES / "grpo-tiny" / "steps").glob("step_*.inner_0.*.safetensors"))
    reward = load_file(str(last))["rewards"].double().mean().item()
    assert shown.loc["grpo-tiny"].iloc[column] == f"{reward:.4g}"
