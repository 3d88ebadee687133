"""Corrupt and hostile files: the committed corpus tests/data/bad_traces/ (made by
tests/data/make_bad_traces.py) and files made here (a FIFO, headers and manifests over the caps).

The reader, ``info``, ``check`` and ``diff`` say which file and why, keep serving the other steps,
never hang and never raise anything but TraceFormatError (TraceError) for a bad file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracer import Trace, TraceFormatError, TraceWriter, diff
from tracer.checks import run_checks
from tracer.cli import main
from tracer.read.trace_info import trace_info
from tracer.format.integrity import MAX_HEADER_BYTES, MAX_MANIFEST_BYTES
from tracer.format.names import step_file_name

from tests.fixtures.paths import DATA

CORPUS = DATA / "bad_traces"
_spec = importlib.util.spec_from_file_location("make_bad_traces", DATA / "make_bad_traces.py")
corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus)

UNREADABLE = sorted(s for s, (_, readable) in corpus.CASES.items() if not readable)
READABLE = sorted([*corpus.GOOD_STEPS, *(s for s, (_, readable) in corpus.CASES.items() if readable)])
HEADER_ONLY = {17}  # bad data behind a good header: scan() (headers only) cannot see it


def test_corpus_is_what_the_generator_makes(tmp_path, monkeypatch):
    """The committed files are exactly those make_bad_traces.py writes (regenerate, then compare)."""
    monkeypatch.setattr(corpus, "OUT", tmp_path / "bad_traces")
    corpus.main()
    made = {p.relative_to(tmp_path / "bad_traces"): p.read_bytes() for p in (tmp_path / "bad_traces").rglob("*")
            if p.is_file()}
    committed = {p.relative_to(CORPUS): p.read_bytes() for p in CORPUS.rglob("*") if p.is_file()}
    assert made == committed, "tests/data/bad_traces/ is stale: run python tests/data/make_bad_traces.py"
    readme = (CORPUS / "README.md").read_text()
    for step in corpus.CASES:
        assert step_file_name(step) in readme


def test_every_step_file_is_listed_by_name_and_leftovers_are_not():
    trace = Trace(CORPUS / "mixed")
    assert [k.step for k in trace.steps()] == sorted(READABLE + UNREADABLE)  # .partial and .tmp* not listed


def test_each_bad_file_is_named_with_its_reason_and_the_others_still_load():
    trace = Trace(CORPUS / "mixed")
    for key in trace.steps():
        if key.step in UNREADABLE:
            with pytest.raises(TraceFormatError) as info:
                trace.load_step(key)
            assert str(key.path) in str(info.value)
            with pytest.raises(TraceFormatError):
                trace.token_table(key, 0)
        else:
            data = trace.load_step(key)
            assert data, key
    good = trace.load_step(trace.step_key(30))
    assert torch.equal(good["policy_logprobs"], corpus.good_tensors(30)["policy_logprobs"])
    table = trace.token_table(trace.step_key(0), 0)
    assert "<script>alert(1)</script>" in table["token_text"].tolist()


def test_reasons_say_what_is_wrong():
    problems = {p.name: why for p, why in Trace(CORPUS / "mixed").scan().items()}
    reason = {s: problems.get(step_file_name(s), "") for s in UNREADABLE}
    assert "file not fully covered" in reason[1]
    assert "header claims 4611686018427387904 bytes but only" in reason[3]
    assert "field 'completion_ids' is stored as F32" in reason[5]
    assert "dimension T is 3, but field 'completion_ids' has T = 4" in reason[6]
    assert "expected shape [B, T], got [2]" in reason[7]
    assert "0 bytes, too short" in reason[8]
    assert "invalid offset" in reason[11]
    assert "field 'completion_mask' is stored as F8_E4M3" in reason[13]
    assert set(reason) - {s for s, r in reason.items() if r} == HEADER_ONLY
    with pytest.raises(TraceFormatError, match=r"'completion_mask' is a mask but holds \[0.5\]"):
        Trace(CORPUS / "mixed").load_sequence(Trace(CORPUS / "mixed").step_key(17), 0)


def test_odd_metadata_is_kept_as_text_not_a_crash():
    trace = Trace(CORPUS / "mixed")
    meta = trace.metadata(trace.step_key(15))
    assert meta["num_generations"] == "two" and meta["reward_component_names"] == "[unclosed"
    nested = trace.metadata(trace.step_key(16))["nested"]
    assert nested.startswith("[[[[") and len(nested) == 10_000  # too deep to parse: kept as the string
    assert trace.metadata(trace.step_key(18))["rank"] == [1, 2]
    summary = trace.step_summary()
    assert summary.loc[summary.step == 1, "problem"].str.contains("not fully covered").all()
    assert summary.loc[summary.step == 30, "mean_reward"].item() == 0.5


def test_info_lists_readable_steps_reports_unreadable_ones_and_says_unfinished(capsys):
    info = trace_info(CORPUS / "mixed")
    assert info["status_text"].startswith("unfinished")
    header_bad = [s for s in UNREADABLE if s not in HEADER_ONLY]
    assert info["steps"] == sorted([s for s in READABLE + UNREADABLE if s not in header_bad])
    assert sorted(Path(p).name for p in info["unreadable"]) == sorted(step_file_name(s) for s in header_bad)
    assert main(["info", str(CORPUS / "mixed")]) == 0
    out = capsys.readouterr().out
    assert "status: unfinished (the writer did not close: crashed or still running)" in out
    assert "step_00000003.inner_0.mb_0.rank_0.safetensors: the header claims" in out


def test_check_reports_each_bad_file_and_checks_the_others():
    findings = run_checks(CORPUS / "mixed")
    unreadable = sorted(f.step for f in findings if f.check == "trace.unreadable")
    assert unreadable == UNREADABLE
    assert all(f.severity == "error" and f.path.endswith(step_file_name(f.step))
               for f in findings if f.check == "trace.unreadable")
    ran_on = {label for f in findings if f.severity == "skipped" for label in f.details["steps"]}
    assert Trace(CORPUS / "mixed").step_key(30).label in ran_on  # checked after the bad files


def test_diff_reports_unreadable_pairs_and_compares_the_rest(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(CORPUS / "mixed", copy)
    report = diff(CORPUS / "mixed", copy)
    assert not report.equal
    header_bad = [s for s in UNREADABLE if s not in HEADER_ONLY]  # diff compares the 0.5 mask as data
    assert sorted(int(label.split()[1]) for label in report.unreadable) == header_bad
    assert report.fields["policy_logprobs"].passed
    assert any(line.startswith("unreadable at step 5: ") for line in report.findings())


@pytest.mark.parametrize("name", sorted(corpus.OTHER_TRACES))
def test_manifest_and_token_problems_are_noted_and_the_step_is_served(name):
    trace = Trace(CORPUS / name)
    (key,) = trace.steps()
    assert trace.load_step(key)["rewards"].tolist() == [1.0, 0.0]
    table = trace.token_table(key, 0)
    assert len(table) == corpus.T
    problems = trace.scan()
    if name in ("manifest_missing", "tokens_not_strings"):
        assert problems == {}
    else:
        (path,) = problems
        assert path.name in ("manifest.json", "tokens.json")
    info = trace_info(CORPUS / name)
    assert info["steps"] == [0] and info["algorithm"] == "grpo"
    run_checks(trace)  # no exception
    assert trace.tokens is None or all(isinstance(t, str) for t in trace.tokens)


def test_wrong_typed_manifest_keys_are_dropped_with_a_note():
    trace = Trace(CORPUS / "manifest_wrong_types")
    assert "algorithm" not in trace.manifest and "hyperparameters" not in trace.manifest
    assert trace.eos_token_id is None and trace.manifest["tokenizer"] == {"class": "Toy"}
    assert any("key 'dropped_steps' should be an integer, got str" in n for n in trace.manifest_notes)
    assert Trace(CORPUS / "manifest_tokenizer_string").pad_token_id is None


@pytest.mark.parametrize("name", sorted(corpus.SINGLE_FILES))
def test_single_bad_files_exit_2_or_are_shown(name, capsys):
    path = CORPUS / "single" / name
    code = main(["info", str(path)])
    captured = capsys.readouterr()
    if name == "not_a_trace.safetensors":
        assert code == 0 and "weight" in captured.out
        assert main(["check", str(path)]) == 0  # nothing to check: every check is skipped
    else:
        assert code == 2 and str(path) in captured.err
        assert main(["check", str(path)]) == 2
        assert main(["diff", str(path), str(path)]) == 2


def test_cli_in_a_subprocess_prints_no_traceback():
    """One real process per command over the whole corpus (cheap: the commands share nothing)."""
    script = (
        "import sys\nfrom pathlib import Path\nfrom tracer.cli import main\n"
        "root = Path(sys.argv[1])\n"
        "targets = sorted(p for p in root.iterdir() if p.is_dir() and p.name != 'single')\n"
        "targets += sorted((root / 'single').iterdir())\n"
        "for t in targets:\n"
        "    for argv in (['info', str(t)], ['info', '--json', str(t)], ['check', str(t)], ['diff', str(t), str(t)]):\n"
        "        code = main(argv)\n"
        "        assert code in (0, 1, 2), (argv, code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(CORPUS)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


# -- made here: files a git repository cannot hold, or too large to commit ---------------------


def write_good(root: Path, steps: int = 2) -> Trace:
    with TraceWriter(root, "grpo") as writer:
        for step in range(steps):
            writer.record(step, {key: value for key, value in corpus.good_tensors(step).items()})
    return Trace(root)


def test_a_fifo_named_like_a_step_file_does_not_hang(tmp_path):
    trace = write_good(tmp_path / "run")
    fifo = tmp_path / "run" / "steps" / step_file_name(5)
    os.mkfifo(fifo)
    (tmp_path / "run" / "steps" / step_file_name(6)).mkdir()
    assert "not a regular file" in trace.scan()[fifo]
    with pytest.raises(TraceFormatError, match="not a regular file"):
        trace.load_step(next(k for k in trace.steps() if k.step == 5))
    assert len(run_checks(trace, select=["masks"])) >= 2  # the fifo and the directory are errors
    os.unlink(fifo)
    os.mkfifo(tmp_path / "run" / "tokens.json")
    assert Trace(tmp_path / "run").tokens is None  # a FIFO token file is not opened


def test_enormous_metadata_and_manifest_are_refused_without_parsing(tmp_path):
    trace = write_good(tmp_path / "run")
    big = torch.ones(1)
    from safetensors.torch import save_file

    path = tmp_path / "run" / "steps" / step_file_name(7)
    save_file({"rewards": big}, str(path), metadata={"blob": "x" * (MAX_HEADER_BYTES + 8)})
    with pytest.raises(TraceFormatError, match=f"exceeds the {MAX_HEADER_BYTES} bytes"):
        trace.metadata(trace.step_key(7))
    manifest = tmp_path / "run" / "manifest.json"
    manifest.write_text(json.dumps({"algorithm": "grpo", "config": {"blob": "x" * MAX_MANIFEST_BYTES}}))
    reopened = Trace(tmp_path / "run")
    assert reopened.manifest == {} and "over the" in reopened.manifest_notes[0]
    assert [k.step for k in reopened.steps()] == [0, 1, 7]


def test_header_length_prefix_is_checked_before_safetensors_parses(tmp_path):
    trace = write_good(tmp_path / "run", steps=1)
    path = trace.steps()[0].path
    payload = path.read_bytes()
    (header_len,) = struct.unpack("<Q", payload[:8])
    path.write_bytes(struct.pack("<Q", header_len + 10**6) + payload[8:])
    with pytest.raises(TraceFormatError, match=r"header claims \d+ bytes but only \d+ follow"):
        trace.metadata(trace.steps()[0])
