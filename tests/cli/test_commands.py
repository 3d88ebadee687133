"""The command line: info (text and JSON), errors on unusable paths, python -m tracer."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tracer import TraceWriter
from tracer.cli import main

from tests.fixtures.paths import REPO


def write_trace(root):
    with TraceWriter(root, "grpo", hyperparameters={"num_generations": 2, "beta": 0.04}) as writer:
        for step in range(3):
            for inner in range(2):
                writer.record(step, {
                    "completion_ids": torch.zeros(4, 6, dtype=torch.long),
                    "completion_mask": torch.ones(4, 6, dtype=torch.bool),
                    "policy_logprobs": torch.zeros(4, 6),
                    "rewards": torch.zeros(4),
                    "group_ids": torch.tensor([0, 0, 1, 1]),
                }, inner_step=inner)
    return root


def test_info_json_lists_steps_and_fields(tmp_path, capsys):
    root = write_trace(tmp_path / "run")
    assert main(["info", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["algorithm"] == "grpo" and info["status"] == "finished"
    assert info["steps"] == [0, 1, 2] and info["inner_steps"] == [0, 1] and info["ranks"] == [0]
    assert info["num_step_files"] == 6
    assert info["fields"]["completion_ids"] == {"shape": [4, 6], "dtype": "I64"}
    assert info["fields"]["group_ids"] == {"shape": [4], "dtype": "I64"}
    assert info["first_step_metadata"]["num_generations"] == 2


def test_info_text_names_fields(tmp_path, capsys):
    root = write_trace(tmp_path / "run")
    assert main(["info", str(root)]) == 0
    out = capsys.readouterr().out
    assert "algorithm: grpo" in out and "policy_logprobs" in out and "[4, 6]" in out


def test_info_and_view_on_a_missing_or_non_trace_directory(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nope")]) == 2
    assert "does not exist: expected a trace directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["info", str(tmp_path / "empty")]) == 2
    assert "is not a trace: expected manifest.json" in capsys.readouterr().err
    assert main(["view", str(tmp_path / "empty")]) == 2
    assert "holds no trace: expected a directory with manifest.json" in capsys.readouterr().err
    assert main(["view", str(tmp_path / "nope")]) == 2


def test_view_on_a_busy_port_says_so_before_starting_streamlit(tmp_path, capsys, monkeypatch):
    root = write_trace(tmp_path / "run")
    monkeypatch.setattr("tracer.view_server.serve", lambda *a, **k: pytest.fail("streamlit was started"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["view", str(root), "--port", str(port)]) == 2
    assert f"port {port} is in use; pass --port, e.g. --port {port + 1}" in capsys.readouterr().err


def test_view_without_streamlit_names_the_extra(tmp_path, capsys, monkeypatch):
    root = write_trace(tmp_path / "run")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == "streamlit" else real_find_spec(name, *a))
    assert main(["view", str(root)]) == 2
    err = capsys.readouterr().err
    assert "the web UI needs streamlit" in err and "pip install -e '.[app]'" in err


@pytest.mark.parametrize("algo, missing", [("grpo-trl", "trl"), ("grpo", "transformers")])
def test_demo_without_its_extra_names_it(tmp_path, capsys, monkeypatch, algo, missing):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == missing else real_find_spec(name, *a))
    assert main(["demo", "--algo", algo, "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert f"--algo {algo} needs {missing}" in err and "pip install 'tracer[trl]'" in err
    assert not (tmp_path / "d").exists()


def test_python_dash_m_tracer(tmp_path):
    root = write_trace(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "tracer", "info", str(root), "--json"],
                          capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout)["num_step_files"] == 6


def test_demo_command_writes_a_trace_and_refuses_to_overwrite_it(tmp_path, capsys):
    out = tmp_path / "dpo"
    assert main(["demo", "--algo", "dpo", "--out", str(out), "--steps", "1"]) == 0
    assert "wrote trace to" in capsys.readouterr().out
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["algorithm"] == "dpo" and info["steps"] == [0]
    weights = out / "model" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert main(["demo", "--algo", "dpo", "--out", str(out), "--steps", "1", "--seed", "1"]) == 2
    assert "already holds a trace" in capsys.readouterr().err
    assert weights.stat().st_mtime_ns == before  # the trace's model was not rebuilt over


@pytest.mark.parametrize("under", [False, True])
def test_demo_out_that_is_a_file_is_refused_in_one_line(tmp_path, capsys, under):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    out = blocker / "run" if under else blocker
    assert main(["demo", "--algo", "grpo", "--out", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{blocker} is a file, not a folder" in err and "Traceback" not in err
    assert blocker.read_text() == "mine\n"  # untouched


def test_demo_out_that_is_a_link_to_nothing_is_refused_in_one_line(tmp_path, capsys):
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone")
    assert main(["demo", "--algo", "grpo", "--out", str(link), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{link} is a link to nothing, not a folder" in err and "Traceback" not in err


def test_check_on_a_folder_of_traces_names_them(tmp_path, capsys):
    write_trace(tmp_path / "runs" / "a")
    write_trace(tmp_path / "runs" / "b")
    assert main(["check", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "is a folder of 2 trace(s), not a trace" in err and f"tracer check {tmp_path / 'runs' / 'a'}" in err


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_info_on_a_folder_of_traces_names_them_as_check_does(tmp_path, json_flag):
    """The real CLI on a folder holding 6 traces (one a level deeper): exit 2, and the error names
    how many, one to pass, and the first five (sorted, as find_traces lists them) and how many more."""
    runs = tmp_path / "runs"
    for name in ("a", "b", "c", "d", "sweep/e", "sweep/f"):
        write_trace(runs / name)
    proc = subprocess.run([sys.executable, "-m", "tracer", "info", str(runs), *json_flag],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stdout) == (2, "")
    shown = ", ".join(str(runs / name) for name in ("a", "b", "c", "d", "sweep/e"))
    assert proc.stderr == (f"tracer info: error: {runs} is a folder of 6 trace(s), not a trace: pass one of them, "
                           f"e.g. tracer info {runs / 'a'} ({shown} and 1 more)\n")


def test_version_names_the_version_and_the_copy_of_tracer_that_runs(tmp_path):
    """``tracer --version`` through the real entry (``python -m tracer``), from another folder: the
    version pyproject declares, and the folder of the package imported (this checkout's)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10 (pyproject's tomli extra)
        import tomli as tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tracer", "--version"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"tracer {declared} ({REPO / 'tracer'})\n"
    import tracer

    assert tracer.__version__ == declared  # the package and pyproject say the same


def test_info_on_a_step_file_of_a_trace_reads_the_trace_manifest(tmp_path, capsys):
    """A step file in ``steps/`` of a trace: status and drops come from the manifest two levels up
    (it said 'unknown (no readable manifest)'). A lone copy of the file has no manifest to read."""
    root = write_trace(tmp_path / "run")
    writer = TraceWriter(tmp_path / "dropping", "grpo")
    writer.record(0, {"policy_logprobs": torch.zeros(2, 3), "completion_mask": torch.ones(2, 3, dtype=torch.bool)})
    writer.count_drop("step 1: lost by the test")
    writer.close()
    step_file = root / "steps" / "step_00000001.inner_1.mb_0.rank_0.safetensors"
    assert main(["info", str(step_file), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["status"], info["status_text"], info["num_step_files"]) == ("finished", "finished", 1)
    assert (info["steps"], info["inner_steps"], info["manifest_of"]) == ([1], [1], str(root))
    dropping = next((tmp_path / "dropping" / "steps").iterdir())
    assert main(["info", str(dropping)]) == 0
    out = capsys.readouterr().out
    assert "status: finished" in out and "dropped: 1" in out and "first: step 1: lost by the test" in out
    assert f"a step file of the trace {tmp_path / 'dropping'}" in out
    lone = tmp_path / "lone.safetensors"  # outside any trace
    lone.write_bytes(step_file.read_bytes())
    (tmp_path / "other" / "steps").mkdir(parents=True)  # a steps/ folder without a manifest above it
    orphan = tmp_path / "other" / "steps" / step_file.name
    orphan.write_bytes(step_file.read_bytes())
    for path in (lone, orphan):
        assert main(["info", str(path), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert (info["status_text"], info["manifest_of"], info["num_step_files"]) == (
            "unknown (no readable manifest)", None, 1)
