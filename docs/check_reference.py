"""Print docs/checks.md's "Check reference": for every registered check, what it needs, what it assumes,
and an example message produced by running the check on a small real trace.

    python docs/check_reference.py              # Markdown on stdout
    python docs/check_reference.py --write      # replace the section at the end of docs/checks.md with it

The needs / assumes texts (:data:`REFERENCE`) are written from each check's code (``tracer/checks/*.py``).
Each example is real: ``TRACES`` (tests/fixtures/check_examples.py) builds, per check, step files with
``TraceWriter`` (the toy tokenizer of ``tests/fixtures/check_traces.py``: ids 0..63, EOS 2, pad 0) that hold
the bug the check looks for; this script runs
``tracer.checks.run_checks(trace, select=[id])`` and prints the check's worst finding, trimmed to about
:data:`EXAMPLE_CHARS` characters. A check that gives no finding on its trace makes the script fail: the
reference never shows an invented message. ``tests/docs/test_check_reference.py`` checks that every
registered check has an entry and that docs/checks.md holds this script's current output.
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python docs/check_reference.py`: the test fixtures live in the repo
    sys.path.insert(0, str(REPO))

from tracer.checks import CHECKS, SKIPPED, CheckOptions, run_checks  # noqa: E402

from tests.fixtures.check_examples import TRACES  # noqa: E402  (the trace each example runs on)

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
        "assumes": "padding is the trailing run of pad ids after the row's end: its EOS, or the recorded generation "
                   "length limit (`max_completion_length`, `max_new_tokens` or `max_response_length`, in step "
                   "metadata, hyperparameters or the script's arguments); pad ids sampled before the limit by a row "
                   "without EOS are tokens; pad == EOS is left to `masks.after_eos`; with no limit recorded, a "
                   "single pad id ending a completion without EOS is an info.",
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
    "sampler.is_weights": {
        "needs": "a declared correction (`is_correction` / TRL's `vllm_importance_sampling_correction` with `is_mode`, "
                 "`is_clip_min`, `is_clip_max`, `is_sequence_aggregation`; or verl's `rollout_is`, "
                 "`rollout_is_threshold`, `rollout_is_batch_normalize`) or recorded `is_weights` / "
                 "`sequence_is_weights` / `rollout_is_weights`; `old_logprobs`, `sampler_logprobs`, "
                 "`completion_mask`. Without recorded weights they are derived. A correction without a mode, or "
                 "an unknown mode, is reported as not checked.",
        "assumes": "TRL's rule (exp of old − sampler per token, or of its masked sum per sequence; truncate clamps, "
                   "mask zeroes outside the caps) and verl's (log ratio clamped to ±20, TIS upper cap, IcePop "
                   "`lower_upper`), both from tracer.formulas.importance, matched to 1e-3 relative; the weights act on "
                   "the clipped policy-gradient term (tested when `per_token_loss` of a GRPO-style loss is recorded).",
    },
    "sampler.policy_lag": {
        "needs": "`policy_version` [B] and metadata `trainer_version`; `max_policy_lag` for the bound (skipped "
                 "when a bound is declared without `policy_version`); a synchronous loop records neither.",
        "assumes": "lag = trainer_version − policy_version in optimizer updates; error beyond `max_policy_lag` or "
                   "for a negative lag; a warning when lagged rows are trained as on-policy (old recomputed with "
                   "the trainer's weights, a gap to the sampler, no weights recorded).",
    },
    "integrity.checksum": {
        "needs": "the header's `content_sha256` (written by `TraceWriter`); skipped on files without it.",
        "assumes": "the hash over every tensor's name, dtype, shape and bytes "
                   "(`tracer.format.hashing.content_sha256`) is what the writer recorded.",
    },
    "recompute.ratio": {
        "needs": "a recorded `ratio`, `policy_logprobs`, `old_logprobs` (or `old_logprobs_source = "
                 "\"policy_detached\"`); `importance_sampling_level` (`token` when not recorded).",
        "assumes": "ratio = exp(policy − old) per token; under `importance_sampling_level = sequence` (GSPO) the "
                   "per-token ratio or one per row, exp(masked mean of policy − old); |Δ| ≤ atol + "
                   "rtol·|recomputed| of the dtype (float32: 1e-5 + 1e-4), kept finite positions only.",
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
        "assumes": "token-level ratios, or one per sequence under GSPO (shares of the rows, as TRL's); TRL's "
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
                 "token), the clip epsilons, `ref_logprobs` when `beta` / `kl_coef` > 0; verl worker files: "
                 "`verl_pg_losses` and `loss_mode`. Not modelled (said `not checked:` first): TRL's sapo / vespo, "
                 "`off_policy_mask_threshold`, `top_entropy_quantile` < 1, verl losses other than vanilla / gspo "
                 "/ cispo / gpg.",
        "assumes": "GRPO's clipped surrogate (TRL's grpo, bnpo, dr_grpo, dapo, luspo; `delta` applied; per "
                   "token or GSPO's sequence ratio by `importance_sampling_level`; dual clip when `clip_ratio_c` "
                   "is recorded), CISPO's or PPO's rule plus coef × KL (`kl_estimator`, default k3, verl's `+` "
                   "forms read as their estimator; none when `kl_in_reward`); verl's registered loss per token; "
                   "kept tokens only, the dtype's recompute tolerance.",
    },
    "recompute.loss": {
        "needs": "the scalar `loss` (tensor [] / [1], or metadata `loss`), `completion_mask`, and "
                 "`per_token_loss` or its inputs; `loss_reduction` (else implied by TRL's `loss_type`), "
                 "`loss_divisor`, `max_completion_length`, `loss_scale`, `num_items_in_batch`; with an entropy "
                 "bonus (`entropy_coef` / `entropy_coeff` ≠ 0) `entropy` [B, T] (else `not checked: entropy "
                 "bonus`).",
        "assumes": "the declared reduction reproduces the loss to float noise (32 ulps × mean |per-token "
                   "loss|), after adding back the entropy bonus (coef × the `entropy_reduction` / verl "
                   "`loss_agg_mode` / token mean of `entropy`; its flipped sign or absence named first); other "
                   "explanations (another reduction, the unmasked mean over padding, the KL sign, the KL term "
                   "missing, the dual clip missing, the other ratio level, another clip range) are ranked by residual; within `loss_rtol` of the "
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


def example(check_id: str, root: Path) -> tuple[str, str]:
    """``(severity, message)`` of the worst finding of ``check_id`` on its trace (:data:`TRACES`), the
    temporary directory written as ``RUN``. Raises RuntimeError when the check finds nothing there."""
    build, _ = TRACES[check_id]
    trace = build(root / check_id.replace(".", "_"))
    found = [f for f in run_checks(trace, select=[check_id], options=CheckOptions())
             if f.check == check_id and f.severity != SKIPPED]
    if not found:
        raise RuntimeError(f"{check_id} gave no finding on its reference trace: update TRACES in tests/fixtures/check_examples.py")
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
