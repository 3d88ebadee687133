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

from typing import TYPE_CHECKING

from tracer.record.lazy_exports import lazy_exports
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


# the lazy names; importing the submodule tracer.views.conversation binds the function conversation there
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
