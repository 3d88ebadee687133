"""Hostile traces under 1 MB (tests/scripts/hostile_campaign.py): zero-byte tensors with huge
shapes, token strings that cost far more memory than their size, lone surrogates and null
characters, B = 0 steps, spoofed reward component names. Every tool (``info``, ``check``,
``diff``, the reader's tables, the views, every app page) must serve or refuse each one with a
TraceError, within 5 s and 500 MB per (case, tool). The worker process runs with its address space
capped, so a regression fails here as a MemoryError instead of exhausting the machine."""

from __future__ import annotations

import importlib.util

import pytest

from tests.fixtures.paths import SCRIPTS

_spec = importlib.util.spec_from_file_location("hostile_campaign", SCRIPTS / "hostile_campaign.py")
campaign = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(campaign)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return campaign.run(app=True, worker_timeout_s=600)


def test_every_case_ran_with_every_tool(results):
    assert {(r["case"], r["tool"]) for r in results} == {
        (case, tool) for case in campaign.CASES for tool in [*campaign.TOOLS, "app"]}
    assert all(r["bytes"] < 2**20 for r in results if r["case"] != "tokens_too_many")


def test_no_tool_crashes_on_a_hostile_trace(results):
    crashes = [f"{r['case']} / {r['tool']}: {r['outcome']}" for r in results if r["outcome"] != "ok"]
    assert crashes == []


def test_no_hostile_trace_costs_more_than_5_s_or_500_mb(results):
    over = [f"{r['case']} / {r['tool']}: {r['seconds']} s, {r['peak_mb']} MB" for r in results
            if not (r["seconds"] <= campaign.TIME_LIMIT_S and r["peak_mb"] <= campaign.MEMORY_LIMIT_MB)]
    assert over == []
