"""Trace vs trace: ``diff(a, b) -> DiffReport``, mask-aware, streaming tensor by tensor.

The stage, one module per step: ``inputs`` (what can be compared, step pairing, tolerances),
``engine`` (the comparison, after verifying every file), ``stats`` (per-field statistics: tolerance
test, drift, shift), ``tokens`` (where the sampled tokens agree), ``scalars`` (the per-step scalars
recorded with the steps and logged after them), and the result: ``locations``
(step labels, tolerances, differing positions), ``result`` (the data and conclusions: FieldDiff,
the cause, findings, notes), ``report`` (DiffReport: verbose text, field table, JSON) and ``causes``
(the headline and the short text); ``token_table`` puts one step pair's tokens side by side.

Rules (documented in docs/regression-testing.md):

- Integrity first: every paired step file that records ``content_sha256`` (TraceWriter's files do)
  is verified against its bytes (``tracer.format.integrity.verify_step_file``). A mismatch is corruption
  of that file: :class:`~tracer.errors.ChecksumError` naming it, nothing is compared (the CLI exits
  2). Step pairs whose two *verified* checksums agree are identical and not compared further.
- Step files are matched by ``(step, inner_step, micro_batch, rank)``; two single step files are
  compared with each other whatever their step numbers. Steps on one side only are findings.
- A field that one side records and the other side derives (``tracer.formulas.derived``: ``ratio``,
  ``ref_kl_k3``, ``approx_kl_k2`` from the recorded logprobs, as the reader does) is derived on
  that side from its own inputs and metadata and compared by value like any field; equal, it is a
  note (``report.notes()``), not "only in b"; different, it is a finding marked ``[derived in a]``.
- Step metadata: a key both sides record with different values (``beta`` 0.04 vs 0.1) is a finding
  (``report.metadata_conflicts``; exit 1; the verdict says "metadata only" when the tensors are
  equal); a key only one side records (hyperparameters the zero-edit ``tracer run`` cannot know) is
  a note: it does not make the traces unequal (exit 0).
- Per-token fields are compared only where both sides keep the position: ``completion_mask`` for
  ``[B, T]`` fields, ``chosen_mask``/``rejected_mask`` for ``chosen_*``/``rejected_*`` fields,
  ``prompt_mask`` for ``[B, L]`` fields. Masks themselves are compared everywhere, exactly. Fields
  outside the schema are compared at every position.
- Token alignment: token-aligned ``[B, T]`` value fields (logprobs, ratio, KL, entropy, values,
  per-token advantages and loss) are compared only where both sides also have the same prompt and
  the same tokens up to that position (``tracer.diff.tokens``); the report counts the positions
  whose tokens differ and locates the first one.
- Integer and bool fields compare exactly. Float fields pass when ``|b - a| <= atol + rtol * |a|``
  (``a`` is the reference), with defaults by the coarser dtype of the two sides (those of
  ``torch.testing.assert_close``, see ``DEFAULT_TOLERANCES``), overridable per field.
- Drift: with ``d = b - a`` over the compared finite positions of a float field, in the step pairs
  where that field's values differ at all, a drift is reported when at least
  ``DRIFT_MIN_POSITIONS`` positions are compared, ``|mean(d)| > DRIFT_FRACTION * (atol + rtol *
  mean|a|)``, and at least ``DRIFT_SIGN_SHARE`` of all those positions have ``d`` of the sign of
  the mean: a one-sided shift fails the diff even when every element is within tolerance, while a
  few outliers (``d = 0`` elsewhere) or symmetric noise do not count as drift.
- Shift: when a ``[B, T]``/``[B, L]`` field differs, ``b[t]`` is compared with ``a[t-1]`` (shift
  +1) and ``a[t+1]`` (shift -1) where both neighbours are kept; a shift is reported when the
  shifted comparison passes everywhere, or its mean ``|Δ|`` is under ``SHIFT_IMPROVEMENT`` times
  the unshifted one.
- Scalars: the per-step scalars (``record(..., scalars=...)`` in each step file's summary header,
  ``log_scalars``/TRL's logs in ``scalars.rank_N.jsonl``) are compared as float fields named
  ``scalars/<name>`` (one position per step file, or per step for logged ones), by the rule above
  with the caller's tolerances; the default is float32's rtol with an atol of that rtol times the
  scalar's largest ``|value|`` (``tracer.diff.scalars``). A scalar one side lacks, and those that
  measure the machine (``step_time``, throughput, memory), are notes, not findings.
- Cause: the headline names the failing field that diverges at the earliest step and, at that
  step, comes first in the data-flow order ``tracer.format.schema.DATA_FLOW`` (SPEC.md section 10); the
  other failing fields are listed under it as following from it; a scalar only when no tensor field
  diverges at its step number. When every field recorded at inner
  step i is equal (or only its loss differs) and the first field to differ at inner i + 1 is a policy
  field, the headline names the update between them instead (``DiffResult.update_cause``).
"""

from tracer.diff.engine import IGNORED_METADATA, diff
from tracer.diff.inputs import DiffInputError, comparable, parse_tolerances
from tracer.diff.locations import Location, Tolerance, step_label
from tracer.diff.report import DiffReport
from tracer.diff.result import FieldDiff
from tracer.diff.stats import (DEFAULT_TOLERANCES, DRIFT_FRACTION, DRIFT_MIN_POSITIONS, DRIFT_SIGN_SHARE,
                               SHIFT_IMPROVEMENT)
from tracer.diff.token_table import token_diff_table
from tracer.diff.tokens import TokenAlignment

__all__ = ["diff", "token_diff_table", "comparable", "parse_tolerances", "DiffReport", "FieldDiff", "Location",
           "TokenAlignment", "Tolerance", "DiffInputError", "step_label", "IGNORED_METADATA", "DEFAULT_TOLERANCES",
           "DRIFT_FRACTION", "DRIFT_SIGN_SHARE", "DRIFT_MIN_POSITIONS", "SHIFT_IMPROVEMENT"]
