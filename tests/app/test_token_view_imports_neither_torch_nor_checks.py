"""The Tokens page of a cold server imports what it draws and nothing else: opening a run's token
view (the entry script, the sidebar, the navigation and the Tokens page, through Streamlit's
AppTest in a fresh interpreter) leaves torch, the checks (``tracer.checks``), the diff engine
(``tracer.diff``), the step view (``tracer.views.step``) and the Runs table out of ``sys.modules``:
each costs a page that does not show it ~1.3 s (torch) and ~200 MiB of server memory. The Health
page, which shows the checks' findings, does import them."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.fixtures.toy_traces import APP, REPO, TOKENS_PAGE, ToyTokenizer, write_trace

HEAVY = ("torch", "tracer.checks", "tracer.diff", "tracer.views.step", "app.components.runs")
PROBE = """
import json, os, sys
sys.path.insert(0, {repo!r})
os.environ["TRACER_ROOT"] = {root!r}
from streamlit.testing.v1 import AppTest
at = AppTest.from_file({app!r}, default_timeout=120)
at.query_params.update({{"run": "run", "step": "1", "seq": "2"}})
at.switch_page({page!r}).run()
texts = [t.value for t in at.text]
print(json.dumps({{"errors": [str(e.value) for e in at.exception], "texts": texts,
                  "loaded": {{m: m in sys.modules for m in {heavy!r}}}}}))
"""


def probe(root, page: str) -> dict:
    code = PROBE.format(repo=str(REPO), root=str(root), app=str(APP), page=page, heavy=HEAVY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_token_view_loads_no_torch_no_checks_and_health_does(tmp_path):
    write_trace(tmp_path / "run", tokenizer=ToyTokenizer())
    tokens = probe(tmp_path, TOKENS_PAGE)
    assert not tokens["errors"], tokens["errors"]
    assert any(t.startswith("step 1 · inner 0 · mb 0 · rank 0 · sequence 2") for t in tokens["texts"]), tokens["texts"]
    assert tokens["loaded"] == dict.fromkeys(HEAVY, False)
    health = probe(tmp_path, "app_pages/health.py")  # the page that shows findings runs the checks
    assert not health["errors"], health["errors"]
    assert health["loaded"]["tracer.checks"] and health["loaded"]["torch"]
