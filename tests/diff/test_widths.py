"""Two runs whose longest completion differs have different widths T: diff compares them over the
wider width, the extra positions not kept, instead of refusing them as unusable input."""

import pytest
import torch

from tracer import TraceWriter, diff
from tracer.cli import main


def write(root, ids, mask, logprobs):
    with TraceWriter(root, "grpo") as w:
        w.record(0, completion_ids=torch.tensor(ids), completion_mask=torch.tensor(mask),
                 policy_logprobs=torch.tensor(logprobs))
    return root


def test_only_padding_added_is_equal(tmp_path):
    a = write(tmp_path / "a", [[5, 6, 1]], [[1, 1, 1]], [[-0.5, -1.0, -0.1]])
    b = write(tmp_path / "b", [[5, 6, 1, 0]], [[1, 1, 1, 0]], [[-0.5, -1.0, -0.1, 0.0]])  # one more pad column
    report = diff(a, b)
    assert report.equal, report.format()
    assert main(["diff", str(a), str(b)]) == 0


def test_a_longer_completion_is_a_mask_difference_at_the_extra_token(tmp_path, capsys):
    a = write(tmp_path / "a", [[5, 6, 1]], [[1, 1, 1]], [[-0.5, -1.0, -0.1]])
    b = write(tmp_path / "b", [[5, 6, 7, 1]], [[1, 1, 1, 1]], [[-0.5, -1.0, -2.0, -0.1]])
    report = diff(a, b)
    assert not report.equal
    mask = report.fields["completion_mask"]
    # positions 2 and 3 are compared for ids (1 vs 7, none vs 1); only b keeps position 3
    assert mask.first.index[:2] == (0, 3)
    assert main(["diff", str(a), str(b), "--verbose"]) == 1
    out = capsys.readouterr().out
    assert "kept only in b: 1" in out and "<no token>" in out


def test_left_padded_prompts_of_different_widths_align_on_the_right(tmp_path):
    def run(root, prompt_ids, prompt_mask):
        with TraceWriter(root, "grpo") as w:
            w.record(0, prompt_ids=torch.tensor(prompt_ids), prompt_mask=torch.tensor(prompt_mask),
                     completion_ids=torch.tensor([[5, 1]]), completion_mask=torch.ones(1, 2))
        return root

    a = run(tmp_path / "a", [[0, 3, 4]], [[0, 1, 1]])  # one more pad on the left
    b = run(tmp_path / "b", [[3, 4]], [[1, 1]])
    assert diff(a, b).equal
    c = run(tmp_path / "c", [[3, 9]], [[1, 1]])
    report = diff(b, c)
    assert not report.equal and report.fields["prompt_ids"].first.index[:2] == (0, 1)


def test_prompt_token_text_is_read_at_each_sides_own_position(tmp_path, capsys):
    def run(root, prompt_ids, prompt_mask):
        with TraceWriter(root, "grpo") as w:
            w.record(0, prompt_ids=torch.tensor(prompt_ids), prompt_mask=torch.tensor(prompt_mask),
                     completion_ids=torch.tensor([[5, 1]]), completion_mask=torch.ones(1, 2))
        return root

    a = run(tmp_path / "a", [[3, 4]], [[1, 1]])
    b = run(tmp_path / "b", [[0, 0, 3, 9]], [[0, 0, 1, 1]])  # wider by two pads; last token changed
    report = diff(a, b)
    loc = report.fields["prompt_ids"].first
    # ids: a's 4 (its column 1) against b's 9 (its column 3), both at common column 3; no tokens.json,
    # so the texts are the ids' placeholders
    assert (loc.token_text, loc.token_text_b) == ("<id 4>", "<id 9>")


def test_the_token_view_of_dpo_traces_says_it_is_not_available(tmp_path):
    from tracer.diff import DiffInputError, token_diff_table

    def run(root):
        with TraceWriter(root, "dpo") as w:
            side = torch.ones(1, 2)
            w.record(0, chosen_ids=torch.tensor([[5, 1]]), rejected_ids=torch.tensor([[6, 1]]), chosen_mask=side,
                     rejected_mask=side, chosen_policy_logprobs=-side, rejected_policy_logprobs=-side,
                     chosen_ref_logprobs=-side, rejected_ref_logprobs=-side)
        return root

    with pytest.raises(DiffInputError, match="a DPO trace records chosen_"):
        token_diff_table(run(tmp_path / "a"), run(tmp_path / "b"), step=0, sequence=0)
