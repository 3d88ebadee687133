"""masks.after_eos judges what follows the EOS inside the mask by what the tokenizer's chat template
writes after its end-of-turn token (recorded at capture as the manifest's
``tokenizer.template_end_of_turn_tail``), and only that: ChatML (MiniMind, Qwen2.5) writes
``<|im_end|>`` then a newline, Llama 3 writes ``<|eot_id|>`` and nothing. Real tokenizers built here
with ``tokenizers``, carrying each family's template (tests/fixtures/models.py); real trace files."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.check_traces import found
from tests.fixtures.models import build_chat_model, chat_tokenizer
from tests.fixtures.paths import SCRIPTS
from tracer import Trace, TraceWriter
from tracer.checks import ERROR, run_checks

FAMILIES = ("minimind", "qwen2.5", "llama3")
END_OF_TURN = {"minimind": "<|im_end|>", "qwen2.5": "<|im_end|>", "llama3": "<|eot_id|>"}
PAIRS = [(3, 4), (12, 9), (5, 0)]  # a + b: chosen answer a + b, rejected a + b + 1


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, chat_tokenizer(request.param)


def render(tokenizer, messages, **kw) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def conversations(tokenizer, answer_offset: int) -> list[tuple[list[int], int]]:
    """Per pair: the rendered ``[user, assistant]`` ids and where the answer starts (the length of the
    rendered ``[user]`` with the generation prompt)."""
    rows = []
    for a, b in PAIRS:
        user = {"role": "user", "content": f"What is {a} + {b}?"}
        prompt = render(tokenizer, [user], add_generation_prompt=True)
        full = render(tokenizer, [user, {"role": "assistant", "content": str(a + b + answer_offset)}])
        assert full[: len(prompt)] == prompt
        rows.append((full, len(prompt)))
    return rows


def expected_tail(tokenizer, name: str) -> list[int]:
    """Independently of tracer: the text the template writes after the assistant's end-of-turn token
    when another message follows, tokenized."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "7"},
                                          {"role": "user", "content": "Bye"}], tokenize=False)
    eot = END_OF_TURN[name]
    after = text[text.index("7" + eot) + len("7" + eot):]
    between = after[: after.index("Bye")]  # the tail, then the next message's header
    header = {"minimind": "<|im_start|>user\n", "qwen2.5": "<|im_start|>user\n",
              "llama3": "<|start_header_id|>user<|end_header_id|>\n\n"}[name]
    return tokenizer.encode(between[: len(between) - len(header)], add_special_tokens=False)


def write(root, algorithm, tokenizer, tensors, hyperparameters=None):
    with TraceWriter(root, algorithm, tokenizer=tokenizer, hyperparameters=hyperparameters or {}) as w:
        w.record(0, tensors)
    return root


def dpo_tensors(tokenizer, extra: int = 0) -> dict[str, torch.Tensor]:
    """DPO sides as prompt + answer + the template's end of turn, right-padded; each mask keeps the
    answer and everything the template wrote after it (the tail included), and ``extra`` more
    tokens on pair 1's chosen side."""
    pad = tokenizer.pad_token_id
    sides = {"chosen": conversations(tokenizer, 0), "rejected": conversations(tokenizer, 1)}
    S = max(len(full) for rows in sides.values() for full, _ in rows) + 2
    out = {}
    for side, rows in sides.items():
        out[f"{side}_ids"] = torch.tensor([full + [pad] * (S - len(full)) for full, _ in rows])  # (B, S)
        out[f"{side}_mask"] = torch.tensor([[start <= t < len(full) for t in range(S)] for full, start in rows])
        out[f"{side}_policy_logprobs"] = out[f"{side}_ref_logprobs"] = torch.full((len(rows), S), -1.0)
    full, _ = sides["chosen"][1]
    out["chosen_mask"][1, len(full): len(full) + extra] = True
    return out


def grpo_tensors(tokenizer, extra: int = 0) -> dict[str, torch.Tensor]:
    """Completions as the template renders the answer (answer, end of turn, tail), right-padded; the
    mask keeps every rendered token, and ``extra`` more on row 1."""
    pad = tokenizer.pad_token_id
    completions = [full[start:] for full, start in conversations(tokenizer, 0)]
    T = max(map(len, completions)) + 2
    ids = torch.tensor([c + [pad] * (T - len(c)) for c in completions])  # (B, T)
    keep = torch.tensor([[t < len(c) for t in range(T)] for c in completions])  # (B, T)
    keep[1, len(completions[1]): len(completions[1]) + extra] = True
    return {"completion_ids": ids, "completion_mask": keep, "policy_logprobs": torch.full(ids.shape, -1.0),
            "old_logprobs": torch.full(ids.shape, -1.0), "rewards": torch.zeros(len(completions))}


def after_eos(root):
    return found(run_checks(root, select=["masks.after_eos"]), "masks.after_eos")


def test_the_tail_recorded_is_what_the_template_writes_after_its_end_of_turn_token(family, tmp_path):
    name, tokenizer = family
    root = write(tmp_path / "t", "grpo", tokenizer, grpo_tensors(tokenizer))
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN[name])
    tail = expected_tail(tokenizer, name)
    assert tail == ([] if name == "llama3" else [tokenizer.convert_tokens_to_ids("Ċ")])  # "\n", byte-level
    assert Trace(root).manifest["tokenizer"]["template_end_of_turn_tail"] == {str(eot): tail}


@pytest.mark.parametrize("layout", ["dpo", "grpo"])
def test_a_mask_keeping_the_template_tail_passes_and_one_token_more_is_an_error(family, layout, tmp_path):
    name, tokenizer = family
    build, hyper = (dpo_tensors, {"beta": 0.1}) if layout == "dpo" else (grpo_tensors, {"num_generations": 3})
    healthy = build(tokenizer)
    ids_name, mask_name = ("chosen_ids", "chosen_mask") if layout == "dpo" else ("completion_ids", "completion_mask")
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN[name])
    tail = expected_tail(tokenizer, name)
    # the healthy mask ends with the end-of-turn token and the template's tail on every row
    for row, keep in zip(healthy[ids_name].tolist(), healthy[mask_name].tolist()):
        kept = [i for i, k in zip(row, keep) if k]
        assert kept[len(kept) - len(tail) - 1:] == [eot, *tail]
    assert after_eos(write(tmp_path / "healthy", layout, tokenizer, healthy, hyper)) == []

    leaky = build(tokenizer, extra=1)
    (f,) = after_eos(write(tmp_path / "leaky", layout, tokenizer, leaky, hyper))
    row = leaky[ids_name][1].tolist()
    eos_at = max(t for t, i in enumerate(row) if i == eot)  # the answer's end of turn (the last one)
    assert (f.severity, f.sequence, f.token, f.field) == (ERROR, 1, eos_at + len(tail) + 1, mask_name)
    assert f.token_id == tokenizer.pad_token_id  # the first token beyond the tail: padding
    pad_text = repr(tokenizer.pad_token)
    assert f"keeps token {f.token} (id {f.token_id} {pad_text}) after its first EOS (id {eot}) at token {eos_at}" in f.message
    if tail:
        assert "the first beyond the 1 token the chat template writes after it" in f.message
        assert f"the chat template recorded at capture writes [{tail[0]} '\\n'] after the EOS" in f.message
    else:
        assert "the chat template recorded at capture writes nothing after the EOS" in f.message
        assert "beyond" not in f.message


def test_a_newline_llama3_does_not_write_after_eot_is_an_error_the_newline_guess_let_pass(tmp_path):
    tokenizer = chat_tokenizer("llama3")
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    tensors = grpo_tensors(tokenizer)
    row = tensors["completion_ids"][0].tolist()
    end = row.index(tokenizer.eos_token_id)  # the answer's <|eot_id|>
    tensors["completion_ids"][0, end + 1] = newline[0]
    tensors["completion_mask"][0, end + 1] = True  # a kept "\n" after <|eot_id|>
    (f,) = after_eos(write(tmp_path / "recorded", "grpo", tokenizer, tensors, {"num_generations": 3}))
    assert (f.sequence, f.token, f.token_id) == (0, end + 1, newline[0])
    assert "writes nothing after the EOS" in f.message
    # the same tokens without a recorded template: the string rule takes the newline for a template's tail
    tokenizer.chat_template = None
    root = write(tmp_path / "guess", "grpo", tokenizer, tensors, {"num_generations": 3})
    assert "template_end_of_turn_tail" not in Trace(root).manifest["tokenizer"]
    assert after_eos(root) == []


def test_without_a_recorded_template_the_message_says_the_newline_rule_was_applied(tmp_path):
    tokenizer = chat_tokenizer("qwen2.5")
    tensors = dpo_tensors(tokenizer, extra=1)
    tokenizer.chat_template = None  # a tokenizer without a template, or a trace written before tails were
    (f,) = after_eos(write(tmp_path / "t", "dpo", tokenizer, tensors, {"beta": 0.1}))
    assert "no chat template recorded" in f.message and "up to 2 newline-only tokens" in f.message
    assert f.token_id == tokenizer.pad_token_id


def test_minimind_train_dpo_with_its_chat_template_mask_runs_clean_under_tracer_run(tmp_path, capsys):
    """MiniMind's DPODataset keeps ``<|im_end|>`` and the newline after it in the loss mask; the
    unmodified loop (tests/scripts/minimind_dpo_chat.py) traced by ``tracer run`` exits 0."""
    from tracer.cli import main as cli_main

    model_dir = build_chat_model(tmp_path / "model", "minimind")
    data = tmp_path / "dpo.jsonl"
    with open(data, "w", encoding="utf-8") as fh:
        for a, b in PAIRS + [(7, 7)]:
            user = {"role": "user", "content": f"What is {a} + {b}?"}
            fh.write(json.dumps({"chosen": [user, {"role": "assistant", "content": str(a + b)}],
                                 "rejected": [user, {"role": "assistant", "content": str(a + b + 1)}]}) + "\n")
    out = tmp_path / "run"
    code = cli_main(["run", "--algo", "dpo", "--out", str(out), "--meta", "loss_reduction=sequence_mean", "--",
                     str(SCRIPTS / "minimind_dpo_chat.py"), "--model_dir", str(model_dir), "--data_path", str(data)])
    assert code == 0, capsys.readouterr()
    trace = Trace(out)
    tokenizer = chat_tokenizer("minimind")
    im_end, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("Ċ")
    assert trace.manifest["tokenizer"]["template_end_of_turn_tail"] == {str(im_end): [newline]}
    assert len(trace.steps()) == 2
    for key in trace.steps():  # the recorded masks really end with <|im_end|> and the newline
        data_ = trace.load_step(key)
        for side in ("chosen", "rejected"):
            for row, keep in zip(data_[f"{side}_ids"].tolist(), data_[f"{side}_mask"].tolist()):
                kept = [i for i, k in zip(row, keep) if k]
                assert kept[-2:] == [im_end, newline]
    assert not [f for f in run_checks(out) if f.severity == ERROR]


@pytest.mark.parametrize("recorded", [
    "not an object", {"two": [1]}, {"2": "\n"}, {"2": [True]}, {"2": [-1]}, {"2": list(range(17))},
    {str(i): [] for i in range(65)}])
def test_a_malformed_recorded_tail_is_ignored_and_the_newline_rule_applies(recorded, tmp_path):
    """A trace from a stranger: a manifest tail of the wrong shape is no tail (read as absent), never a crash."""
    from tracer.format.chat_template import recorded_tails

    assert recorded_tails({"template_end_of_turn_tail": recorded}) is None
    tokenizer = chat_tokenizer("qwen2.5")
    root = write(tmp_path / "t", "dpo", tokenizer, dpo_tensors(tokenizer, extra=1), {"beta": 0.1})
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["tokenizer"]["template_end_of_turn_tail"] = recorded
    (root / "manifest.json").write_text(json.dumps(manifest))
    (f,) = after_eos(root)
    assert "no chat template recorded" in f.message and f.token_id == tokenizer.pad_token_id
