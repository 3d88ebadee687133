"""What a diff found, as data: :class:`FieldDiff` (one field over every step pair) and
:class:`DiffResult` (the two traces: steps, fields, metadata, token alignment, producers), with the
conclusions drawn from them (the cause, what follows from it, findings, notes, the verdict).

Side ``a`` is the reference (the baseline, ``expected``) and side ``b`` the candidate (``actual``):
differences are ``b - a`` and relative tolerances are relative to ``|a|``. The renderings (short and
verbose text, the field table, JSON) are :mod:`tracer.diff.report` and :mod:`tracer.diff.causes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tracer.diff.locations import EXACT, FLOAT, MASK, Location, StepId, Tolerance, step_label, step_list
from tracer.diff.tokens import TokenAlignment
from tracer.format.schema import flow_rank
from tracer.format.summary import SCALAR_PREFIX


@dataclass
class FieldDiff:
    """How one field compares over all step pairs that were read.

    Attributes:
        kind: ``float`` (tolerance), ``exact`` (ids, group ids) or ``mask`` (``*_mask``, exact).
        tolerance: the tolerance used (None for exact kinds).
        mask: the mask whose kept positions (kept on both sides) are compared; None = every position.
        compared, differing: positions compared and positions outside tolerance.
        max_abs_diff: max ``|b - a|`` over compared positions = the smallest atol that passes at rtol 0.
        min_rtol: smallest rtol that passes at atol 0 (``max |b - a| / |a|``; inf when a = 0 and b != 0).
        mean_diff: mean of ``b - a`` over compared finite positions of the step pairs where the
            field differs at all (floats only; 0.0 when it never differs).
        drift: a one-sided shift (see ``tracer.diff`` for the rule); ``drift_detail`` says why.
        shift: +1 when ``b[t] ≈ a[t-1]``, -1 when ``b[t] ≈ a[t+1]`` on kept positions, else None.
        kept_only_in_a, kept_only_in_b: for masks, positions one side keeps and the other does not.
        first: the first differing position (step order, then position).
        worst: the worst differing positions (largest ``|b - a|`` first; exact kinds: first ones).
        derived_in: ``"a"``/``"b"`` when that side does not record the field and it was derived
            there from the recorded inputs, as the reader does (``tracer.formulas.derived``); None: recorded.
    """

    name: str
    kind: str
    dtype_a: str
    dtype_b: str
    tolerance: Tolerance | None
    mask: str | None
    compared: int = 0
    differing: int = 0
    step_pairs_differing: int = 0
    max_abs_diff: float = 0.0
    min_rtol: float = 0.0
    mean_diff: float | None = None
    drift: bool = False
    drift_detail: str = ""
    shift: int | None = None
    shift_detail: str = ""
    kept_only_in_a: int = 0
    kept_only_in_b: int = 0
    first: Location | None = None
    worst: list[Location] = field(default_factory=list)
    derived_in: str | None = None

    @property
    def passed(self) -> bool:
        return self.differing == 0 and not self.drift

    @property
    def share(self) -> float:
        """Share of compared positions that differ."""
        return self.differing / self.compared if self.compared else 0.0

    @property
    def min_atol(self) -> float:
        """Smallest atol that passes at rtol 0."""
        return self.max_abs_diff

    def severity(self) -> float:
        """How many tolerances out the worst position is (for ordering fields worst first)."""
        if self.kind != FLOAT or not self.worst or self.tolerance is None:
            return math.inf
        loc = self.worst[0]
        allowed = self.tolerance.at(loc.a if isinstance(loc.a, float) else 0.0)
        return loc.abs_diff / allowed if allowed > 0 else math.inf

    def summary(self) -> str:
        """One line in the style of TRL's invariant tests (``[derived in a]`` at the end for a
        field one side derives)."""
        return self._summary() + (f" [derived in {self.derived_in}, recorded in {'b' if self.derived_in == 'a' else 'a'}]"
                                  if self.derived_in else "")

    def _summary(self) -> str:
        n = f"{self.differing} of {self.compared} {'kept ' if self.mask else ''}positions"
        if self.kind == MASK:
            first = f", first at {self.first.where()} ({self.first.values()})" if self.first else ""
            return (f"{self.name}: masks differ at {n} ({self.share:.2%}; kept only in a: "
                    f"{self.kept_only_in_a}, kept only in b: {self.kept_only_in_b}){first}")
        if self.kind == EXACT:
            first = f", first at {self.first.where()} ({self.first.values()})" if self.first else ""
            return f"{self.name}: {n} differ ({self.share:.2%}){first}"
        if self.differing == 0:
            return f"{self.name}: {self.drift_detail}"
        loc, tol = self.worst[0], self.tolerance
        allowed = tol.at(loc.a) if tol is not None and isinstance(loc.a, float) else 0.0
        return (f"{self.name}: max |Δ|={self.max_abs_diff:.1e} at {loc.where()} "
                f"({loc.values()}, tol={allowed:.1e}); {n} differ ({self.share:.2%})")


@dataclass
class StepDifference:
    """How one field differs in one step pair (kept for the first step pairs that differ: enough to
    tell whether an update is the cause, :attr:`DiffResult.update_cause`).

    Attributes:
        differing: positions outside tolerance in this pair.
        max_abs_diff: max ``|b - a|`` over them.
        first: the pair's first differing position.
    """

    differing: int
    max_abs_diff: float
    first: Location


@dataclass
class UpdateCause:
    """The update between two inner steps of one step as the cause of a diff: every recorded input
    of the update (the step files of ``before``) is equal in both traces, yet the policy the next
    pass scores (``after``) differs. What changed is the update itself: its loss, its gradients or the
    optimizer's state (learning rate, clipping, moments).

    Attributes:
        before, after: ``(step, inner_step)`` of the two passes; ``after = (step, inner_step + 1)``.
        effect: the first policy field that differs at ``after`` (``policy_logprobs``...).
        effect_at: where it first differs.
        loss: ``{field: StepDifference}`` for the loss fields (``per_token_loss``, ``dpo_loss``,
            ``loss``, the scalar ``scalars/loss``) that differ at ``before``; empty when the recorded
            loss is equal.
        loss_recorded: the loss fields the traces record (empty: the loss is not recorded).
        metadata: ``{key: (a, b)}`` step metadata both sides record with different values, first at or
            before ``before`` (the configuration the two runs were given).
        scalars: ``{"scalars/<name>": StepDifference}`` for the scalars recorded or logged with
            ``before`` that differ (a learning rate, a gradient norm: the update's own numbers).
    """

    before: tuple[int, int]
    after: tuple[int, int]
    effect: FieldDiff
    effect_at: Location
    loss: dict[str, StepDifference]
    loss_recorded: list[str]
    metadata: dict[str, tuple[Any, Any]]
    scalars: dict[str, StepDifference] = field(default_factory=dict)

    def name(self) -> str:
        """``the update between step 0 inner 0 and inner 1``."""
        (step, inner), (_, next_inner) = self.before, self.after
        return f"the update between step {step} inner {inner} and inner {next_inner}"


POLICY_STAGE = flow_rank("policy_logprobs")[0]
LOSS_STAGE = flow_rank("per_token_loss")[0]  # per_token_loss, dpo_loss; then loss, then non-canonical fields
UPDATE_GROUPS_KEPT = 2  # (step, inner) groups whose step pairs keep their StepDifferences
SCALAR_LOSS = SCALAR_PREFIX + "loss"  # the loss as a scalar the loop recorded or logged (TRL's logs, the demos)


@dataclass
class DiffResult:
    """What :func:`tracer.diff` found, as data and one-line statements (findings, notes, verdict);
    :class:`tracer.diff.report.DiffReport` adds the renderings. ``equal`` is True when nothing below
    is a finding.

    Attributes:
        a, b: the two paths; ``labels`` name them in messages (``("expected", "actual")``).
        step_pairs: step files matched on both sides; ``identical_by_checksum`` of them were skipped
            because both files' bytes were verified against their ``content_sha256`` and the two
            checksums agree (statistics cover the other pairs).
        verified_files: step files whose bytes were verified against their recorded checksum.
        only_in_a, only_in_b: steps ``(step, inner_step, micro_batch, rank)`` on one side only.
        fields: every compared field, passing or not, in comparison order.
        missing_fields: ``{field: {"only_in": "a"|"b", "step_pairs": n, "first_step": StepId}}``.
        metadata: ``{key: {"a": .., "b": .., "only_in": "a"|"b"|None, "step_pairs": n, "first_step":
            StepId}}`` for step metadata that differs (``content_sha256``, ``source_dtype``, ``summary``
            and step identity ignored). A key both sides record with different values is a finding
            (:attr:`metadata_conflicts`); a key only one side records (``only_in``) is a note: the
            other trace does not say, which is no difference between the runs.
        unreadable: ``{step label: reason}`` for step pairs not compared because a file on either
            side cannot be read (the reason names the file); such a pair makes the traces unequal.
        token_alignment: ``{ids field: TokenAlignment}``, how the sampled tokens line up.
        sampling: ``{"a": .., "b": ..}``, each trace's manifest ``sampling`` (``every_n_steps``...),
            to say why steps are on one side only.
        producers: ``{"a": .., "b": ..}``, each trace's manifest ``producers`` (package versions,
            ``cpu_kernels``, ``mkl_cbwr``): not compared; :attr:`producer_differences` are a note.
        compared_steps: the step ids of the matched step pairs, in order.
        fields_selected: only some fields were compared (``fields=``): no claim about every input.
        step_differences: ``{step id: {field: StepDifference}}`` for the step pairs of the first
            :data:`UPDATE_GROUPS_KEPT` ``(step, inner_step)`` groups that differ (bounded memory).
        scalars_not_compared: the ``scalars/<name>`` that measure the machine (wall-clock times,
            throughput, memory: :func:`tracer.diff.scalars.machine_scalar`), left out (a note). The
            other scalars are compared in :attr:`fields`.
        scalars_only_in: ``{"scalars/<name>": {"only_in": "a"|"b", "step_pairs": n, "first_step":
            StepId}}`` for scalars one trace records or logs and the other does not (a note, as a
            metadata key on one side: what a run records is no difference between the runs; a
            baseline recorded before its loop recorded scalars still passes).
    """

    a: str
    b: str
    labels: tuple[str, str] = ("a", "b")
    algorithm: str | None = None
    step_pairs: int = 0
    identical_by_checksum: int = 0
    verified_files: int = 0
    only_in_a: list[StepId] = field(default_factory=list)
    only_in_b: list[StepId] = field(default_factory=list)
    fields: dict[str, FieldDiff] = field(default_factory=dict)
    missing_fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    token_alignment: dict[str, TokenAlignment] = field(default_factory=dict)
    sampling: dict[str, dict[str, Any]] = field(default_factory=dict)
    producers: dict[str, dict[str, str]] = field(default_factory=dict)
    compared_steps: list[StepId] = field(default_factory=list)
    fields_selected: bool = False
    step_differences: dict[StepId, dict[str, StepDifference]] = field(default_factory=dict)
    scalars_not_compared: list[str] = field(default_factory=list)
    scalars_only_in: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def differing_fields(self) -> list[FieldDiff]:
        """Failing fields, worst first: masks, then exact fields, then floats by severity."""
        order = {MASK: 0, EXACT: 1, FLOAT: 2}
        bad = [f for f in self.fields.values() if not f.passed]
        return sorted(bad, key=lambda f: (order[f.kind], f.differing == 0, -f.severity()))

    @property
    def tensors_equal(self) -> bool:
        """The same step files and fields, every field within tolerance (step metadata aside)."""
        return not (self.only_in_a or self.only_in_b or self.missing_fields or self.differing_fields
                    or self.unreadable)

    @property
    def metadata_conflicts(self) -> dict[str, dict[str, Any]]:
        """Metadata keys both sides record, with different values (findings)."""
        return {k: m for k, m in self.metadata.items() if m.get("only_in") is None}

    @property
    def equal(self) -> bool:
        """Nothing differs: :attr:`tensors_equal` and no :attr:`metadata_conflicts` (a metadata key
        recorded on one side only, or a field derived on one side and equal, is a note)."""
        return self.tensors_equal and not self.metadata_conflicts

    @property
    def metadata_only(self) -> bool:
        """The tensors are equal within tolerance and only step metadata values differ."""
        return self.tensors_equal and bool(self.metadata_conflicts)

    @property
    def cause(self) -> FieldDiff | None:
        """The headline field: among failing fields, the one that diverges at the earliest step
        and, at that step, comes first in the data-flow order (``tracer.format.schema.DATA_FLOW``, SPEC.md
        section 10); every other failing field follows from it. A field failing by drift alone
        (no located position) is the cause only when no field has a located divergence. A per-step
        scalar (``scalars/<name>``) is the cause only when no tensor field diverges at its step
        number: a logged scalar covers its whole step (every inner step and micro-batch), and a
        recorded one (a learning rate) is the evidence of an update the tensors then name
        (:attr:`update_cause`)."""
        bad = [f for f in self.fields.values() if not f.passed]
        located = [f for f in bad if f.first is not None]
        if located:
            return min(located, key=lambda f: (f.first.step[0], f.name.startswith(SCALAR_PREFIX), f.first.step,
                                               flow_rank(f.name), f.name))
        return min(bad, key=lambda f: (flow_rank(f.name), f.name)) if bad else None

    @property
    def downstream(self) -> list[FieldDiff]:
        """Failing fields other than :attr:`cause`, in data-flow order (then by first step)."""
        cause = self.cause
        far = (math.inf, 0, 0, 0)
        return sorted((f for f in self.fields.values() if not f.passed and f is not cause),
                      key=lambda f: (flow_rank(f.name), f.first.step if f.first else far, f.name))

    @property
    def first_divergence(self) -> tuple[str, Location] | None:
        """``(field, location)`` of the :attr:`cause`'s first differing position."""
        cause = self.cause
        return (cause.name, cause.first) if cause is not None and cause.first is not None else None

    @property
    def update_cause(self) -> UpdateCause | None:
        """The update between inner steps ``i`` and ``i + 1`` of one step, when it explains the first
        divergence: every field recorded at inner ``i`` (every micro-batch and rank) is equal, or only
        its loss differs, and at inner ``i + 1`` the first field that differs, in data-flow order, is a
        policy field (``policy_logprobs``...: what the updated weights score). The inputs of inner
        ``i + 1`` (ids, masks, rewards, advantages, old/ref logprobs: the same rollout) are equal too,
        so nothing recorded explains the new policy but the update: its loss, gradients or optimizer
        state. None otherwise, and whenever "every recorded input" cannot be claimed: only some fields
        compared, a step pair unreadable, a field recorded on one side only by then, or the pass
        before not compared."""
        cause = self.cause
        if cause is None or cause.first is None or self.fields_selected or self.unreadable:
            return None
        stage = flow_rank(cause.name)[0]
        at = cause.first.step[:2]
        if stage == POLICY_STAGE:
            before, after = (at[0], at[1] - 1), at
        elif stage >= LOSS_STAGE:
            before, after = at, (at[0], at[1] + 1)
        else:
            return None
        groups = {s[:2] for s in self.compared_steps}
        if before[1] < 0 or before not in groups or after not in groups:
            return None
        if any(m["first_step"][:2] <= after for m in self.missing_fields.values()):
            return None
        at_before, at_after = self._group_differences(before), self._group_differences(after)
        if any(flow_rank(n)[0] < LOSS_STAGE for n in at_before) or not at_after:
            return None
        effect = min(at_after, key=lambda n: (flow_rank(n), n))
        if flow_rank(effect)[0] != POLICY_STAGE:
            return None
        last = max(s for s in self.compared_steps if s[:2] == before)
        metadata = {k: (m["a"], m["b"]) for k, m in self.metadata_conflicts.items() if m["first_step"] <= last}
        loss_fields = [n for n in self.fields if flow_rank(n)[0] in (LOSS_STAGE, LOSS_STAGE + 1) or n == SCALAR_LOSS]
        return UpdateCause(before, after, self.fields[effect], at_after[effect].first,
                           {n: d for n, d in at_before.items() if n in loss_fields}, loss_fields, metadata,
                           {n: d for n, d in at_before.items() if n.startswith(SCALAR_PREFIX) and n not in loss_fields})

    def _group_differences(self, group: tuple[int, int]) -> dict[str, StepDifference]:
        """``{field: StepDifference}`` over the step pairs of ``(step, inner_step)`` (the first pair
        where each field differs; ``differing`` summed, ``max_abs_diff`` the max)."""
        out: dict[str, StepDifference] = {}
        for step in sorted(s for s in self.step_differences if s[:2] == group):
            for name, d in self.step_differences[step].items():
                seen = out.get(name)
                out[name] = d if seen is None else StepDifference(seen.differing + d.differing,
                                                                  max(seen.max_abs_diff, d.max_abs_diff), seen.first)
        return out

    def findings(self) -> list[str]:
        """One line per finding; empty when ``equal``."""
        out = [f"unreadable at {label}: {reason}" for label, reason in self.unreadable.items()]
        for side, steps in (("a", self.only_in_a), ("b", self.only_in_b)):
            if steps:
                other = "b" if side == "a" else "a"
                every = (self.sampling.get(other) or {}).get("every_n_steps")
                why = (f" ({other} was recorded with every_n_steps={every}: only steps divisible by {every} are "
                       "written)" if isinstance(every, int) and every > 1 else "")
                out.append(f"steps only in {side} {step_list(steps)}{why}")
        for name, m in self.missing_fields.items():
            out.append(f"{name}: only in {m['only_in']} ({m['step_pairs']} step pairs, first at "
                       f"{step_label(m['first_step'])})")
        for key, m in self.metadata_conflicts.items():
            out.append(f"metadata {key}: a={m['a']!r}, b={m['b']!r} ({m['step_pairs']} step pairs, "
                       f"first at {step_label(m['first_step'])})")
        out.extend(f.summary() for f in self.differing_fields)
        return out

    @property
    def producer_differences(self) -> dict[str, tuple[str, str]]:
        """``{key: (a, b)}`` for manifest ``producers`` entries both traces record with different
        values (``torch``, ``transformers``, ``cpu_kernels``...): what may explain float differences.
        ``mkl_cbwr`` recorded on one side only counts as ``"unset"`` on the other when both record
        their ``cpu_kernels``."""
        a, b = self.producers.get("a") or {}, self.producers.get("b") or {}
        if self.kernels("a") is not None and self.kernels("b") is not None:
            a, b = ({**side, "mkl_cbwr": side.get("mkl_cbwr", "unset")} for side in (a, b))
        return {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]}

    def kernels(self, side: str) -> str | None:
        """The CPU kernels trace ``side`` (``"a"`` or ``"b"``) was computed with, as its manifest's
        ``producers`` records them (``"AVX2, MKL_CBWR=AVX2"``, ``"AVX512"``); None when it does not."""
        produced = self.producers.get(side) or {}
        if "cpu_kernels" not in produced:
            return None
        cbwr = produced.get("mkl_cbwr")
        return produced["cpu_kernels"] + (f", MKL_CBWR={cbwr}" if cbwr else "")

    @property
    def kernels_differ(self) -> bool:
        """Both traces record their CPU kernels (:meth:`kernels`) and they differ."""
        a, b = self.kernels("a"), self.kernels("b")
        return a is not None and b is not None and a != b

    def notes(self) -> list[str]:
        """What is not a difference but worth saying: producers (package versions, CPU kernels) that
        differ, metadata keys and scalars one side records and the other does not, the scalars not
        compared (machine measurements), and fields recorded on one side and derived on the other that agree."""
        out = []
        produced = self.producer_differences
        if produced:
            out.append("produced with different software or CPU kernels (not compared): "
                       + ", ".join(f"{k} a={va!r} b={vb!r}" for k, (va, vb) in produced.items()))
        for side in ("a", "b"):
            keys = {k: m[side] for k, m in self.metadata.items() if m.get("only_in") == side}
            if keys:
                other = "b" if side == "a" else "a"
                out.append(f"metadata only in {side} (not recorded in {other}, so not compared): "
                           + ", ".join(f"{k}={v!r}" for k, v in keys.items()))
        for side in ("a", "b"):
            only = {k: m for k, m in self.scalars_only_in.items() if m["only_in"] == side}
            if only:
                other = "b" if side == "a" else "a"
                out.append(f"scalars only in {side} ({other} neither records nor logs them, so not compared): "
                           + ", ".join(f"{k} ({m['step_pairs']} step pairs, first at {step_label(m['first_step'])})"
                                       for k, m in only.items()))
        if self.scalars_not_compared:
            out.append("scalars not compared (they measure the machine, not the run: times, throughput, memory): "
                       + ", ".join(self.scalars_not_compared))
        for f in self.fields.values():
            if f.derived_in and f.passed:
                out.append(f"{f.name}: recorded in {'b' if f.derived_in == 'a' else 'a'}, derived in {f.derived_in} "
                           f"from its recorded inputs (as the reader does); equal within tolerance at {f.compared} "
                           "positions")
        return out

    def verdict(self) -> str:
        """``EQUAL within tolerance``, ``DIFFERENT (metadata only: …)`` or ``DIFFERENT (n findings)``."""
        findings = self.findings()
        if not findings:
            return "EQUAL within tolerance"
        if self.metadata_only:
            keys = ", ".join(self.metadata_conflicts)
            return f"DIFFERENT (metadata only: the tensors are equal within tolerance; step metadata {keys} differs)"
        return f"DIFFERENT ({len(findings)} finding{'s' * (len(findings) > 1)})"
