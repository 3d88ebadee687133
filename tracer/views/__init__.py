"""Per-algorithm views of a trace: small pandas tables that the app's PPO, group and DPO pages show.

Pure reading and pandas over :class:`tracer.read.reader.Trace`; every reduction that is RL maths
(masked means, logprob sums, DPO terms) comes from :mod:`tracer.formulas`. Each function reads only
what it needs: headers for the early-stop overview, ``[B]`` fields for the group shares, one row
(``get_slice``) for a DPO pair.

- PPO: :func:`rollout_rows` (where each rollout row lies among the minibatch files of an epoch),
  :func:`ppo_minibatch_table` (epochs x minibatches of one step: which ran, which stopped early,
  mean ``approx_kl_k2`` against ``target_kl``), :func:`ppo_early_stops` (one row per step).
- GRPO / CISPO / RLOO: :func:`group_frame` (one row per group of a step file),
  :func:`group_completions` (the G completions of one group), :func:`zero_variance_shares`
  (share of zero-variance groups per step).
- Multi-turn and agentic rows: :func:`conversation` (one sequence as an episode: its spans, one row
  per turn with the means over the turn's trained tokens).
- DPO: :func:`dpo_pair_tokens` and :func:`dpo_pair_terms` (one pair, token by token and summed),
  :func:`dpo_step_summary` (margin and preference accuracy per step).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from tracer.views.common import GROUPED_ALGORITHMS

if TYPE_CHECKING:  # the lazily imported names, for type checkers and IDEs
    from tracer.views.conversation import (
        Conversation,
        ConversationSpan,
        conversation,
        conversation_from_table,
    )
    from tracer.views.dpo import dpo_pair_terms, dpo_pair_tokens, dpo_step_summary
    from tracer.views.groups import (
        group_completions,
        group_frame,
        group_ids_of,
        group_prompt_text,
        group_std_estimator,
        zero_variance_shares,
    )
    from tracer.views.ppo import (
        EARLY_STOP,
        NO_FILE,
        NOT_RUN,
        RAN,
        RolloutRow,
        ppo_early_stops,
        ppo_minibatch_table,
        rollout_rows,
    )

__all__ = [
    "EARLY_STOP",
    "GROUPED_ALGORITHMS",
    "NOT_RUN",
    "NO_FILE",
    "RAN",
    "Conversation",
    "ConversationSpan",
    "RolloutRow",
    "conversation",
    "conversation_from_table",
    "dpo_pair_terms",
    "dpo_pair_tokens",
    "dpo_step_summary",
    "group_completions",
    "group_frame",
    "group_ids_of",
    "group_prompt_text",
    "group_std_estimator",
    "ppo_early_stops",
    "ppo_minibatch_table",
    "rollout_rows",
    "zero_variance_shares",
]

# public name -> the module that defines it, imported when the name is first looked up
_LAZY = {
    **dict.fromkeys(("Conversation", "ConversationSpan", "conversation", "conversation_from_table"),
                    "tracer.views.conversation"),
    **dict.fromkeys(("dpo_pair_terms", "dpo_pair_tokens", "dpo_step_summary"), "tracer.views.dpo"),
    **dict.fromkeys(("group_completions", "group_frame", "group_ids_of", "group_prompt_text", "group_std_estimator",
                     "zero_variance_shares"), "tracer.views.groups"),
    **dict.fromkeys(("EARLY_STOP", "NO_FILE", "NOT_RUN", "RAN", "RolloutRow", "ppo_early_stops", "ppo_minibatch_table",
                     "rollout_rows"), "tracer.views.ppo"),
}


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first use and kept (PEP 562)."""
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The ``tracer.views`` module's type: importing the submodule :mod:`tracer.views.conversation`
    makes Python set the attribute ``tracer.views.conversation`` to that module, which would hide the
    public function of the same name; this binds the function there instead (as the eager
    ``from tracer.views.conversation import conversation`` in this file once did)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
