"""Step numbers of zero-edit tracing: the ``(step, inner_step, micro_batch)`` key of each traced backward,
from the indices found in its frame and its callers (:func:`tracer.zero_edit.frame_lookup.read_indices`)."""

from __future__ import annotations

from typing import Mapping


class StepClock:
    """Turns the indices found in the frame into ``(step, inner_step, micro_batch)`` keys, in the order of
    the backwards: step numbers never decrease and no key is given twice, however backwards numbered by
    the frame's ``step`` and by the clock's own count mix (a ``step`` variable that appears after some
    backwards, two call sites of which one sees a ``step``).

    * ``step``, found: the frame's plus ``offset``. A step below the last one given (a counter that
      restarts each data epoch), or equal to a step the clock numbered itself, raises ``offset`` so the
      step is the last one + 1 (the watcher keeps the frame's value in metadata ``source_step``); a
      negative first step is raised to 0.
    * ``step``, not found: the last step given, when the frame's inner step (and micro-batch, when
      found) comes after the last key's in that step; otherwise the last step + 1 (the first: 0), a
      step numbered by the clock. Neither found: every such backward is a new step.
    * ``inner_step``: the frame's, else 0. ``micro_batch``: the frame's, else the last key's + 1 when
      the step and inner step are the last key's, else 0; a key already given moves to the next free
      micro-batch of its ``(step, inner_step)``.

    Only the keys of the current step are remembered (earlier steps cannot come back).
    """

    def __init__(self) -> None:
        self.offset = 0
        self._last: tuple[int, int, int] | None = None
        self._counted = False  # the last key's step was numbered by the clock (no `step` found)
        self._seen: set[tuple[int, int, int]] = set()  # keys given in the last key's step

    def key(self, indices: Mapping[str, int]) -> tuple[int, int, int]:
        step, inner, mb = indices.get("step"), indices.get("inner_step"), indices.get("micro_batch")
        last, found_inner = self._last, inner is not None
        inner = 0 if inner is None else inner
        if step is None:
            if last is None:
                step, self._counted = 0, True
            elif (found_inner or mb is not None) and (
                    (inner, mb) > last[1:] if mb is not None else inner > last[1]):
                step = last[0]  # the next inner step / micro-batch of the last step
            else:
                step, self._counted = last[0] + 1, True
        else:
            step += self.offset
            low = 0 if last is None else last[0] + (1 if self._counted or step < last[0] else 0)
            if step < low:
                self.offset += low - step
                step = low
            self._counted = False
        if last is not None and step != last[0]:
            self._seen.clear()
        if mb is None:
            mb = last[2] + 1 if last is not None and last[:2] == (step, inner) else 0
        while (step, inner, mb) in self._seen:
            mb += 1
        self._last = (step, inner, mb)
        self._seen.add(self._last)
        return self._last
