"""One token's text is shown capped (``tracer.format.text.shown_token``): a ``tokens.json`` entry of 1 MB
makes a token table of short cells that say how long the token was, made once per id, so a table
holds at most B x T x the cap characters of token text."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from tracer import Trace
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME, step_file_name
from tracer.format.text import MAX_TOKEN_TEXT, shown_token

LONG = 2**20  # characters of the hostile token


def _trace_with_one_long_token(tmp_path):
    """B = 8, T = 64 completion tokens, every one id 0, whose text is 1 MB of 'x'."""
    run = tmp_path / "run"
    (run / STEPS_DIR).mkdir(parents=True)
    (run / MANIFEST_NAME).write_text(json.dumps({"algorithm": "grpo", "status": "finished"}))
    (run / TOKENS_NAME).write_text(json.dumps({"tokens": ["x" * LONG, "a", "b"]}))
    B, T = 8, 64
    save_file({"completion_ids": torch.zeros(B, T, dtype=torch.int64),  # (B, T) all id 0
               "completion_mask": torch.ones(B, T, dtype=torch.bool),
               "policy_logprobs": torch.full((B, T), -1.0), "advantages": torch.zeros(B),
               "group_ids": torch.arange(B) // 2},
              str(run / STEPS_DIR / step_file_name(0)), metadata={"algorithm": "grpo", "num_generations": "2"})
    return run


def test_a_one_megabyte_token_is_shown_capped_with_its_length(tmp_path):
    trace = Trace(_trace_with_one_long_token(tmp_path))
    table = trace.token_table(trace.steps()[0])
    marker = f"…(+{LONG - MAX_TOKEN_TEXT} chars)"  # the elided rest, its length named
    assert len(table) == 8 * 64
    assert table["token_text"].str.len().max() <= MAX_TOKEN_TEXT + len(marker)
    assert set(table["token_text"]) == {"x" * MAX_TOKEN_TEXT + marker}
    assert trace.tokens[0] == "x" * LONG  # the stored strings stay whole (turn markers read them)


def test_each_ids_shown_text_is_made_once(tmp_path):
    trace = Trace(_trace_with_one_long_token(tmp_path))
    first, second = trace.token_text([0, 0])
    assert first is second  # one string per id, however often it occurs
    assert trace.token_text([1, 2, 7]) == ["a", "b", "<id 7>"]
    assert trace.decode([0]).endswith(f"…(+{LONG - MAX_TOKEN_TEXT} chars)")


def test_shown_token_keeps_short_texts_and_names_the_rest():
    assert shown_token("hello") == "hello"
    assert shown_token("a" * MAX_TOKEN_TEXT) == "a" * MAX_TOKEN_TEXT
    assert shown_token("abcdef", cap=2) == "ab…(+4 chars)"
