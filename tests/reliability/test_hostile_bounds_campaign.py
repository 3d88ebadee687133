"""The issue-48 hostile classes, kept in the main suite (tests/scripts/hostile_campaign.py,
``--bounds``): every manifest key tracer reads given each wrong JSON type (the values of
test_manifest_field_types.py, plus wrong values inside the manifest's objects and in
manifest.counts), one 1 MiB token in tokens.json, 100,000 metadata keys in each step file's header
(refused) and 9,900 (allowed), and, when the test may mount a tmpfs (root), a trace whose own step
files filled a 1 MiB disk. ``tracer info``, ``tracer info --json``, ``tracer check``, ``tracer diff``
against a healthy trace and the reader's token tables each run on each input in a process of their
own: no traceback on stderr, an exit code in {0, 1, 2}, at most 10 s wall, 2 s of CPU and 500 MB peak
resident memory (the process's own, imports included: ~270 MB)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.fixtures.paths import SCRIPTS
from tests.reliability.test_manifest_field_types import WRONG_VALUES

_spec = importlib.util.spec_from_file_location("hostile_campaign", SCRIPTS / "hostile_campaign.py")
campaign = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(campaign)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    try:
        healthy, made = campaign.make_bounds_inputs(tmp_path_factory.mktemp("bounds"))
        return campaign.run_bounds(healthy, made, worker_timeout_s=600)
    finally:
        campaign.unmount_all()


def _label(r: dict) -> str:
    return f"{r['case']} / {r['tool']}"


def test_every_hostile_class_is_read_by_every_tool_in_its_own_process(results):
    cases = {"healthy", *(f"manifest_every_key_{kind}" for kind in WRONG_VALUES), "manifest_wrong_inside_objects",
             "one_huge_token", "metadata_100k_keys", "metadata_9900_keys"}
    if campaign.can_mount():
        cases.add("disk_filled")
    assert {(r["case"], r["tool"]) for r in results} == {(c, t) for c in cases for t in campaign.BOUNDS_TOOLS}


def test_no_tool_prints_a_traceback_on_a_hostile_input(results):
    assert [f"{_label(r)}: {r['stderr']}" for r in results if r["traceback"]] == []


def test_every_tool_exits_0_1_or_2_on_a_hostile_input(results):
    assert [f"{_label(r)}: exit {r['exit']}, {r['stderr']}" for r in results if r["exit"] not in (0, 1, 2)] == []


def test_every_tool_stays_within_10_s_2_cpu_s_and_500_mb_on_a_hostile_input(results):
    over = [f"{_label(r)}: {r['seconds']} s, {r['cpu_s']} s CPU, {r['peak_mb']} MB peak ({r['killed'] or 'finished'})"
            for r in results if not campaign.within_bounds(r)]
    assert over == []


def test_100k_metadata_keys_are_refused_in_one_line_and_9900_are_read(results):
    by = {(r["case"], r["tool"]): r for r in results}
    refused = by["metadata_100k_keys", "reader"]
    assert refused["exit"] == 2 and len(refused["stderr"].splitlines()) == 1
    assert re.search(r"step_00000000\.\S+: the step metadata holds 1000\d\d keys, over the limit of 10000 ",
                     refused["stderr"])
    assert by["metadata_100k_keys", "check"]["exit"] == 2
    assert all(by["metadata_9900_keys", tool]["exit"] in (0, 1) for tool in campaign.BOUNDS_TOOLS)
    assert by["one_huge_token", "reader"]["exit"] == 0


def test_a_trace_that_filled_its_disk_is_read_within_budget(results):
    if not campaign.can_mount():
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    disk = [r for r in results if r["case"] == "disk_filled"]
    assert len(disk) == len(campaign.BOUNDS_TOOLS)
    assert all(r["exit"] in (0, 1) and not r["traceback"] and campaign.within_bounds(r) for r in disk), disk
