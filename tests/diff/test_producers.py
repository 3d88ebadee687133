"""What produced each trace (package versions, the CPU kernels torch computed with) is recorded in the
manifest and, when two traces differ in it, said by ``tracer diff``: float32 results move in the
last bits between AVX-512 and AVX2 kernels, one optimizer step amplifies that to ~1e-3, and a
regression baseline recorded on one machine then fails on another (CI on an AVX2-only machine did
exactly that to tests/demo/test_regression.py's baselines)."""

import json

import torch

from tracer import diff
from tracer.cli import main

from tests.fixtures.diff_traces import write_trace


def _set_producers(trace, **changes):
    path = trace / "manifest.json"
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            manifest["producers"].pop(key, None)
        else:
            manifest["producers"][key] = value
    path.write_text(json.dumps(manifest))


def _nudge(step, tensors):  # one kept position of one step, by 1e-3 (far above the float32 defaults)
    if step == 1:
        tensors["policy_logprobs"][0, 0] += 1e-3


def test_the_manifest_records_the_cpu_kernels(tmp_path):
    producers = json.loads((write_trace(tmp_path / "a") / "manifest.json").read_text())["producers"]
    assert producers["cpu_kernels"] == torch.backends.cpu.get_cpu_capability() == "AVX2"  # tests/conftest.py pins it
    assert producers["mkl_cbwr"] == "AVX2"
    assert producers["torch"] == torch.__version__


def test_traces_of_one_environment_have_no_producer_note(tmp_path):
    report = diff(write_trace(tmp_path / "a"), write_trace(tmp_path / "b", edit=_nudge))
    assert report.producer_differences == {} and not report.kernels_differ
    assert not any("CPU kernels" in line for line in report.notes())
    assert "ATEN_CPU_CAPABILITY" not in report.format()


def test_different_kernels_are_a_note_and_the_fix_is_in_what_to_do(tmp_path, capsys):
    a = write_trace(tmp_path / "a")
    b = write_trace(tmp_path / "b", edit=_nudge)
    _set_producers(b, cpu_kernels="AVX512", mkl_cbwr=None, torch="2.12.0")
    report = diff(a, b)
    assert not report.equal and report.kernels_differ
    assert report.producer_differences == {"torch": (torch.__version__, "2.12.0"), "cpu_kernels": ("AVX2", "AVX512"),
                                           "mkl_cbwr": ("AVX2", "unset")}
    assert report.notes()[0] == ("produced with different software or CPU kernels (not compared): "
                                 f"torch a='{torch.__version__}' b='2.12.0', cpu_kernels a='AVX2' b='AVX512', "
                                 "mkl_cbwr a='AVX2' b='unset'")
    assert report.to_dict()["producers"]["b"]["cpu_kernels"] == "AVX512"
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    todo = out[out.index("what to do:"):]
    assert ("a ran on AVX2, MKL_CBWR=AVX2 CPU kernels, b on AVX512: float32 results differ in the last bits" in todo
            and "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2" in todo)
    assert "--atol policy_logprobs=" in todo  # the tolerance that would pass is still offered


def test_different_kernels_alone_do_not_make_traces_unequal(tmp_path):
    a, b = write_trace(tmp_path / "a"), write_trace(tmp_path / "b")
    _set_producers(b, cpu_kernels="AVX512")
    report = diff(a, b)
    assert report.equal and report.kernels_differ  # same bytes: equal, with the note
    assert report.producer_differences == {"cpu_kernels": ("AVX2", "AVX512")}
    assert "what to do" not in report.format()


def test_a_trace_without_cpu_kernels_says_nothing_about_kernels(tmp_path):
    # traces written before tracer recorded them (the committed sample traces, old baselines)
    a = write_trace(tmp_path / "a")
    b = write_trace(tmp_path / "b", edit=_nudge)
    _set_producers(a, cpu_kernels=None, mkl_cbwr=None)
    report = diff(a, b)
    assert not report.kernels_differ and report.producer_differences == {}
    assert "ATEN_CPU_CAPABILITY" not in report.format()
