"""pytest support: ``assert_traces_match`` and the ``trace_regression`` fixture.

The fixture compares a trace your test produced with a baseline committed next to the test, in
the style of pytest-regressions, and (re)records the baseline only when pytest runs with
``--tracer-regen``. It is a pytest plugin: installed ``tracer`` registers it through the
``pytest11`` entry point; without the install, add ``pytest_plugins = ["tracer.testing"]`` to
your ``conftest.py``. See docs/regression-testing.md.

Baselines live in ``<test file dir>/<test file stem>/<test name>[.<basename>]`` (a trace directory,
or a ``.safetensors`` file when the produced trace is a single step file).

Both verify every step file's bytes against its recorded checksum before comparing (``tracer.diff``):
a corrupt baseline or trace fails the test naming the file, never passes as equal.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

import pytest

from tracer.diff import DiffReport, diff
from tracer.errors import ChecksumError, TraceError
from tracer.read import Trace
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME
from tracer.format.scalar_log import SCALARS_GLOB

REGEN_FLAG = "--tracer-regen"

__all__ = ["assert_traces_match", "failure_message", "TraceRegression", "trace_regression", "REGEN_FLAG"]


def failure_message(report: DiffReport) -> str:
    """What a failing comparison says: the report of ``tracer diff --verbose``: the short report (its
    first line is the headline: the upstream cause), then the details."""
    return report.format(verbose=True)


def _tolerances(atol, rtol, field_tolerances: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """Merge ``atol=``/``rtol=`` (number or per-field mapping) with ``field=atol`` or
    ``field=(atol, rtol)`` keywords into two per-field maps (``"*"`` = every other float field)."""
    atols: dict[str, float] = {"*": atol} if isinstance(atol, (int, float)) else dict(atol or {})
    rtols: dict[str, float] = {"*": rtol} if isinstance(rtol, (int, float)) else dict(rtol or {})
    for name, tol in field_tolerances.items():
        if isinstance(tol, (tuple, list)) and len(tol) == 2:
            atols[name], rtols[name] = tol
        elif isinstance(tol, (int, float)) and not isinstance(tol, bool):
            atols[name] = tol
        else:
            raise TypeError(f"tolerance for {name!r} is {tol!r}; pass {name}=atol or {name}=(atol, rtol)")
    return atols, rtols


def assert_traces_match(
    actual: str | os.PathLike,
    expected: str | os.PathLike,
    *,
    atol: float | Mapping[str, float] | None = None,
    rtol: float | Mapping[str, float] | None = None,
    fields: Iterable[str] | None = None,
    ignore_metadata: Iterable[str] = (),
    **field_tolerances: float | tuple[float, float],
) -> DiffReport:
    """Assert that trace ``actual`` matches trace ``expected`` (the reference) within tolerance.

    Tolerances: ``atol``/``rtol`` for every float field, or per field as
    ``policy_logprobs=1e-4`` (atol) or ``ratio=(1e-4, 1e-3)`` (atol, rtol); unset fields use the
    dtype defaults of :data:`tracer.diff.DEFAULT_TOLERANCES`.

    Returns:
        The DiffReport when the traces match.

    Raises:
        AssertionError: :func:`failure_message` (a = expected, b = actual) when they do not match.
        ChecksumError: a step file of either trace is corrupt (its bytes disagree with its checksum).
        TraceError: unusable input (not a trace, different algorithms, shapes...).
    """
    __tracebackhide__ = True
    atols, rtols = _tolerances(atol, rtol, field_tolerances)
    report = diff(expected, actual, atol=atols, rtol=rtols, fields=fields, ignore_metadata=ignore_metadata,
                  labels=("expected", "actual"), progress=False)
    if not report.equal:
        raise AssertionError(failure_message(report))
    return report


def _copy_trace(src: Path, dst: Path) -> None:
    """Replace ``dst`` with a copy of trace ``src`` (manifest, token strings, step files, and the
    scalars logged after their steps: data no step file holds) through a temporary name and a rename."""
    if dst.exists() and dst.is_dir() and any(dst.iterdir()) and not (
            (dst / MANIFEST_NAME).is_file() or (dst / STEPS_DIR).is_dir()):
        raise TraceError(f"refusing to replace {dst}: it exists and is not a trace; move it away or "
                         "pass another basename")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".partial")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    elif tmp.exists():
        tmp.unlink()
    if src.is_file():
        shutil.copyfile(src, tmp)
    else:  # the trace files only: a run directory may hold more (a model, logs)
        (tmp / STEPS_DIR).mkdir(parents=True)
        for path in [src / MANIFEST_NAME, src / TOKENS_NAME, *src.glob("*.safetensors"), *src.glob(SCALARS_GLOB),
                     *(src / STEPS_DIR).glob("*.safetensors")]:
            if path.is_file():
                shutil.copyfile(path, tmp / path.relative_to(src))
    if dst.is_dir():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


class TraceRegression:
    """Compares produced traces with committed baselines (the ``trace_regression`` fixture).

    Args:
        baseline_dir: folder of this test's baselines.
        name: the test's name, sanitised for a file name.
        regen: True when pytest runs with ``--tracer-regen``.
    """

    def __init__(self, baseline_dir: Path, name: str, regen: bool) -> None:
        self.baseline_dir, self.name, self.regen = Path(baseline_dir), name, regen

    def baseline_path(self, trace: str | os.PathLike, basename: str | None = None) -> Path:
        """Where the baseline of ``trace`` lives."""
        stem = self.name if basename is None else f"{self.name}.{basename}"
        return self.baseline_dir / (stem + (".safetensors" if Path(trace).is_file() else ""))

    def check(
        self,
        trace: str | os.PathLike,
        basename: str | None = None,
        *,
        atol: float | Mapping[str, float] | None = None,
        rtol: float | Mapping[str, float] | None = None,
        fields: Iterable[str] | None = None,
        ignore_metadata: Iterable[str] = (),
        **field_tolerances: float | tuple[float, float],
    ) -> DiffReport | None:
        """Compare ``trace`` (directory or step file) with its baseline, as ``assert_traces_match``.

        Without ``--tracer-regen``: fails when the baseline is missing (recording nothing) or
        differs. With ``--tracer-regen``: records the baseline when it is missing or differs and
        fails the test to say so (so a run with the flag is never mistaken for a pass); a baseline
        that matches is left untouched. ``basename`` tells apart several traces of one test.
        """
        __tracebackhide__ = True
        trace = Path(trace)
        Trace(trace)  # a clear TraceFormatError when the test did not produce a trace
        baseline = self.baseline_path(trace, basename)
        if not baseline.exists():
            if self.regen:
                _copy_trace(trace, baseline)
                pytest.fail(f"recorded the trace baseline {baseline} from {trace} ({REGEN_FLAG}); commit it "
                            f"and rerun without {REGEN_FLAG}", pytrace=False)
            pytest.fail(f"no trace baseline at {baseline}; record it from {trace} by running pytest with "
                        f"{REGEN_FLAG}, then commit it", pytrace=False)
        atols, rtols = _tolerances(atol, rtol, field_tolerances)
        try:
            report = diff(baseline, trace, atol=atols, rtol=rtols, fields=fields, ignore_metadata=ignore_metadata,
                          labels=("expected", "actual"), progress=False)
        except ChecksumError as err:
            if self.regen and str(trace) not in str(err):  # only the baseline is corrupt: replace it
                _copy_trace(trace, baseline)
                pytest.fail(f"re-recorded the corrupt trace baseline {baseline} ({REGEN_FLAG}): {err}", pytrace=False)
            pytest.fail(f"tracer diff: CORRUPT: {err}\n\nA corrupt baseline: restore it from version control "
                        f"(git checkout -- {baseline}) or re-record it with pytest {REGEN_FLAG}.", pytrace=False)
        if report.equal:
            return report
        if self.regen:
            _copy_trace(trace, baseline)
            pytest.fail(f"re-recorded the trace baseline {baseline} ({REGEN_FLAG}); it differed:\n\n"
                        f"{failure_message(report)}", pytrace=False)
        pytest.fail(f"{report.format()}\n\nIf this change is intended, re-record the baseline with pytest "
                    f"{REGEN_FLAG} and commit it.\n\ndetails (--verbose):\n{report.details_text()}", pytrace=False)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tracer", "tracer trace regression tests")
    group.addoption(REGEN_FLAG, action="store_true", default=False,
                    help="(re)record the baselines of trace_regression.check() instead of only comparing")


@pytest.fixture
def trace_regression(request: pytest.FixtureRequest) -> TraceRegression:
    """Compare a produced trace with a committed baseline: ``trace_regression.check(out_dir)``."""
    path = Path(request.node.path)
    name = re.sub(r"[^\w.-]+", "_", request.node.name).strip("_")
    return TraceRegression(path.parent / path.stem, name, bool(request.config.getoption("tracer_regen")))
