"""Print docs/checks.md's "Check reference": for every registered check, what it needs, what it assumes,
and an example message produced by running the check on a small real trace.

    python docs/check_reference.py              # Markdown on stdout
    python docs/check_reference.py --write      # replace the section at the end of docs/checks.md with it

The needs / assumes texts (:data:`REFERENCE`) are written from each check's code (``tracer/checks/*.py``).
Each example is real: :data:`TRACES` builds, per check, step files with ``TraceWriter`` (the toy tokenizer of
``tests/fixtures/check_traces.py``: ids 0..63, EOS 2, pad 0) that hold the bug the check looks for, runs
``tracer.checks.run_checks(trace, select=[id])`` and prints the check's worst finding, trimmed to about
:data:`EXAMPLE_CHARS` characters. A check that gives no finding on its trace makes the script fail: the
reference never shows an invented message. ``tests/docs/test_check_reference.py`` checks that every
registered check has an entry and that docs/checks.md holds this script's current output.
"""

from __future__ import annotations

import math
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python docs/check_reference.py`: the test fixtures live in the repo
    sys.path.insert(0, str(REPO))

from tracer import formulas  # noqa: E402
from tracer.checks import CHECKS, SKIPPED, CheckOptions, run_checks  # noqa: E402
from tracer.format.turns import MASK_REASON_NAMES  # noqa: E402
from tracer.record.writer import TraceWriter  # noqa: E402

from tests.fixtures.check_traces import EOS, PAD, case1_tensors, case9_tensors, write_trace  # noqa: E402

EXAMPLE_CHARS = 300  # an example shows the message's first sentences up to about this many characters
WRAP = 110  # columns of the example's text block


# -- what each check needs and assumes, from its code ------------------------------------------------------

REFERENCE: dict[str, dict[str, str]] = {
    "fields.required": {
        "needs": "metadata `algorithm` (manifest or step); skipped without it.",
        "assumes": "the required fields of `tracer.format.schema.required_fields(algorithm)`; a DPO reference "
                   "recorded only as per-pair sums with `ref_logprobs_source = \"trl_precomputed_sums\"`, and "
                   "per-token `token_advantages` that vary along a row in place of `advantages`, are infos, "
                   "not missing fields.",
    },
    "identity.first_step": {
        "needs": "`policy_logprobs`, `old_logprobs` (or `old_logprobs_source = \"policy_detached\"`), "
                 "`completion_mask`; `clip_epsilon_low` / `clip_epsilon_high` for the clip fraction; "
                 "`ref_logprobs` to find a reference read one position off. Runs only on fresh rollouts.",
        "assumes": "fresh rollouts as `tracer.checks.identity.is_fresh` decides: metadata `fresh_rollouts`, "
                   "else inner step 0 (PPO: the first `gradient_accumulation_steps` minibatches; TRL: a "
                   "`generation_slice` before the first optimizer step); per-token tolerance and mean-ratio "
                   "tolerance of the loosest dtype (`source_dtype`, `model_dtype`, stored dtypes; float32: 1e-3 "
                   "nats and 1e-3); tokens the turns checks explain (tool output, placeholders, shifted turns) "
                   "are left out.",
    },
    "identity.old_aliases_policy": {
        "needs": "`policy_logprobs`, `old_logprobs`, `completion_mask` on a step file that is not fresh; "
                 "`learning_rate` of the step file before and `advantages` to tell a frozen update apart.",
        "assumes": "an optimizer step came between rollout and this file (not `is_fresh`); float noise of "
                   "scoring with the same weights: 1e-5 nats in float32, 1e-9 in float64, exact in half "
                   "precision. Learning rate 0 before it, or every advantage 0, is an info.",
    },
    "logprobs.positive": {
        "needs": "any per-token logprob field (policy, old, ref, sampler, DPO sides) with its mask.",
        "assumes": "natural-log probabilities; tolerance the dtype's recompute atol (1e-5 in float32); masked "
                   "positions (TRL writes 0 there) are not judged.",
    },
    "identity.micro_batch_position": {
        "needs": "trace check: `policy_logprobs`, `old_logprobs`, `completion_mask` of fresh step files; the "
                 "position from metadata `micro_batch_in_mini_batch`, else the `micro_batch` coordinate.",
        "assumes": "on fresh rollouts the ratio is 1 in every micro-batch; silent when all positions are exact "
                   "or all deviate (then `identity.first_step` reports each file); identity tolerance of the "
                   "dtype.",
    },
    "alignment.logprob_shift": {
        "needs": "`sampler_logprobs` and `old_logprobs` (else `policy_logprobs`), `completion_mask`.",
        "assumes": "the sampler scored the same tokens at the same positions; a shift wins only when the "
                   "unshifted mean |Δ| exceeds 0.1 nats and the shifted one is below half of it; otherwise "
                   "at least 3 repeated-token positions that fit the neighbour's logprob within a tenth of the "
                   "unshifted gap.",
    },
    "alignment.completion_start": {
        "needs": "`prompt_ids`, `prompt_mask`, `completion_ids`.",
        "assumes": "left-padded prompts (padding read from `prompt_mask`); fires only when every left-padded "
                   "row begins with as many prompt tokens as it has padding, and at least 2 such tokens in all.",
    },
    "masks.after_eos": {
        "needs": "`completion_ids` + `completion_mask` (or the DPO sides' ids and masks); the EOS id from the "
                 "manifest's tokenizer or metadata `eos_token_id` (skipped without it). Uses `turn_ids`, "
                 "`token_roles`, `mask_reasons` and the manifest's `tokenizer.template_end_of_turn_tail` when "
                 "recorded.",
        "assumes": "the answer starts at 0 for `completion_ids`, at the first kept position for a DPO side or a "
                   "packed row; each turn has its own first EOS; the chat template's recorded end-of-turn tail "
                   "(else up to 2 newline-only tokens, when token strings are stored) belongs to the answer.",
    },
    "masks.padding": {
        "needs": "ids and mask of each side; the pad id from the manifest's tokenizer or metadata "
                 "`pad_token_id` (skipped without it). With `turn_ids` / `token_roles` / `mask_reasons`, "
                 "padding is what they mark.",
        "assumes": "padding is the trailing run of pad ids; pad == EOS is left to `masks.after_eos`; a single "
                   "pad id ending a sampled completion without EOS is most likely a sampled token (info).",
    },
    "masks.empty_row": {
        "needs": "a mask (`completion_mask` or a DPO side's) with its ids.",
        "assumes": "every row should train on at least one token, unless `mask_truncated_completions` or "
                   "verl's `rollout_rs` empties rows on purpose (then an info).",
    },
    "masks.dpo_rule": {
        "needs": "DPO: `chosen_ids`, `rejected_ids`, `chosen_mask`, `rejected_mask`; the four DPO logprob "
                 "fields and `beta` to give both losses; `truncation_mode`, `max_length` for TRL's keep_end.",
        "assumes": "both sides share the prompt, so the same rule starts both masks at the same position; a "
                   "prompt at different offsets (each side cut from the left) or cut away under "
                   "`truncation_mode = \"keep_end\"` is an info.",
    },
    "turns.tool_output_trained": {
        "needs": "`completion_mask` and `token_roles` or `mask_reasons` on a multi-turn step (not applicable to "
                 "single-turn rows without `mask_reasons`); `completion_ids` for the span's text.",
        "assumes": "the recorded roles / reasons are the truth: a token of role tool, user, system or "
                   "environment after the prompt (or reason tool_output / environment) was not written by the "
                   "model.",
    },
    "turns.placeholder_logprobs": {
        "needs": "`policy_logprobs`, `completion_mask`, and a recorded (not derived) `old_logprobs` and/or "
                 "`sampler_logprobs`; not applicable without them.",
        "assumes": "the policy's logprob is the reference for a real value: a recorded 0.0, or one constant "
                   "over ≥ 4 consecutive trained tokens where the policy spreads > 0.1 nats, counts only where "
                   "the policy gives the token < −0.5 nats.",
    },
    "turns.turn_shift": {
        "needs": "multi-turn rows (`turn_ids`, or turns read from the mask; not applicable to single-turn rows), "
                 "`old_logprobs` with `sampler_logprobs`, or old and `policy_logprobs` at inner step 0 (skipped "
                 "without either pair).",
        "assumes": "a turn needs ≥ 3 kept tokens; a shift wins when the unshifted mean |Δ| exceeds 0.1 nats and "
                   "the shifted one is below half of it (the thresholds of `alignment.logprob_shift`).",
    },
    "turns.untrained_turn": {
        "needs": "`token_roles` (recorded, or read from a packed row's ChatML markers), `completion_ids`, "
                 "`completion_mask`; `mask_reasons` to accept a recorded reason. Not applicable to single-turn "
                 "rows; skipped on multi-turn rows without roles.",
        "assumes": "every assistant turn is trained up to its EOS or `<|im_end|>`; a role header of up to 3 "
                   "tokens and a short untrained tail (a stop string the loop re-appended) are not the bug; not "
                   "run under verl's `rollout_rs`.",
    },
    "turns.advantage_assignment": {
        "needs": "metadata `advantage_assignment` (`episode` or `turn`; not applicable without it, skipped for "
                 "another value), per-token advantages (`token_advantages`, or [B, T] `advantages` outside PPO), "
                 "`completion_mask`; `turn_ids` for `turn`.",
        "assumes": "[B] advantages are broadcast (one per episode by construction); values compared with the "
                   "dtype's tolerance.",
    },
    "kl.k3_sign": {
        "needs": "a recorded `ref_kl_k3` (a derived one is skipped, saying so) and `completion_mask`.",
        "assumes": "the recorded tensor is k3 = exp(d) − d − 1 ≥ 0 with d = ref − policy; tolerance the dtype's "
                   "atol.",
    },
    "kl.ref_gap": {
        "needs": "`policy_logprobs`, `ref_logprobs`, `completion_mask`.",
        "assumes": "fixed bounds on ref − policy at one kept token: warning from 10 nats, error from 20 nats "
                   "(k3 ≈ 4.85e8); past 88.72 float32's exp overflows.",
    },
    "kl.k1_negative": {
        "needs": "trace check: `policy_logprobs`, `ref_logprobs`, `completion_mask` in at least 3 step files "
                 "that moved.",
        "assumes": "tokens of fresh rollouts were sampled from the policy, so mean k1 ≥ 0; untruncated sampling "
                   "(steps with `top_p` < 1, `top_k` > 0, `min_p` > 0 or `repetition_penalty` ≠ 1 are left "
                   "out); significant = below −3 standard errors in every such file; when none of the files is of fresh "
                   "rollouts, an info (a swap and a healthy run look alike there).",
    },
    "kl.ref_tracks_policy": {
        "needs": "trace check: `old_logprobs`, `ref_logprobs`, `completion_mask` and a KL coefficient "
                 "(`kl_coef` / `beta`) in the fresh inner-step-0 files of at least 2 rollouts after the "
                 "first; `sync_ref_model` to recognise TRL's intended sync.",
        "assumes": "the reference is frozen at the initial weights, so after the first rollout it cannot score "
                   "like the policy that sampled; equal means within `identity.old_aliases_policy`'s float "
                   "noise.",
    },
    "kl.k1_negative_step": {
        "needs": "`policy_logprobs`, `ref_logprobs`, `completion_mask` on a fresh step file with ≥ 256 kept "
                 "tokens; skipped when `top_p` < 1, `top_k` > 0, `min_p` > 0 or `repetition_penalty` ≠ 1.",
        "assumes": "fresh rollouts were sampled from this policy with an untruncated sampler, so mean k1 "
                   "estimates KL(policy ‖ ref) ≥ 0; alarm below −10 standard errors.",
    },
    "nonfinite.values": {
        "needs": "any recorded float tensor (derived ones are not judged); masks to tell kept from masked.",
        "assumes": "the dependency order logprobs → rewards/advantages → ratio → KL → loss names the first "
                   "tensor; a NaN reward on a row whose advantages are finite is a reward the trainer left out "
                   "(TRL's None, summed with nansum).",
    },
    "advantages.group_size": {
        "needs": "`group_ids` and `num_generations` (skipped without either).",
        "assumes": "`group_ids` are the truth; groups all smaller than G are a micro-batch's share of each "
                   "group (info).",
    },
    "advantages.group_sum": {
        "needs": "[B] `advantages`; groups from `group_ids`, else `num_generations` consecutive rows.",
        "assumes": "a group-centred rule (skipped for `gae`, `gae_whitened`, `verl_<estimator>` other than "
                   "`verl_grpo`); only complete groups of G ≥ 2 rows; a masked row with advantage exactly 0 "
                   "(dropped by rejection sampling) is left out.",
    },
    "advantages.zero_variance": {
        "needs": "`rewards` and groups (`group_ids` or `num_generations`); `advantages` to see whether another "
                 "term gives a signal.",
        "assumes": "equal rewards give advantage 0 unless the rule has another term (RLOO's KL-penalised "
                   "rewards, verl's other estimators); the step's other micro-batches (same step, inner step, "
                   "rank) count for the share.",
    },
    "advantages.z_bound": {
        "needs": "[B] `advantages`, groups or `num_generations` (row by row when micro-batches split groups).",
        "assumes": "advantages are a group z-score (`scale_rewards = \"group\"`, a z-score `advantage_rule`); "
                   "skipped for another declared rule, or when `recompute.advantages` names another rule the "
                   "values follow.",
    },
    "advantages.masked_positions": {
        "needs": "PPO: [B, T] `advantages` and `completion_mask`; `token_rewards`, `values`, `gamma`, `lam` to "
                 "recognise whitening.",
        "assumes": "GAE is 0 on masked positions; one constant on every masked slot is a whitening that was "
                   "not re-masked (verl's `masked_whiten`), an info.",
    },
    "advantages.reward_placement": {
        "needs": "PPO: `token_rewards`, `completion_mask`; `rewards` to name the sequence reward.",
        "assumes": "the seed's rule: the sequence reward sits on the last kept token and nothing on masked "
                   "positions.",
    },
    "sampler.mismatch": {
        "needs": "`sampler_logprobs` and `old_logprobs` (else a fresh `policy_logprobs`), `completion_mask`; "
                 "reported at inner step 0. Reads the sampler settings `sampler_temperature`, `sampler_top_p`, "
                 "`sampler_top_k`, `sampler_min_p`, the `sampler_*_penalty` keys (else `temperature`, `top_p`, "
                 "`top_k`), `sampler_dtype`, and TRL's importance-sampling fields when recorded.",
        "assumes": "C = 2 (`--sampler-ratio-bound`); a cause counts only when the settings in effect allow it "
                   "and it is beyond the noise floor of the engine's dtype (4 × the 0.0056 nats measured for a bf16 or "
                   "fp16 engine, 0.01 nats for fp32 or an unrecorded `sampler_dtype`); bounds |mean| 0.05 / 0.5 nats, 1 % / 10 % of tokens outside.",
    },
    "sampler.probs_diff": {
        "needs": "`sampler_logprobs` and `old_logprobs` (else a fresh `policy_logprobs`), `completion_mask`; "
                 "inner step 0 only.",
        "assumes": "verl's probability-space convention; warning at mean |Δp| > 0.05 or a Pearson correlation "
                   "< 0.9 over ≥ 100 tokens; never an error (the cause is `sampler.mismatch`'s).",
    },
    "integrity.checksum": {
        "needs": "the header's `content_sha256` (written by `TraceWriter`); skipped on files without it.",
        "assumes": "the hash over every tensor's name, dtype, shape and bytes "
                   "(`tracer.format.hashing.content_sha256`) is what the writer recorded.",
    },
    "recompute.ratio": {
        "needs": "a recorded `ratio`, `policy_logprobs`, `old_logprobs` (or `old_logprobs_source = "
                 "\"policy_detached\"`); skipped when `importance_sampling_level` is not `token`.",
        "assumes": "ratio = exp(policy − old) per token; |Δ| ≤ atol + rtol·|recomputed| of the dtype (float32: "
                   "1e-5 + 1e-4), kept finite positions only.",
    },
    "recompute.ref_kl_k3": {
        "needs": "a recorded `ref_kl_k3`, `policy_logprobs`, `ref_logprobs`.",
        "assumes": "k3 = exp(ref − policy) − (ref − policy) − 1; the dtype's recompute tolerance.",
    },
    "recompute.approx_kl_k2": {
        "needs": "a recorded `approx_kl_k2`, `policy_logprobs`, `old_logprobs`.",
        "assumes": "k2 = 0.5 (policy − old)²; the dtype's recompute tolerance.",
    },
    "recompute.advantages": {
        "needs": "`advantages` and `rewards` with groups (GRPO / RLOO / CISPO), or PPO's `advantages`, "
                 "`token_rewards`, `values`, `gamma`, `lam`; `advantage_rule`, `advantage_std`, "
                 "`scale_rewards`, `beta` (RLOO) declare the rule.",
        "assumes": "the declared rule, else the one `advantage_std` / `scale_rewards` imply, else the default "
                   "(`group_zscore`; PPO `gae`); tolerance 10 × the dtype's; skipped when advantages are "
                   "re-normalised over the batch or rewards hold NaN.",
    },
    "recompute.token_rewards": {
        "needs": "PPO: `kl_in_reward` (or token rewards that show the penalty), `token_rewards`, `rewards`, "
                 "`ref_logprobs`, `old_logprobs`, `kl_coef` (or `beta`).",
        "assumes": "token_rewards = −kl_coef · KL(old ‖ ref) on each kept token plus the sequence reward on the "
                   "last (estimator `kl_estimator`, default k1); no other shaping terms.",
    },
    "recompute.clip_fractions": {
        "needs": "`policy_logprobs`, `old_logprobs`, `advantages`, `clip_epsilon_high` (`clip_epsilon_low` "
                 "defaults to it); metadata `clip_fraction_low` / `_high` / `_region` to compare with.",
        "assumes": "token-level ratios (skipped for a sequence-level `importance_sampling_level`); TRL's "
                   "sign-aware definitions (`tracer.formulas.clip_fractions`); recorded vs recomputed within "
                   "1e-3; with none recorded, an info giving the recomputed ones when a ratio leaves the region.",
    },
    "recompute.dpo": {
        "needs": "the four DPO per-token logprob fields, both masks, `beta`, and at least one of `dpo_logits`, "
                 "`dpo_loss`, `chosen_rewards`, `rejected_rewards`, `loss`.",
        "assumes": "the sigmoid DPO loss of Rafailov et al. (unless `dpo_loss_is_sigmoid` is false), sequence "
                   "logprobs as masked sums, the step's `loss` the mean over pairs.",
    },
    "recompute.per_token_loss": {
        "needs": "a recorded `per_token_loss`, `policy_logprobs`, `old_logprobs`, `advantages` (PPO: per "
                 "token), the clip epsilons, `ref_logprobs` when `beta` / `kl_coef` > 0; skipped for a "
                 "sequence-level ratio, `off_policy_mask_threshold`, `top_entropy_quantile` < 1.",
        "assumes": "GRPO's clipped surrogate (TRL's grpo, bnpo, dr_grpo, dapo; `delta` applied), CISPO's or "
                   "PPO's rule plus coef × KL (`kl_estimator`, default k3; none when `kl_in_reward`); kept "
                   "tokens only, the dtype's recompute tolerance.",
    },
    "recompute.loss": {
        "needs": "the scalar `loss` (tensor [] / [1], or metadata `loss`), `completion_mask`, and "
                 "`per_token_loss` or its inputs; `loss_reduction` (else implied by TRL's `loss_type`), "
                 "`loss_divisor`, `max_completion_length`, `loss_scale`, `num_items_in_batch`.",
        "assumes": "the declared reduction reproduces the loss to float noise (32 ulps × mean |per-token "
                   "loss|); other explanations (another reduction, the unmasked mean over padding, the KL sign, "
                   "the KL term missing, another clip range) are ranked by residual; within `loss_rtol` of the "
                   "declared one and nothing clearly better: no finding.",
    },
    "recompute.loss_agg_mode": {
        "needs": "verl worker files: `verl_pg_loss`, `completion_mask`, `verl_pg_losses` (or, for the "
                 "`vanilla` loss, its inputs), `declared_loss_agg_mode` / `loss_agg_mode`; not applicable to "
                 "other traces.",
        "assumes": "verl's `agg_loss` with the recorded `dp_size`, `batch_num_tokens`, `global_batch_size`, "
                   "`loss_scale_factor`; `sapo` aggregates `seq-mean-token-mean` by design (info).",
    },
    "recompute.advantage_std": {
        "needs": "verl GRPO rollout files: `adv_estimator` `grpo` / `grpo_vectorized`, [B] `advantages`, finite "
                 "`rewards`, `group_ids`, the declared `norm_adv_by_std_in_grpo`; not applicable otherwise.",
        "assumes": "verl's rule `(r − mean_g) / (std_g + 1e-6)` with Bessel's std per uid, or `r − mean_g` "
                   "without std; the value at the call (`norm_adv_by_std_in_grpo`) tells where the config "
                   "was lost.",
    },
    "recompute.declared_settings": {
        "needs": "pairs of metadata `<setting>` (at the call) and `declared_<setting>` (the config), as the "
                 "verl and TRL integrations record them; not applicable without them.",
        "assumes": "the config the run was started with is what the trainer should use; numbers equal within "
                   "1e-6 relative.",
    },
    "dpo.reference_aliasing": {
        "needs": "trace check, DPO: `chosen_/rejected_policy_logprobs`, masks, and `chosen_/rejected_ref_logprobs` "
                 "(or TRL's per-pair sums) in step files after the first step; `learning_rate`, `loss`, "
                 "`sync_ref_model` when recorded.",
        "assumes": "the first step's reference is a fresh copy (not judged); a step after an update with "
                   "learning rate 0 is not judged; equal within `identity.old_aliases_policy`'s float noise.",
    },
    "health.ref_kl": {
        "needs": "trace check: `ref_kl_k3` (recorded or derived from `policy_logprobs`, `ref_logprobs`) and "
                 "`completion_mask`; not judged when absent (no skipped line).",
        "assumes": "threshold 2 nats per kept token (`--threshold ref_kl`), per update (token-weighted over its "
                   "micro-batches and ranks), past it at ≥ 2 steps or at the last step.",
    },
    "health.clip_fraction": {
        "needs": "trace check: `policy_logprobs`, `old_logprobs`, [B] or [B, T] `advantages`, "
                 "`completion_mask`, the clip epsilons; step files after the first update on a rollout.",
        "assumes": "threshold 0.5 (`--threshold clip_fraction`), at any update; not judged under a clip "
                   "epsilon below 0.1; counts only tokens whose gradient the clip removes.",
    },
    "health.sampler_gap": {
        "needs": "trace check: `old_logprobs`, `sampler_logprobs`, `completion_mask`.",
        "assumes": "threshold 0.1 nats mean |old − sampler| (`--threshold sampler_gap`), past it at ≥ 2 steps "
                   "or at the last; left out of a run where a `sampler.*` check already warns or errs at every "
                   "step it names.",
    },
    "health.entropy_collapse": {
        "needs": "trace check: `entropy` and `completion_mask`.",
        "assumes": "the first step file's mean entropy is the baseline; collapse below the larger of 0.05 nats "
                   "and (1 − 0.9) × the first value (`--threshold entropy_floor`, `entropy_drop`).",
    },
    "health.reward_flat": {
        "needs": "trace check, GRPO / RLOO / CISPO: `rewards`, groups, `advantages`.",
        "assumes": "a flat group (equal rewards and advantages 0) gives no signal; threshold share 1.0 "
                   "(`--threshold reward_flat`); left out of a run where `advantages.zero_variance` already warns "
                   "at every step it names.",
    },
}


# -- small real traces, one per check, each holding the bug the check looks for ---------------------------

def _mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def _grpo(policy: torch.Tensor, old: torch.Tensor, **extra) -> dict:
    B, T = policy.shape
    return {"completion_ids": torch.full((B, T), 5), "completion_mask": torch.ones(B, T, dtype=torch.bool),
            "policy_logprobs": policy, "old_logprobs": old, **extra}


def _fields_required(root):
    # a GRPO step with ids, mask and policy logprobs only: old logprobs, rewards, advantages... are missing
    return write_trace(root, "grpo", [(0, 0, {"completion_ids": torch.tensor([[5, 6, EOS]]),
                                               "completion_mask": torch.ones(1, 3, dtype=torch.bool),
                                               "policy_logprobs": torch.tensor([[-0.5, -1.0, -0.2]])})])


def _first_step(root):
    # policy != old at inner step 0 on 2 of 7 kept tokens (tests/checks/test_ten_cases.py, case 1)
    return write_trace(root, "grpo", [(0, 0, case1_tensors())], {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2})


def _old_aliases_policy(root):
    # inner step 1 after an update with learning rate 1e-3, yet policy == old on every kept token
    policy = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -0.7, -0.9]])
    step = _grpo(policy, policy.clone(), advantages=torch.tensor([1.0, -1.0]))
    return write_trace(root, "grpo", [(0, 0, step, {"learning_rate": 1e-3}), (0, 1, step, {"learning_rate": 1e-3})],
                       {"num_generations": 2})


def _logprobs_positive(root):
    policy = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -0.7, 0.3]])  # +0.3 nats at seq 1, token 2
    return write_trace(root, "grpo", [(0, 0, _grpo(policy, policy.clone()))], {"num_generations": 2})


def _micro_batch_position(root):
    # three fresh micro-batches: positions 0 exact, position 1 off by 0.05 nats (verl#2305's layout bug)
    old = -torch.rand(2, 4, generator=torch.Generator().manual_seed(0)) - 0.1
    with TraceWriter(root, "grpo", hyperparameters={"num_generations": 2}) as writer:
        for micro_batch, position, policy in ((0, 0, old), (1, 1, old + 0.05), (2, 0, old)):
            writer.record(0, _grpo(policy.clone(), old.clone()), micro_batch=micro_batch,
                          metadata={"fresh_rollouts": True, "micro_batch_in_mini_batch": position})
    return root


def _logprob_shift(root):
    # the trainer's logprob of token j is the sampler's of token j + 1 (tests/checks/test_ten_cases.py, case 2)
    tensors = {"prompt_ids": torch.tensor([[10, 11]]), "prompt_mask": torch.ones(1, 2, dtype=torch.bool),
               "completion_ids": torch.tensor([[12, 13]]), "completion_mask": torch.tensor([[True, False]]),
               "old_logprobs": torch.tensor([[-3.0, -3.0]]), "policy_logprobs": torch.tensor([[-3.0, -3.0]]),
               "sampler_logprobs": torch.tensor([[-0.2, -3.0]])}
    return write_trace(root, "grpo", [(0, 0, tensors)])


def _completion_start(root):
    # the completion was cut at the count of real prompt tokens (3), not the padded width (5)
    prompt_ids = torch.tensor([[0, 0, 11, 12, 13], [0, 14, 15, 16, 17]])
    ids = torch.tensor([[12, 13, 21, 22, EOS], [17, 23, 24, EOS, PAD]])
    return write_trace(root, "grpo", [(0, 0, {"prompt_ids": prompt_ids, "prompt_mask": prompt_ids != PAD,
                                               "completion_ids": ids, "completion_mask": ids != PAD})])


def _after_eos(root):
    ids = torch.tensor([[5, 6, EOS, 7, 8], [9, 10, 11, EOS, PAD]])
    return write_trace(root, "grpo", [(0, 0, {"completion_ids": ids,
                                               "completion_mask": _mask([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])})])


def _padding(root):
    ids = torch.tensor([[5, 6, 7, PAD, PAD], [9, 10, EOS, PAD, PAD]])  # row 0 kept its two pads, no EOS
    return write_trace(root, "grpo", [(0, 0, {"completion_ids": ids,
                                               "completion_mask": _mask([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])})])


def _empty_row(root):
    ids = torch.tensor([[5, 6, EOS, PAD], [7, 8, 9, EOS]])
    return write_trace(root, "grpo", [(0, 0, {"completion_ids": ids, "completion_mask": _mask([[0, 0, 0, 0],
                                                                                             [1, 1, 1, 1]])})])


def _dpo_rule(root):
    # rejected keeps the prompt (positions 0..1), chosen does not (tests/checks/test_ten_cases.py, case 9)
    return write_trace(root, "dpo", [(0, 0, case9_tensors([1, 1, 1, 1]))], {"beta": 0.1})


SYSTEM, USER, ASSISTANT, TOOL = 0, 1, 2, 3
# one packed episode: (role, turn, kept, ids); EOS closes every message
EPISODE = [(SYSTEM, 0, False, [10, 11, EOS]), (USER, 0, False, [12, 13, 14, EOS]),
           (ASSISTANT, 1, True, [20, 21, 22, 23, EOS]), (TOOL, 1, False, [30, 31, 32, 33, 34, EOS]),
           (ASSISTANT, 2, True, [24, 25, 26, 27, 28, 29, EOS])]
TOOL1, TURN2 = slice(12, 18), slice(18, 25)  # positions of the tool result and of assistant turn 2


def _episode() -> dict:
    """Two identical packed rows (tests/checks/test_turn_checks.py's episode): healthy, old == sampler ==
    policy on kept tokens, 0.0 at every other position, as packing loops write them."""
    ids, roles, turn_ids, keep = [], [], [], []
    for role, turn, kept, span in EPISODE:
        ids, roles, turn_ids, keep = ids + span, roles + [role] * len(span), turn_ids + [turn] * len(span), \
            keep + [kept] * len(span)
    pad = 3
    ids, roles, turn_ids, keep = ids + [PAD] * pad, roles + [-1] * pad, turn_ids + [-1] * pad, keep + [False] * pad
    T = len(ids)
    policy = -0.1 - 2.9 * torch.rand(2, T, generator=torch.Generator().manual_seed(0))  # (B, T)
    mask = torch.tensor([keep] * 2)
    old = torch.where(mask, policy, torch.zeros_like(policy))
    reasons = ["prompt"] * 7 + ["kept"] * 5 + ["tool_output"] * 6 + ["kept"] * 7 + ["padding"] * pad
    return {"completion_ids": torch.tensor([ids] * 2), "completion_mask": mask,
            "turn_ids": torch.tensor([turn_ids] * 2), "token_roles": torch.tensor([roles] * 2),
            "mask_reasons": torch.tensor([[MASK_REASON_NAMES.index(r) for r in reasons]] * 2),
            "policy_logprobs": policy, "old_logprobs": old.clone(), "sampler_logprobs": old.clone(),
            "rewards": torch.tensor([1.0, 0.0]), "advantages": torch.tensor([1.0, -1.0])}


def _episode_trace(root, edit: Callable[[dict], None], **meta):
    tensors = _episode()
    edit(tensors)
    return write_trace(root, "grpo", [(0, 0, tensors, {"num_generations": 2, **meta})])


def _tool_output_trained(root):
    return _episode_trace(root, lambda t: t["completion_mask"][:, TOOL1].fill_(True))


def _placeholder_logprobs(root):
    return _episode_trace(root, lambda t: t["old_logprobs"][0, TURN2].fill_(0.0))


def _turn_shift(root):
    def shift(t):  # turn 2's old logprobs read one token late
        row = t["old_logprobs"][0].clone()
        t["old_logprobs"][0, 18:24] = row[19:25]
        t["old_logprobs"][0, 24] = t["policy_logprobs"][0, 24]
    return _episode_trace(root, shift)


def _untrained_turn(root):
    return _episode_trace(root, lambda t: t["completion_mask"][1, TURN2].fill_(False))


def _advantage_assignment(root):
    def per_token(t):  # one advantage per episode, except turn 2 of row 0 credited on its own
        t["token_advantages"] = torch.where(t["completion_mask"], 1.0, 0.0) * torch.tensor([[1.0], [-1.0]])
        t["token_advantages"][0, TURN2] = 0.5
    return _episode_trace(root, per_token, advantage_assignment="episode")


def _k3_sign(root):
    policy = torch.tensor([[-1.0, -0.6, -2.0]])
    ref = torch.tensor([[-1.2, -0.5, -1.5]])
    return write_trace(root, "grpo", [(0, 0, _grpo(policy, policy.clone(), ref_logprobs=ref,
                                                   ref_kl_k3=formulas.kl_k1(policy, ref)))])  # k1 stored as k3


def _ref_gap(root):
    policy, ref = torch.tensor([[-1.1, -22.0]]), torch.tensor([[-1.0, -2.0]])  # ref - policy = 20 nats
    return write_trace(root, "grpo", [(0, 0, _grpo(policy, policy.clone(), ref_logprobs=ref))])


def _k1_steps(offset: float, seeds) -> list:
    steps = []
    for step, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(seed)
        policy = -torch.rand(16, 32, generator=g) * 2 - 0.1  # 512 kept tokens
        ref = policy - offset + 0.05 * torch.randn(16, 32, generator=g)  # k1 = policy - ref ≈ offset
        steps.append((step, 0, _grpo(policy, policy.clone(), ref_logprobs=ref)))
    return steps


def _k1_negative(root):
    return write_trace(root, "grpo", _k1_steps(-0.3, (0, 1, 2)), {"num_generations": 2})


def _k1_negative_step(root):
    return write_trace(root, "grpo", _k1_steps(-0.3, (0,)), {"num_generations": 2})


def _ref_tracks_policy(root):
    # ref == old on every fresh step file of 3 rollouts, with beta 0.04: the reference moves with the policy
    steps = []
    for step in range(3):
        old = -torch.rand(2, 4, generator=torch.Generator().manual_seed(step)) - 0.1
        steps.append((step, 0, _grpo(old.clone(), old, ref_logprobs=old.clone())))
    return write_trace(root, "grpo", steps, {"num_generations": 2, "beta": 0.04})


def _nonfinite(root):
    # old_logprobs NaN at a kept token; ratio and per_token_loss follow (tests/checks/test_ten_cases.py, case 6)
    policy, old, advantages = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, float("nan")]]), torch.tensor([[1.0, 1.0]])
    ratio = formulas.ratio(policy, old)
    return write_trace(root, "ppo", [(0, 0, {"completion_ids": torch.tensor([[5, 6]]),
                                              "completion_mask": torch.ones(1, 2, dtype=torch.bool),
                                              "policy_logprobs": policy, "old_logprobs": old, "advantages": advantages,
                                              "ratio": ratio, "per_token_loss": -ratio * advantages})])


def _group_size(root):
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 1.0, 2.0, 1.0])  # groups of 4 by group_ids, G = 3 declared
    tensors = {"completion_ids": torch.full((8, 2), 5), "completion_mask": torch.ones(8, 2, dtype=torch.bool),
               "policy_logprobs": -torch.ones(8, 2), "rewards": rewards,
               "advantages": formulas.group_advantages(rewards, 4), "group_ids": torch.arange(8) // 4}
    return write_trace(root, "grpo", [(0, 0, tensors)], {"num_generations": 3})


def _group_rows(root, rewards, advantages, hyper):
    return write_trace(root, "grpo", [(0, 0, {"rewards": torch.tensor(rewards), "advantages": torch.tensor(advantages)})],
                       hyper)


def _group_sum(root):
    # a batch z-score of group-constant rewards: each group sums to +4 or -4
    return _group_rows(root, [1.0] * 4 + [-1.0] * 4, [1.0] * 4 + [-1.0] * 4, {"num_generations": 4})


def _zero_variance(root):
    rewards = torch.tensor([-8.0] * 4 + [2.0] * 4)  # every group of 4 equal
    return write_trace(root, "grpo", [(0, 0, {"rewards": rewards, "advantages": formulas.group_advantages(rewards, 4),
                                               "group_ids": torch.arange(2).repeat_interleave(4)})],
                       {"num_generations": 4})


def _z_bound(root):
    return _group_rows(root, [0.0] * 4, [3.0, -1.0, -1.0, -1.0], {"num_generations": 4})  # |3| > sqrt(3)


def _masked_positions(root):
    mask = _mask([[1, 1, 0, 0], [1, 1, 1, 1]])
    advantages = torch.tensor([[0.5, 0.2, 0.7, 0.0], [0.1, -0.3, 0.4, 0.2]])  # 0.7 on a masked slot
    return write_trace(root, "ppo", [(0, 0, {"completion_ids": torch.tensor([[5, EOS, PAD, PAD], [6, 7, 8, EOS]]),
                                              "completion_mask": mask, "advantages": advantages})])


def _reward_placement(root):
    # the score 1.0 at index 4, one past the last kept token (tests/checks/test_ten_cases.py, case 4)
    return write_trace(root, "ppo", [(0, 0, {"completion_ids": torch.tensor([[5, 6, 7, EOS, PAD, PAD]]),
                                              "completion_mask": _mask([[1, 1, 1, 1, 0, 0]]),
                                              "token_rewards": torch.tensor([[0.0, 0, 0, 0, 1.0, 0]]),
                                              "rewards": torch.tensor([1.0])})])


def _sampler_steps(scale: float = 1.0, shift: float = 0.0):
    old = -torch.rand(4, 16, generator=torch.Generator().manual_seed(0)) * 4 - 0.1
    return _grpo(old.clone(), old, sampler_logprobs=scale * old + shift)


def _sampler_mismatch(root):
    # the sampler renormalised over a top-p nucleus: trainer below sampler by 0.3 nats on every token
    return write_trace(root, "grpo", [(0, 0, _sampler_steps(shift=0.3), {"top_p": 0.9})])


def _probs_diff(root):
    return write_trace(root, "grpo", [(0, 0, _sampler_steps(scale=0.3))])  # sampler = 0.3 x old


def _checksum(root):
    policy = torch.tensor([[-0.5, -1.0, -0.2]])
    write_trace(root, "grpo", [(0, 0, _grpo(policy, policy.clone()))])
    (path,) = sorted((root / "steps").glob("*.safetensors"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # one flipped bit in the last tensor's bytes
    path.write_bytes(bytes(raw))
    return root


def _ratio(root):
    policy, old = torch.tensor([[-1.0, -0.4]]), torch.tensor([[-1.2, -0.4]])
    return write_trace(root, "grpo", [(0, 1, _grpo(policy, old, ratio=formulas.ratio(old, policy)))])  # inverted


def _ref_kl_k3(root):
    policy, ref = torch.tensor([[-1.0, -0.4]]), torch.tensor([[-1.5, -0.3]])
    return write_trace(root, "grpo", [(0, 0, _grpo(policy, policy.clone(), ref_logprobs=ref,
                                                   ref_kl_k3=formulas.ref_kl_k3(ref, policy)))])  # arguments swapped


def _approx_kl_k2(root):
    policy, old = torch.tensor([[-1.0, -0.4]]), torch.tensor([[-1.3, -0.4]])
    return write_trace(root, "grpo", [(0, 1, _grpo(policy, old, approx_kl_k2=(policy - old) ** 2))])  # no 0.5


def _advantages(root):
    # Bessel's std per group where the population std (the seed's group z-score) is declared
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    step = _grpo(-torch.ones(4, 3), -torch.ones(4, 3), rewards=rewards,
                 advantages=formulas.trl_group_advantages(rewards, 4))
    return write_trace(root, "grpo", [(0, 0, step)], {"num_generations": 4, "advantage_rule": "group_zscore"})


def _token_rewards(root):
    # PPO with the KL penalty in the reward, written with its sign flipped: +kl_coef * k1(old, ref)
    mask = _mask([[1, 1, 1, 0], [1, 1, 1, 1]])
    old = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.2, -0.7, -0.9]])
    ref = old - torch.tensor([[0.2, -0.1, 0.3, 0.0], [0.1, 0.2, -0.2, 0.4]])
    rewards = torch.tensor([1.0, -0.5])
    flipped = formulas.kl_reward_token_rewards(rewards, old, ref, mask, -0.1, "k1")
    step = {"completion_ids": torch.tensor([[5, 6, EOS, PAD], [7, 8, 9, EOS]]), "completion_mask": mask,
            "policy_logprobs": old.clone(), "old_logprobs": old, "ref_logprobs": ref, "rewards": rewards,
            "token_rewards": flipped}
    return write_trace(root, "ppo", [(0, 0, step)], {"kl_in_reward": True, "kl_coef": 0.1})


def _clip_fractions(root):
    # ratios e^0.3, e^-0.3, 1, 1 with A > 0: high 1/4, region 2/4; the trainer logged high = 0.5
    step = _grpo(torch.tensor([[0.3, -0.3, 0.0, 0.0]]) - 1.0, torch.full((1, 4), -1.0), advantages=torch.tensor([1.0]))
    meta = {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "clip_fraction_high": 0.5}
    return write_trace(root, "grpo", [(0, 1, step, meta)])


def _dpo(root):
    tensors = case9_tensors([0, 0, 1, 1])
    tensors["dpo_loss"] = torch.tensor([0.6982])  # the loss of other masks; these give 0.6733
    return write_trace(root, "dpo", [(0, 0, tensors)], {"beta": 0.1})


def _per_token_loss(root):
    # beta 0.04 recorded, but the per-token loss was computed without the KL term
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 4, generator=g) * 2 - 0.1
    policy, ref = old + 0.1 * torch.randn(2, 4, generator=g), old - 0.3
    advantages = torch.tensor([1.0, -1.0])
    per_token_loss = formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2, 0.0, ref)
    step = _grpo(policy, old, ref_logprobs=ref, advantages=advantages, per_token_loss=per_token_loss)
    return write_trace(root, "grpo", [(0, 1, step)], {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "beta": 0.04})


def _loss(root):
    # advantages [+1, -1], lengths 5 and 2, ratio 1, beta 0: token-mean -3/7 recorded, sequence-mean 0 declared
    logprobs = torch.full((2, 6), -1.0)
    step = {"completion_mask": _mask([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]), "policy_logprobs": logprobs,
            "old_logprobs": logprobs.clone(), "advantages": torch.tensor([1.0, -1.0]), "loss": torch.tensor(-3 / 7)}
    return write_trace(root, "grpo", [(0, 0, step)], {"num_generations": 2, "clip_epsilon_low": 0.2,
                                                      "clip_epsilon_high": 0.2, "beta": 0.0,
                                                      "loss_reduction": "sequence_mean"})


PG_LOSSES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])  # token-mean 2.5, seq-mean-token-sum 5


def _verl_worker(root, pg_loss: float, meta: dict):
    tensors = {"completion_ids": torch.tensor([[5, 6, 1], [7, 1, 0]]), "completion_mask": _mask([[1, 1, 1], [1, 0, 0]]),
               "policy_logprobs": torch.full((2, 3), -1.0), "old_logprobs": torch.full((2, 3), -1.0),
               "verl_pg_losses": PG_LOSSES, "verl_pg_loss": torch.tensor(pg_loss)}
    with TraceWriter(root, "grpo") as writer:
        writer.record(0, tensors, metadata={"loss_mode": "vanilla", "pg_losses_from": "agg_loss", **meta})
    return root


def _loss_agg_mode(root):
    # the policy loss received token-mean and aggregated with seq-mean-token-sum
    return _verl_worker(root, 5.0, {"declared_loss_agg_mode": "token-mean", "loss_agg_mode_argument": "token-mean",
                                    "loss_agg_mode": "seq-mean-token-sum"})


def _advantage_std(root):
    # verl GRPO: the config says norm_adv_by_std_in_grpo=False, the call ran with True
    rewards, group_ids = torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1])
    step = _grpo(-torch.ones(4, 3), -torch.ones(4, 3), rewards=rewards, group_ids=group_ids,
                 advantages=formulas.verl_grpo_advantages(rewards, group_ids))
    meta = {"adv_estimator": "grpo", "declared_norm_adv_by_std_in_grpo": False, "norm_adv_by_std_in_grpo": True,
            "advantage_rule": "verl_grpo"}
    return write_trace(root, "grpo", [(0, 0, step, meta)], {"num_generations": 2})


def _declared_settings(root):
    return _verl_worker(root, 2.5, {"declared_loss_agg_mode": "token-mean", "loss_agg_mode": "token-mean",
                                    "loss_agg_mode_argument": "token-mean", "declared_clip_ratio_high": 0.28,
                                    "clip_ratio_high": 0.2})


def _reference_aliasing(root):
    # steps 1 and 2 follow updates at learning rate 1e-3, yet ref == policy on every pair: loss log 2
    steps = []
    for step in range(3):
        tensors = case9_tensors([0, 0, 1, 1])
        for side in ("chosen", "rejected"):
            tensors[f"{side}_ref_logprobs"] = tensors[f"{side}_policy_logprobs"].clone()
        tensors["loss"] = torch.tensor(math.log(2.0))
        steps.append((step, 0, tensors, {"learning_rate": 1e-3}))
    return write_trace(root, "dpo", steps, {"beta": 0.1})


def _health_step(entropy: float, sampler_shift: float, rewards: list[float]):
    """4 rows (2 groups of 2) x 3 kept tokens, policy = old = -1 (tests/checks/test_health_warnings.py)."""
    old = torch.full((4, 3), -1.0)
    return _grpo(old.clone(), old, sampler_logprobs=old - sampler_shift, entropy=torch.full((4, 3), entropy),
                 rewards=torch.tensor(rewards, dtype=torch.float32), advantages=torch.zeros(4), group_ids=torch.tensor([0, 0, 1, 1]))


def _health_run(root):
    # entropy 2 -> 0.04 nats, mean |old - sampler| 0.01 -> 0.3 nats, both groups flat from step 2
    steps = [(0, 0, _health_step(2.0, 0.01, [1, 0, 1, 1])), (1, 0, _health_step(1.0, 0.2, [1, 0, 1, 1])),
             (2, 0, _health_step(0.1, 0.3, [1, 1, 0, 0])), (3, 0, _health_step(0.04, 0.3, [1, 1, 0, 0]))]
    return write_trace(root, "grpo", steps, {"num_generations": 2})


def _ref_kl(root):
    # policy 3 nats below the reference on every token: k3 = e^3 - 3 - 1 = 16.09 nats per token, at 2 steps
    old = torch.full((2, 3), -4.0)
    return write_trace(root, "grpo", [(s, 0, _grpo(old.clone(), old, ref_logprobs=old + 3.0)) for s in range(2)],
                       {"num_generations": 2, "beta": 0.04})


def _clip_fraction(root):
    # after the first update the ratio is e^0.5 = 1.65 > 1.2 on every token, all advantages > 0
    old = torch.full((2, 3), -2.0)
    steps = [(s, 1, _grpo(old + 0.5, old.clone(), advantages=torch.tensor([1.0, 0.5]))) for s in range(2)]
    return write_trace(root, "grpo", steps, {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2})


TRACES: dict[str, tuple[Callable, str]] = {
    "fields.required": (_fields_required, "a GRPO step with ids, mask and policy logprobs only"),
    "identity.first_step": (_first_step, "policy ≠ old on 2 of 7 kept tokens at inner step 0"),
    "identity.old_aliases_policy": (_old_aliases_policy, "policy == old at inner step 1, after an update at learning rate 1e-3"),
    "logprobs.positive": (_logprobs_positive, "a kept policy logprob of +0.3 nats"),
    "identity.micro_batch_position": (_micro_batch_position, "three fresh micro-batches, the one at position 1 off by 0.05 nats"),
    "alignment.logprob_shift": (_logprob_shift, "each trainer logprob is the sampler's of the next token"),
    "alignment.completion_start": (_completion_start, "completions cut at the real prompt length of left-padded rows"),
    "masks.after_eos": (_after_eos, "a mask that keeps a token after EOS"),
    "masks.padding": (_padding, "a row without EOS whose two trailing pads are kept"),
    "masks.empty_row": (_empty_row, "a row whose mask keeps nothing"),
    "masks.dpo_rule": (_dpo_rule, "a DPO pair whose rejected mask keeps the prompt"),
    "turns.tool_output_trained": (_tool_output_trained, "a packed episode whose tool result is kept by the mask"),
    "turns.placeholder_logprobs": (_placeholder_logprobs, "old logprobs 0.0 over a trained assistant turn"),
    "turns.turn_shift": (_turn_shift, "old logprobs of turn 2 read one token late"),
    "turns.untrained_turn": (_untrained_turn, "the second assistant turn dropped from the mask"),
    "turns.advantage_assignment": (_advantage_assignment, "`episode` assignment, one turn credited on its own"),
    "kl.k3_sign": (_k3_sign, "k1 recorded under the name ref_kl_k3"),
    "kl.ref_gap": (_ref_gap, "ref − policy = 20 nats at one kept token"),
    "kl.k1_negative": (_k1_negative, "3 fresh steps with k1 ≈ −0.3 nats"),
    "kl.ref_tracks_policy": (_ref_tracks_policy, "ref == old at every rollout, beta 0.04"),
    "kl.k1_negative_step": (_k1_negative_step, "one fresh step of 512 tokens with k1 ≈ −0.3 nats"),
    "nonfinite.values": (_nonfinite, "a NaN old logprob at a kept token"),
    "advantages.group_size": (_group_size, "groups of 4 in group_ids, num_generations 3"),
    "advantages.group_sum": (_group_sum, "advantages z-scored over the batch instead of the group"),
    "advantages.zero_variance": (_zero_variance, "every group's rewards equal"),
    "advantages.z_bound": (_z_bound, "|A| = 3 in a group of 4"),
    "advantages.masked_positions": (_masked_positions, "a PPO advantage on a masked position"),
    "advantages.reward_placement": (_reward_placement, "the PPO reward one past the last kept token"),
    "sampler.mismatch": (_sampler_mismatch, "trainer 0.3 nats below the sampler on every token, top_p 0.9"),
    "sampler.probs_diff": (_probs_diff, "sampler logprobs 0.3 × the trainer's"),
    "integrity.checksum": (_checksum, "one bit flipped in a step file"),
    "recompute.ratio": (_ratio, "ratio recorded as exp(old − policy)"),
    "recompute.ref_kl_k3": (_ref_kl_k3, "k3 recorded with policy and ref swapped"),
    "recompute.approx_kl_k2": (_approx_kl_k2, "k2 recorded without its factor 0.5"),
    "recompute.advantages": (_advantages, "Bessel's std where the population std is declared"),
    "recompute.token_rewards": (_token_rewards, "the KL penalty added to the reward with its sign flipped"),
    "recompute.clip_fractions": (_clip_fractions, "a logged high clip fraction of 0.5 where 0.25 is recomputed"),
    "recompute.dpo": (_dpo, "a recorded dpo_loss of other masks"),
    "recompute.per_token_loss": (_per_token_loss, "beta 0.04 recorded, per-token loss without the KL term"),
    "recompute.loss": (_loss, "a token-mean loss where sequence_mean is declared"),
    "recompute.loss_agg_mode": (_loss_agg_mode, "verl pg_loss aggregated as seq-mean-token-sum, token-mean declared"),
    "recompute.advantage_std": (_advantage_std, "verl GRPO advantages divided by the std, config says not to"),
    "recompute.declared_settings": (_declared_settings, "clip_ratio_high 0.2 at the call, 0.28 in the config"),
    "dpo.reference_aliasing": (_reference_aliasing, "DPO ref == policy after updates at learning rate 1e-3"),
    "health.ref_kl": (_ref_kl, "mean k3 of 16 nats per token at 2 steps"),
    "health.clip_fraction": (_clip_fraction, "every token clipped after the first update"),
    "health.sampler_gap": (_health_run, "mean |old − sampler| 0.2–0.3 nats at steps 1..3"),
    "health.entropy_collapse": (_health_run, "entropy falling from 2 to 0.04 nats"),
    "health.reward_flat": (_health_run, "both groups flat at steps 2 and 3"),
}


def example(check_id: str, root: Path) -> tuple[str, str]:
    """``(severity, message)`` of the worst finding of ``check_id`` on its trace (:data:`TRACES`), the
    temporary directory written as ``RUN``. Raises RuntimeError when the check finds nothing there."""
    build, _ = TRACES[check_id]
    trace = build(root / check_id.replace(".", "_"))
    found = [f for f in run_checks(trace, select=[check_id], options=CheckOptions())
             if f.check == check_id and f.severity != SKIPPED]
    if not found:
        raise RuntimeError(f"{check_id} gave no finding on its reference trace: update TRACES in {__file__}")
    return found[0].severity, found[0].message.replace(str(root), "RUN")


def trimmed(message: str, limit: int = EXAMPLE_CHARS) -> str:
    """The message's first lines, cut after the last whole word within ``limit`` characters (`` …`` marks a cut)."""
    text = " ".join(message.split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " …"


def main() -> None:
    print("## Check reference\n")
    print("Generated by `python docs/check_reference.py`, which runs each check on a small trace written by\n"
          "`TraceWriter` that holds the bug the check looks for (tests/docs/test_check_reference.py keeps this\n"
          "section equal to its output). **Needs**: the fields and metadata keys the check reads, and what makes\n"
          "it skip or not apply. **Assumes**: what it takes as given. **Example**: the first characters of the\n"
          "message the check gave on that trace (`RUN` stands for the trace's directory).")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for check_id in CHECKS:
            entry = REFERENCE[check_id]
            severity, message = example(check_id, root)
            print(f"\n### `{check_id}`\n")
            print(f"**Needs:** {entry['needs']}\n")
            print(f"**Assumes:** {entry['assumes']}\n")
            print(f"**Example** ({severity}; {TRACES[check_id][1]}):\n")
            print("```text")
            print(textwrap.fill(trimmed(message), WRAP, break_long_words=False, break_on_hyphens=False))
            print("```")


def write(doc: Path = REPO / "docs" / "checks.md") -> None:
    """Replace ``doc`` from its ``## Check reference`` heading to the end (or append) with :func:`main`'s output."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main()
    text = doc.read_text(encoding="utf-8")
    head = text.split("\n## Check reference\n", 1)[0].rstrip("\n")
    doc.write_text(f"{head}\n\n{out.getvalue()}", encoding="utf-8")


if __name__ == "__main__":
    write() if sys.argv[1:] == ["--write"] else main()
