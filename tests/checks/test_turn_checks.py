"""The span-aware checks of multi-turn and agentic rows (tracer/checks/turns.py, masks.after_eos per
turn): a packed episode (system and user prompt, assistant turn 1 with a tool call, the tool's
result, assistant turn 2) written by TraceWriter with the toy tokenizer, healthy and with each bug
injected by hand."""

import torch

from tracer.checks import ERROR, run_checks
from tracer.format.turns import MASK_REASON_NAMES

from tests.fixtures.check_traces import EOS, PAD, found, write_trace

SYSTEM, USER, ASSISTANT, TOOL = 0, 1, 2, 3
# (role, turn, kept, ids) spans of one packed row; EOS (2) closes every message
EPISODE = [
    (SYSTEM, 0, False, [10, 11, EOS]),
    (USER, 0, False, [12, 13, 14, EOS]),
    (ASSISTANT, 1, True, [20, 21, 22, 23, EOS]),
    (TOOL, 1, False, [30, 31, 32, 33, 34, EOS]),
    (ASSISTANT, 2, True, [24, 25, 26, 27, 28, 29, EOS]),
]
T = sum(len(ids) for *_, ids in EPISODE) + 3  # 25 tokens and three pad tokens
TURN2 = slice(18, 25)  # the positions of assistant turn 2
TOOL1 = slice(12, 18)  # the positions of the tool result


def episode(rows=2, seed=0):
    """Tensors of ``rows`` identical packed rows: healthy, old == sampler == policy at kept tokens
    (a first pass), 0.0 placeholders at every other position, as packing loops write them."""
    gen = torch.Generator().manual_seed(seed)
    ids, roles, turns, keep = [], [], [], []
    for role, turn, kept, span in EPISODE:
        ids += span
        roles += [role] * len(span)
        turns += [turn] * len(span)
        keep += [kept] * len(span)
    pad = T - len(ids)
    ids, roles, turns, keep = ids + [PAD] * pad, roles + [-1] * pad, turns + [-1] * pad, keep + [False] * pad
    policy = -0.1 - 2.9 * torch.rand(rows, T, generator=gen)  # (B, T) in [-3, -0.1]
    mask = torch.tensor([keep] * rows)
    old = torch.where(mask, policy, torch.zeros_like(policy))
    reasons = [[MASK_REASON_NAMES.index(r) for r in
                ["prompt"] * 7 + ["kept"] * 5 + ["tool_output"] * 6 + ["kept"] * 7 + ["padding"] * pad]] * rows
    return {
        "completion_ids": torch.tensor([ids] * rows), "completion_mask": mask,
        "turn_ids": torch.tensor([turns] * rows), "token_roles": torch.tensor([roles] * rows),
        "mask_reasons": torch.tensor(reasons),
        "policy_logprobs": policy, "old_logprobs": old.clone(), "sampler_logprobs": old.clone(),
        "rewards": torch.tensor([1.0, 0.0][:rows]), "advantages": torch.tensor([1.0, -1.0][:rows]),
    }


def check(tmp_path, tensors, name="t"):
    return run_checks(write_trace(tmp_path / name, "grpo", [(0, 0, tensors, {"num_generations": 2})]))


def errors(findings):
    return sorted({f.check for f in findings if f.severity == ERROR})


def test_a_healthy_packed_episode_passes_every_check(tmp_path):
    assert errors(check(tmp_path, episode())) == []


def test_without_turn_ids_or_roles_the_prompt_and_turn_eos_are_not_the_end_of_the_answer(tmp_path):
    # MiniMind's train_agent.py: packed rows, no turns or roles recorded, no prompt_ids
    tensors = {k: v for k, v in episode().items() if k not in ("turn_ids", "token_roles", "mask_reasons")}
    findings = check(tmp_path, tensors)
    assert found(findings, "masks.after_eos") == []
    assert errors(findings) == []


def test_a_kept_token_after_the_eos_of_a_turn_is_named_with_its_turn(tmp_path):
    tensors = episode()
    tensors["completion_mask"][0, 25] = True  # the first pad token after turn 2's EOS (position 24)
    (f,) = found(check(tmp_path, tensors), "masks.after_eos")
    assert (f.severity, f.sequence, f.token, f.details["turn"]) == (ERROR, 0, 25, 2)
    assert "after its first EOS of turn 2 (id 2) at token 24" in f.message


def test_tool_output_in_the_loss_mask_names_the_turn_and_the_span(tmp_path):
    tensors = episode()
    tensors["completion_mask"][:, TOOL1] = True
    (f,) = found(check(tmp_path, tensors), "turns.tool_output_trained")
    assert (f.severity, f.sequence, f.token, f.details["turn"], f.details["span"]) == (ERROR, 0, 12, 1, [12, 18])
    assert "turn 1: the tool span at tokens 12..17 (6 tokens" in f.message
    assert f.details["tokens"] == 12  # 6 tool tokens in each of 2 rows
    assert "The recorded mask_reasons says 'tool_output' at token 12, yet completion_mask keeps it" in f.message


def test_tool_output_is_found_from_mask_reasons_alone(tmp_path):
    tensors = episode()
    del tensors["token_roles"]
    tensors["completion_mask"][1, TOOL1] = True
    (f,) = found(check(tmp_path, tensors), "turns.tool_output_trained")
    assert (f.sequence, f.token) == (1, 12) and "the tool_output span" in f.message and "from mask_reasons" in f.message


def test_placeholder_old_logprobs_on_trained_tokens_are_an_error(tmp_path):
    tensors = episode()
    tensors["old_logprobs"][0, TURN2] = 0.0  # the fill written where turn 2's logprobs belong
    (f,) = [x for x in found(check(tmp_path, tensors), "turns.placeholder_logprobs") if x.field == "old_logprobs"]
    assert (f.severity, f.sequence, f.token) == (ERROR, 0, 18)
    assert f.details["tokens"] == 7 and "exactly 0.0" in f.message and "turn 2" in f.message


def test_a_constant_fill_on_trained_tokens_is_an_error_but_a_real_zero_logprob_is_not(tmp_path):
    tensors = episode()
    tensors["old_logprobs"][1, TURN2] = -1e-9  # a constant fill other than 0
    tensors["sampler_logprobs"][1, TURN2] = -1e-9
    (f, _) = found(check(tmp_path, tensors, "fill"), "turns.placeholder_logprobs")
    assert (f.sequence, f.token) == (1, 18) and "the constant" in f.message
    healthy = episode()
    healthy["policy_logprobs"][0, 10] = healthy["old_logprobs"][0, 10] = healthy["sampler_logprobs"][0, 10] = 0.0
    assert found(check(tmp_path, healthy, "real"), "turns.placeholder_logprobs") == []


def test_a_shift_inside_one_later_turn_is_named_as_a_shift_of_that_turn(tmp_path):
    tensors = episode()
    for name in ("old_logprobs",):
        row = tensors[name][0].clone()
        tensors[name][0, 18:24] = row[19:25]  # turn 2's logprobs read one token late (its EOS moved in)
        tensors[name][0, 24] = tensors["policy_logprobs"][0, 24]
    (f,) = found(check(tmp_path, tensors), "turns.turn_shift")
    assert (f.severity, f.sequence, f.token, f.details["turn"], f.details["shift"]) == (ERROR, 0, 18, 2, 1)
    assert "turn 2 (tokens 18..24)" in f.message


def test_a_later_turn_left_out_of_the_trained_tokens_is_named(tmp_path):
    tensors = episode()
    tensors["completion_mask"][1, TURN2] = False  # the mask stops at the first tool call
    (f,) = found(check(tmp_path, tensors), "turns.untrained_turn")
    assert (f.severity, f.sequence, f.token, f.details["turn"]) == (ERROR, 1, 18, 2)
    assert "none of its 7 assistant tokens is trained" in f.message


def test_a_turn_cut_mid_way_is_named_unless_its_reason_says_truncated(tmp_path):
    tensors = episode()
    tensors["completion_mask"][0, 19:25] = False
    (f,) = found(check(tmp_path, tensors, "cut"), "turns.untrained_turn")
    assert (f.sequence, f.token) == (0, 19) and "drops 5 of the turn's tokens from token 19 (after 1 trained ones)" in f.message
    tensors["mask_reasons"][0, 19:25] = MASK_REASON_NAMES.index("truncated")
    assert found(check(tmp_path, tensors, "truncated"), "turns.untrained_turn") == []


def test_a_short_untrained_tail_is_a_stop_string_the_loop_appended(tmp_path):
    tensors = episode()
    tensors["completion_mask"][:, 21:24] = False  # 3 tokens re-appended after the sampled text, before the EOS
    tensors["mask_reasons"][:, 21:24] = MASK_REASON_NAMES.index("kept")  # no reason recorded for them
    assert found(check(tmp_path, tensors), "turns.untrained_turn") == []


def test_per_token_advantages_follow_the_declared_assignment(tmp_path):
    tensors = episode()
    tensors["token_advantages"] = torch.where(tensors["completion_mask"], 1.0, 0.0) * torch.tensor([[1.0], [-1.0]])
    meta = {"num_generations": 2, "advantage_assignment": "episode"}
    assert found(run_checks(write_trace(tmp_path / "ok", "grpo", [(0, 0, tensors, meta)])),
                 "turns.advantage_assignment") == []
    tensors["token_advantages"][0, 18:25] = 0.5  # turn 2 of row 0 credited on its own
    (f,) = found(run_checks(write_trace(tmp_path / "bad", "grpo", [(0, 0, tensors, meta)])), "turns.advantage_assignment")
    assert (f.severity, f.sequence, f.token) == (ERROR, 0, 18) and "turn 2" in f.message
    per_turn = {**meta, "advantage_assignment": "turn"}
    assert found(run_checks(write_trace(tmp_path / "turn", "grpo", [(0, 0, tensors, per_turn)])),
                 "turns.advantage_assignment") == []


def test_kept_tool_output_is_one_finding_not_also_an_after_eos_one(tmp_path):
    tensors = episode()
    tensors["completion_mask"][:, TOOL1] = True  # the tool result follows turn 1's EOS
    for name in ("old_logprobs", "sampler_logprobs"):  # scored by the trainer's forward pass, as TRL does
        tensors[name][:, TOOL1] = tensors["policy_logprobs"][:, TOOL1]
    assert errors(check(tmp_path, tensors, "scored")) == ["turns.tool_output_trained"]
    tensors["old_logprobs"][:, TOOL1] = 0.0  # placeholders there: still one cause, not also a placeholder finding
    assert "turns.placeholder_logprobs" not in errors(check(tmp_path, tensors, "filled"))


def test_without_turn_fields_a_kept_tool_result_says_the_rows_may_be_multi_turn(tmp_path):
    tensors = {k: v for k, v in episode().items() if k not in ("turn_ids", "token_roles", "mask_reasons")}
    tensors["completion_mask"][:, TOOL1] = True  # no gap left between the turns: read as one answer
    (f,) = found(check(tmp_path, tensors), "masks.after_eos")
    assert f.token == 12 and "2 of these rows keep another EOS after it" in f.message
    assert "record turn_ids and token_roles" in f.message


def test_with_turn_fields_padding_is_what_they_say_whatever_the_token(tmp_path):
    tensors = episode()
    tensors["completion_ids"][0, 24] = PAD  # turn 2 ended by a sampled pad id (a second EOS): the assistant's
    assert found(check(tmp_path, tensors, "sampled"), "masks.padding") == []
    tensors = episode()
    tensors["completion_mask"][1, 25:] = True  # the trailing padding kept
    (f,) = found(check(tmp_path, tensors, "kept"), "masks.padding")
    assert (f.severity, f.sequence, f.token, f.details["tokens"]) == (ERROR, 1, 25, 3)


def per_turn_rows(advantage_of_episode):
    """2 prompts x 2 episodes x 3 turn rows (B = 12): each row one assistant turn of 4 tokens; an
    episode's reward and advantage copied to its three rows, as per-turn trainers do."""
    rewards_by_episode = [1.0, 0.0, 0.5, 0.5]  # prompt 0: 1 vs 0; prompt 1: equal rewards
    rows = [(e, turn) for e in range(4) for turn in (1, 2, 3)]
    ids = torch.tensor([[20 + turn, 21, 22, EOS] for _, turn in rows])
    policy = -0.5 - torch.rand(12, 4, generator=torch.Generator().manual_seed(1))
    return {
        "completion_ids": ids, "completion_mask": torch.ones(12, 4, dtype=torch.bool),
        "turn_ids": torch.tensor([[turn] * 4 for _, turn in rows]),
        "token_roles": torch.full((12, 4), ASSISTANT), "episode_ids": torch.tensor([e for e, _ in rows]),
        "policy_logprobs": policy, "old_logprobs": policy.clone(),
        "rewards": torch.tensor([rewards_by_episode[e] for e, _ in rows]),
        "advantages": torch.tensor([advantage_of_episode[e] for e, _ in rows]),
        "group_ids": torch.tensor([e // 2 for e, _ in rows]),
    }


def test_per_turn_rows_are_judged_one_row_per_episode(tmp_path):
    # group z-score with population std over the 2 episodes of each prompt: (1 - 0.5) / (0.5 + 1e-4)
    z = 0.5 / (0.5 + 1e-4)
    healthy = run_checks(write_trace(tmp_path / "ok", "grpo", [(0, 0, per_turn_rows([z, -z, 0.0, 0.0]),
                                                                 {"num_generations": 2})]))
    assert errors(healthy) == [] and found(healthy, "advantages.group_size") == []
    wrong = run_checks(write_trace(tmp_path / "bad", "grpo", [(0, 0, per_turn_rows([0.7, -z, 0.0, 0.0]),
                                                               {"num_generations": 2})]))
    (f,) = [x for x in found(wrong, "recompute.advantages") if x.severity == ERROR]
    assert f.sequence == 0  # episode 0's first row


def test_a_sequence_mean_over_the_rows_that_keep_a_token_is_a_sequence_mean(tmp_path):
    from tracer import formulas

    tensors = episode(rows=2)
    tensors["completion_mask"][1] = False  # an empty row, left out of MiniMind's mean (valid_rows)
    ptl = -tensors["policy_logprobs"]
    loss = formulas.masked_mean(ptl[:1], tensors["completion_mask"][:1], dim=1).mean()  # by hand: row 0 only
    tensors.update(per_token_loss=ptl, loss=loss)
    meta = {"num_generations": 2, "loss_reduction": "sequence_mean"}
    findings = run_checks(write_trace(tmp_path / "t", "grpo", [(0, 0, tensors, meta)]))
    assert found(findings, "recompute.loss") == []
    tensors["loss"] = loss * 1.3
    findings = run_checks(write_trace(tmp_path / "u", "grpo", [(0, 0, tensors, meta)]))
    assert [f.severity for f in found(findings, "recompute.loss")] == [ERROR]


class NewlineTokenizer:
    """The toy tokenizer's strings (``<pad>``, ``<unk>``, ``<eos>``, ``t3``...) with id 9 a newline."""

    eos_token_id, pad_token_id, name_or_path = EOS, PAD, "toy-newline"

    def __len__(self):
        return 64

    def batch_decode(self, ids, **_):
        names = {0: "<pad>", 1: "<unk>", 2: "<eos>", 9: "\n"}
        return [names.get(i[0], f"t{i[0]}") for i in ids]


def test_the_newline_a_chat_template_writes_after_eos_is_part_of_the_answer(tmp_path):
    from tracer import TraceWriter

    # DPO sides as MiniMind's train_dpo.py masks them: prompt, answer, <|im_end|>, "\n" kept, padding
    chosen = torch.tensor([[5, 6, 7, 8, EOS, 9, PAD, PAD]])
    rejected = torch.tensor([[5, 6, 10, 11, 12, EOS, 9, PAD]])
    mask_c = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    mask_r = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    lp = torch.full((1, 8), -1.0)
    tensors = {"chosen_ids": chosen, "rejected_ids": rejected, "chosen_mask": mask_c | (chosen == 9),
               "rejected_mask": mask_r | (rejected == 9), "chosen_policy_logprobs": lp, "rejected_policy_logprobs": lp,
               "chosen_ref_logprobs": lp, "rejected_ref_logprobs": lp}

    def after_eos(name, tokens):
        with TraceWriter(tmp_path / name, "dpo", tokenizer=NewlineTokenizer(), hyperparameters={"beta": 0.1}) as w:
            w.record(0, tokens)
        return found(run_checks(tmp_path / name), "masks.after_eos")

    assert after_eos("newline", tensors) == []
    tensors["chosen_mask"] = tensors["chosen_mask"] | (chosen == PAD)  # padding after it: still an error
    (f,) = after_eos("padding", tensors)
    assert (f.sequence, f.token, f.field) == (0, 6, "chosen_mask")
