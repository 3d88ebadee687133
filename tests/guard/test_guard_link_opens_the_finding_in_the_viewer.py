"""The link the live guard prints with a finding (``| open: tracer view RUN → http://…/tokens?…``)
opens that finding in the viewer started as the line says (``tracer view RUN``: the run is the root):
no "not a trace under the root" refusal, the finding's step file and sequence shown, the token marked,
and the tokens coloured by the field the finding is about. The link once named the run
``<name> (the root)``, the sidebar's label, which the viewer reads as a path under the root and refuses."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from streamlit.testing.v1 import AppTest

from tracer.checks import ERROR, run_checks
from tracer.guard.guard import VIEW_URL, view_link

from tests.fixtures.toy_traces import APP, write_trace


def _wrong_k3(step, inner, tensors):
    if (step, inner) == (1, 0):  # one recorded k3 value off at seq 2, token 3
        tensors["ref_kl_k3"] = tensors["ref_kl_k3"].clone()
        tensors["ref_kl_k3"][2, 3] += 0.5


def test_the_printed_link_opens_the_finding_on_the_tokens_page(tmp_path, monkeypatch):
    run = write_trace(tmp_path / "run", steps=2, edit=_wrong_k3)
    (finding,) = [f for f in run_checks(run) if f.severity == ERROR and f.check == "recompute.ref_kl_k3"]
    assert (finding.step, finding.inner_step, finding.sequence, finding.token) == (1, 0, 2, 3)
    command, url = view_link(finding.to_dict(), run).split(" → ")
    assert command == f"tracer view {run}"
    parts = urlsplit(url)
    assert f"{parts.scheme}://{parts.netloc}" == VIEW_URL and parts.path == "/tokens"
    query = dict(parse_qsl(parts.query))
    assert query == {"run": ".", "step": "1", "inner": "0", "mb": "0", "rank": "0", "seq": "2", "token": "3",
                     "colour": "ref_kl_k3"}

    monkeypatch.setenv("TRACER_ROOT", str(run))  # tracer view RUN: the run is the viewer's root
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update(query)
    at.switch_page("app_pages/tokens.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    refusals = [el.value for kind in ("error", "warning", "info") for el in at.get(kind)
                if "not a trace under the root" in str(el.value)]
    assert refusals == []
    assert any(t.value.startswith("step 1 · inner 0 · mb 0 · rank 0 · sequence 2") for t in at.text), \
        [t.value for t in at.text]
    assert at.selectbox(key="colour_by").value == "ref_kl_k3"
    assert any("marked by the link: token 3" in c.value for c in at.caption), [c.value for c in at.caption]
