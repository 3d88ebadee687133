"""Integrity: a step file whose bytes are not what was written is caught by everything that promises
it (tracer diff, assert_traces_match, the trace_regression fixture, tracer check, tracer info
--verify), for a flipped data byte and for tensors rewritten with the old header. Traces are
written by TraceWriter in tmp_path (test_diff.write_trace); the corruptions are made by hand."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tracer import diff
from tracer.checks import run_checks
from tracer.cli import main
from tracer.errors import ChecksumError
from tracer.format.integrity import verify_step_file
from tracer.format.hashing import content_sha256
from tracer.testing import TraceRegression, assert_traces_match

from tests.fixtures.diff_traces import write_trace


STEP1 = "steps/step_00000001.inner_0.mb_0.rank_0.safetensors"


def tensor_byte(path: Path, name: str, element: int) -> int:
    """File offset of the first byte of element ``element`` (row-major) of tensor ``name``."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    entry = json.loads(raw[8:8 + n])[name]
    itemsize = {"F32": 4, "I64": 8, "BOOL": 1}[entry["dtype"]]
    return 8 + n + entry["data_offsets"][0] + itemsize * element


def flip(path: Path, offset: int, bit: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))


def rewrite_with_old_header(path: Path, edit) -> None:
    """Load a step file's tensors, change them with ``edit``, save them back with the old metadata
    (what a script fixing up a trace by hand would do)."""
    with safe_open(str(path), "pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata)


@pytest.fixture
def pair(tmp_path):
    a = write_trace(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    return a, b


def corrupt_by_flip(b: Path) -> Path:
    # policy_logprobs[0, 5]: a position seq 0 does not keep (mask keeps tok 0..3), lowest mantissa
    # bit: a change that the mask-aware comparison would never see and any tolerance would pass
    path = b / STEP1
    flip(path, tensor_byte(path, "policy_logprobs", 0 * 6 + 5), bit=0)
    return path


def corrupt_by_rewrite(b: Path) -> Path:
    path = b / STEP1

    def edit(tensors):
        tensors["rewards"][1] += 0.25

    rewrite_with_old_header(path, edit)
    return path


CORRUPTIONS = {"flipped_byte": corrupt_by_flip, "rewritten_tensor": corrupt_by_rewrite}


def test_the_checksum_of_the_bytes_is_the_writers_checksum(pair):
    # differential: the streaming hash of the file bytes equals content_sha256 of the loaded tensors,
    # which is what the writer recorded
    a, _ = pair
    for path in sorted((a / "steps").iterdir()):
        with safe_open(str(path), "pt") as fh:
            recorded = fh.metadata()["content_sha256"]
        assert verify_step_file(path) == recorded == content_sha256(load_file(str(path)))


def test_source_dtypes_verify_without_false_alarms(tmp_path):
    # bfloat16 and float16 kept as recorded, bool masks, int64 ids: every file verifies
    with_bf16 = write_trace(tmp_path / "bf16", keep_source_dtype=True,
                            edit=lambda step, t: t.update(policy_logprobs=t["policy_logprobs"].bfloat16(),
                                                          old_logprobs=t["old_logprobs"].half()))
    assert [verify_step_file(p) is not None for p in (with_bf16 / "steps").iterdir()] == [True] * 3
    assert diff(with_bf16, with_bf16).identical_by_checksum == 3
    assert not [f for f in run_checks(with_bf16, select=["integrity"]) if f.severity != "skipped"]


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_diff_reports_corruption_naming_the_file(pair, how, capsys):
    a, b = pair
    assert diff(a, b).identical_by_checksum == 3  # the clean copy: identical, verified
    path = CORRUPTIONS[how](b)
    with pytest.raises(ChecksumError, match=f"{path}: corrupt: its tensor bytes hash to sha256"):
        diff(a, b)
    with pytest.raises(ChecksumError, match="1 step file\\(s\\) are corrupt"):
        diff(b, a)  # whichever side is corrupt
    assert main(["diff", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tracer diff: error: 1 step file(s) are corrupt, so nothing was compared: ")
    assert str(path) in err and "restore it from a good copy or re-record the trace" in err


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_pytest_helpers_never_pass_a_corrupt_trace(pair, how, tmp_path):
    a, b = pair
    path = CORRUPTIONS[how](b)
    with pytest.raises(ChecksumError, match=str(path)):
        assert_traces_match(b, a)
    # the fixture, with the corrupt trace as the committed baseline
    regression = TraceRegression(tmp_path / "baselines", "test_x", regen=False)
    shutil.copytree(b, regression.baseline_path(a))
    with pytest.raises(pytest.fail.Exception, match="tracer diff: CORRUPT: .*corrupt") as info:
        regression.check(a)
    assert str(regression.baseline_path(a) / STEP1) in str(info.value)
    assert "git checkout --" in str(info.value)
    # with --tracer-regen the corrupt baseline is replaced by the produced trace
    regen = TraceRegression(tmp_path / "baselines", "test_x", regen=True)
    with pytest.raises(pytest.fail.Exception, match="re-recorded the corrupt trace baseline"):
        regen.check(a)
    assert regression.check(a).equal


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_check_and_info_verify_report_the_corrupt_file(pair, how, capsys):
    a, b = pair
    path = CORRUPTIONS[how](b)
    findings = [f for f in run_checks(b) if f.check == "integrity.checksum"]
    assert [(f.severity, f.step, f.path) for f in findings] == [("error", 1, str(path))]
    assert "corrupt" in findings[0].message
    assert main(["check", str(b), "--select", "integrity"]) == 1
    assert main(["check", str(a), "--select", "integrity"]) == 0
    capsys.readouterr()

    assert main(["info", str(b)]) == 0  # without --verify, info reads headers only
    capsys.readouterr()
    assert main(["info", "--verify", "--json", str(b)]) == 2
    integrity = json.loads(capsys.readouterr().out)["integrity"]
    assert integrity["verified"] == 2 and list(integrity["corrupt"]) == [str(path)]
    assert main(["info", "--verify", str(b)]) == 2
    out = capsys.readouterr().out
    assert "verify: 2 step files match their checksum, 1 corrupt, 0 without a checksum" in out
    assert main(["info", "--verify", str(a)]) == 0


def test_every_flipped_data_bit_is_caught(pair):
    # 60 flips at random data bytes and bits of step 1 (seeded): each one is corruption
    a, _ = pair
    path = a / STEP1
    raw = path.read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    rng = random.Random(0)
    for _ in range(60):
        offset, bit = rng.randrange(data_start, len(raw)), rng.randrange(8)
        flip(path, offset, bit)
        with pytest.raises(ChecksumError):
            verify_step_file(path)
        flip(path, offset, bit)  # restore
    assert verify_step_file(path) is not None


def test_a_file_without_checksum_is_compared_not_skipped(tmp_path):
    # step files written by hand (no content_sha256): nothing to verify, every pair is compared
    tensors = {"completion_ids": torch.tensor([[1, 2]]), "completion_mask": torch.ones(1, 2, dtype=torch.bool),
               "policy_logprobs": torch.tensor([[-0.5, -1.0]])}
    save_file(tensors, str(tmp_path / "a.safetensors"), metadata={"algorithm": "grpo"})
    save_file(tensors, str(tmp_path / "b.safetensors"), metadata={"algorithm": "grpo"})
    report = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert report.equal and report.identical_by_checksum == 0 and report.verified_files == 0
    assert report.fields["policy_logprobs"].compared == 2
    skipped = [f for f in run_checks(tmp_path / "a.safetensors", select=["integrity"])]
    assert [f.severity for f in skipped] == ["skipped"] and "cannot be verified" in skipped[0].message
