"""The documentation agrees with the code: SPEC.md references resolve, docs/checks.md lists every
registered check, the field table of docs/format.md is what docs/fields_table.py prints from the
schema, the docs' relative links point to files that exist, and the README stays a first read (under
250 lines, the test command .ci/run calls on it)."""

import contextlib
import importlib.util
import io
import re

from tracer.checks import CHECKS

from tests.fixtures.paths import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_every_spec_section_reference_resolves():
    sections = set(re.findall(r"^## (\d+)\. ", (REPO / "SPEC.md").read_text(encoding="utf-8"), re.M))
    assert sections == {str(n) for n in range(1, 11)}
    files = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "tracer").rglob("*.py")]
    for path in files:
        for number in re.findall(r"SPEC(?:\.md)? section (\d+)", path.read_text(encoding="utf-8")):
            assert number in sections, f"{path.relative_to(REPO)} cites SPEC section {number}, which SPEC.md lacks"


def test_docs_checks_lists_every_registered_check():
    doc = (REPO / "docs" / "checks.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", doc, re.M))
    assert listed == set(CHECKS), (
        f"docs/checks.md's table lacks {sorted(set(CHECKS) - listed)} and lists unknown {sorted(listed - set(CHECKS))}; "
        "add a row (id | severity | rule) per registered check")


def test_field_table_is_generated_from_the_schema():
    spec = importlib.util.spec_from_file_location("fields_table", REPO / "docs" / "fields_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main()
    assert out.getvalue().strip() in (REPO / "docs" / "format.md").read_text(encoding="utf-8"), (
        "docs/format.md's field table differs from the schema: paste the output of `python docs/fields_table.py`")


def test_relative_links_in_the_docs_exist():
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            assert (path.parent / target).exists(), f"{path.relative_to(REPO)} links to {target}, which does not exist"


def _heading_anchors(path):
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to
    hyphens), code blocks left out (a ``# comment`` there is no heading)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_links_to_a_section_name_a_heading_there():
    # sections moved between the README and docs/ must not leave links to an anchor that is gone
    assert "a-checkout-in-a-folder-named-tracer" in _heading_anchors(REPO / "docs" / "install.md")
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target, anchor in re.findall(r"\]\(([^)#:]*)#([^)]+)\)", path.read_text(encoding="utf-8")):
            dest = path.parent / target if target else path
            if dest.suffix == ".md":
                assert anchor in _heading_anchors(dest), f"{path.relative_to(REPO)} links to {target}#{anchor}, " \
                                                         "which names no heading there"


def test_readme_keeps_the_ci_test_command():
    assert "make test   # install everything, run the test suite" in README
    assert (REPO / ".ci" / "run").read_text(encoding="utf-8").rstrip().endswith("\nmake test")


def test_readme_is_a_first_read_under_250_lines_with_the_cost_of_make_test():
    assert len(README.splitlines()) < 250
    setup = README[README.index("## Set up"):README.index("## Attach")]
    for venv in (".venv", ".venv-verl", ".venv-vllm"):  # each venv with its size, and the suite's time
        assert re.search(rf"`{re.escape(venv)}`[^`]*\(([^)]*)?\d(\.\d)? GB", setup), venv
    assert re.search(r"~\d+-\d+ min for\s+the main suite", setup)
