"""Two runs whose longest completion differs have different widths T: diff compares them over the
wider width, the extra positions not kept, instead of refusing them as unusable input."""

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
    assert main(["diff", str(a), str(b)]) == 1
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
