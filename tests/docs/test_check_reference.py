"""docs/checks.md's "Check reference" covers every registered check with what it needs, what it assumes
and a real example message, and is exactly what docs/check_reference.py prints now (each example comes
from running the check on a trace the script writes)."""

import contextlib
import importlib.util
import io
import re

import pytest

from tracer.checks import CHECKS

from tests.fixtures.paths import REPO

DOC = REPO / "docs" / "checks.md"


@pytest.fixture(scope="module")
def reference():
    """The script as a module, and what its main() prints."""
    spec = importlib.util.spec_from_file_location("check_reference", REPO / "docs" / "check_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main()
    return module, out.getvalue()


def _sections(text: str) -> dict[str, str]:
    """``{check id: its section's text}`` of the printed reference."""
    parts = re.split(r"^### `([a-z_]+\.[a-z_0-9]+)`$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_registered_check_has_needs_assumes_and_a_trace(reference):
    module, _ = reference
    assert set(module.REFERENCE) == set(CHECKS), (
        f"REFERENCE lacks {sorted(set(CHECKS) - set(module.REFERENCE))}, "
        f"has unknown {sorted(set(module.REFERENCE) - set(CHECKS))}")
    assert set(module.TRACES) == set(CHECKS)
    for check_id, entry in module.REFERENCE.items():
        assert entry["needs"].strip() and entry["assumes"].strip(), check_id


def test_every_check_gets_a_section_with_a_non_empty_example(reference):
    _, printed = reference
    sections = _sections(printed)
    assert list(sections) == list(CHECKS)  # one each, in the registry's (running) order
    for check_id, body in sections.items():
        needs = re.search(r"^\*\*Needs:\*\* (\S.*)$", body, re.MULTILINE)
        assumes = re.search(r"^\*\*Assumes:\*\* (\S.*)$", body, re.MULTILINE)
        example = re.search(r"^\*\*Example\*\* \((error|warning|info);.*\n\n```text\n(.+?)\n```", body, re.MULTILINE | re.DOTALL)
        assert needs and assumes and example, check_id
        assert example.group(2).strip(), check_id


def test_examples_are_the_checks_own_messages(reference):
    # spot-check against the checks' wording, pinned in their own tests (tests/checks/test_ten_cases.py,
    # tests/checks/test_effective_config.py): the script shows what run_checks returned, not a paraphrase
    _, printed = reference
    sections = _sections(printed)
    assert "mean ratio 1.0146 (expected 1 ± 0.001)" in sections["identity.first_step"]
    assert "loss aggregation in effect is seq-mean-token-sum, config declares token-mean" in \
        sections["recompute.loss_agg_mode"]
    assert "token_rewards[0, 4] = 1 sits at a masked position" in sections["advantages.reward_placement"]
    assert "RUN/" in sections["integrity.checksum"] and "/tmp" not in printed  # no machine-specific path


def test_docs_checks_md_holds_the_current_reference_at_its_end(reference):
    _, printed = reference
    doc = DOC.read_text(encoding="utf-8")
    assert printed.strip() in doc, (
        "docs/checks.md's Check reference differs from what the checks say now: run "
        "`python docs/check_reference.py --write` (it replaces the section from '## Check reference' to the end)")
    assert doc.rstrip().endswith(printed.strip())
