"""Small traces for the web UI's tests, written by ``TraceWriter`` in tmp_path: a toy vocabulary
whose token strings include markup (``<script>alert(1)</script>``, ``<b>``), and one GRPO step of
B = 4 sequences whose masked positions have every reason. Also what the app tests share: starting
the app on a root, and the texts a page renders as Markdown or HTML."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the app is not an installed package; import it from the checkout
    sys.path.insert(0, str(REPO))

from streamlit.testing.v1 import AppTest  # noqa: E402

from tracer import formulas  # noqa: E402
from tracer.record.writer import TraceWriter  # noqa: E402

APP = REPO / "app" / "streamlit_app.py"
SAMPLES = REPO / "sample_traces"
SCRIPT = "<script>alert(1)</script>"
BOLD = "<b>"
# Token strings of the toy vocabulary: id -> text.
VOCAB = ["<pad>", "<eos>", "Hello", " world", SCRIPT, " 2+2", "=", "4", BOLD, " yes", " no", "\n"]
PAD, EOS = 0, 1
HYPERPARAMETERS = {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "beta": 0.04}


class ToyTokenizer:
    """The part of a transformers tokenizer that TraceWriter reads (ids decoded one by one); the
    vocabulary is ``VOCAB`` unless another list is given (id 0 = pad, id 1 = EOS)."""

    name_or_path = "toy-tokenizer"
    eos_token_id = EOS
    pad_token_id = PAD
    padding_side = "left"

    def __init__(self, vocab: list[str] | None = None) -> None:
        self.vocab = VOCAB if vocab is None else vocab

    def __len__(self) -> int:
        return len(self.vocab)

    def batch_decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return ["".join(self.vocab[i] for i in row) for row in ids]


def grpo_step_tensors(seed: int) -> dict[str, torch.Tensor]:
    """One GRPO step: P = 2 prompts, G = 2 generations, B = 4, L = 5 (left-padded), T = 6.

    Completion rows, by the reason of each masked position:
      row 0: 7 <script> <eos> | pad pad pad     -> after_eos at 3..5
      row 1: " no" "=" | pad pad pad pad        -> padding at 2..5 (no EOS: truncated by padding)
      row 2: " yes" "4" "<b>" "<eos>" | pad pad -> after_eos at 4..5
      row 3: " yes" [" no"] "<b>" "<eos>" | pad pad -> masked at 1 (tool output), after_eos 4..5
    """
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.tensor([[PAD, PAD, 2, 3, 5], [PAD, PAD, 2, 3, 5],
                               [PAD, 2, 3, 6, 5], [PAD, 2, 3, 6, 5]])  # (B, L)
    prompt_mask = prompt_ids != PAD  # (B, L) left padding
    completion_ids = torch.tensor([[7, 4, EOS, PAD, PAD, PAD], [10, 6, PAD, PAD, PAD, PAD],
                                   [9, 7, 8, EOS, PAD, PAD], [9, 10, 8, EOS, PAD, PAD]])  # (B, T)
    completion_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                                    [1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    old = -torch.rand(4, 6, generator=gen) * 3 - 0.05  # (B, T) nats
    # noisy copies, clamped below 0: a logprob is <= 0 (tracer check's logprobs.positive)
    policy = (old + 0.05 * torch.randn(4, 6, generator=gen)).clamp(max=-1e-3)
    ref = (old + 0.1 * torch.randn(4, 6, generator=gen)).clamp(max=-1e-3)
    sampler = (old + 0.01 * torch.randn(4, 6, generator=gen)).clamp(max=-1e-3)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25]) + seed
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "old_logprobs": old, "policy_logprobs": policy, "ref_logprobs": ref, "sampler_logprobs": sampler,
        "ratio": formulas.ratio(policy, old), "ref_kl_k3": formulas.ref_kl_k3(policy, ref),
        "approx_kl_k2": formulas.approx_kl_k2(policy, old),
        "rewards": rewards, "advantages": formulas.group_advantages(rewards, 2),
        "group_ids": torch.tensor([0, 0, 1, 1]),
    }


def healthy_step_tensors(seed: int, inner_step: int) -> dict[str, torch.Tensor]:
    """:func:`grpo_step_tensors` as a correct run records them: on fresh rollouts (inner step 0)
    the policy has not moved yet, so policy = old and the ratio is exactly 1."""
    tensors = grpo_step_tensors(seed)
    if inner_step == 0:
        policy, old, ref = tensors["old_logprobs"].clone(), tensors["old_logprobs"], tensors["ref_logprobs"]
        tensors.update(policy_logprobs=policy, ratio=formulas.ratio(policy, old),
                       ref_kl_k3=formulas.ref_kl_k3(policy, ref), approx_kl_k2=formulas.approx_kl_k2(policy, old))
    return tensors


def write_trace(out: Path, tokenizer=None, steps: int = 3, edit=None, writer_kwargs=None) -> Path:
    """A finished GRPO trace of ``steps`` steps with inner steps 0 and 1 (:func:`healthy_step_tensors`).
    ``edit(step, inner_step, tensors)`` may change a step's tensors in place before it is recorded
    (a deliberate bug)."""
    with TraceWriter(out, "grpo", tokenizer=tokenizer, hyperparameters=HYPERPARAMETERS, config={"lr": 1e-6},
                     async_write=False, **(writer_kwargs or {})) as writer:
        for step in range(steps):
            for inner in (0, 1):
                tensors = healthy_step_tensors(step if inner == 0 else 100 + step, inner)
                if edit is not None:
                    edit(step, inner, tensors)
                writer.record(step, tensors, inner_step=inner)
    return out


def start(monkeypatch, root: Path, query: dict[str, str] | None = None) -> AppTest:
    """The app on ``root`` (TRACER_ROOT), run once; ``query`` becomes the URL's query string."""
    monkeypatch.setenv("TRACER_ROOT", str(root))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update(query or {})
    return at.run()


def markup_values(at: AppTest) -> list[str]:
    """Every text the page renders as Markdown or HTML (including widget labels and help)."""
    out = []
    for kind in ("markdown", "caption", "title", "header", "subheader", "warning", "info", "error", "success",
                 "exception"):
        out += [str(el.value) for el in at.get(kind)]
    out += [str(el.proto) for el in at.get("html")]
    return out


def assert_no_raw_markup(at: AppTest) -> None:
    """No Markdown or HTML element holds ``<script>`` or ``<b>`` as they are (unescaped)."""
    for text in markup_values(at):
        assert SCRIPT not in text and "<script>" not in text and BOLD not in text, text


def frame_with(at: AppTest, columns: set[str], key: str | None = None):
    """The first st.dataframe element having ``columns`` (and ``key``, when given)."""
    for df in at.dataframe:
        if columns <= set(df.value.columns) and (key is None or df.key == key):
            return df
    raise AssertionError(f"no table with {columns} among {[list(d.value.columns) for d in at.dataframe]}")


def styled_rows(styles: str, declaration: str) -> set[int]:
    """Row numbers of a pandas Styler's CSS (``df.proto.arrow_data.styler.styles``) whose rule
    holds ``declaration`` (e.g. a background colour)."""
    rows: set[int] = set()
    for rule in styles.split("}"):
        if declaration in rule:
            rows |= {int(n) for n in re.findall(r"_row(\d+)_col", rule.split("{")[0])}
    return rows


def largest_frame_with(at: AppTest, columns: set[str]):
    """The st.dataframe element with ``columns`` and the most rows (the full table, not an excerpt)."""
    frames = [df for df in at.dataframe if columns <= set(df.value.columns)]
    assert frames, f"no table with {columns} among {[list(d.value.columns) for d in at.dataframe]}"
    return max(frames, key=lambda df: len(df.value))
