"""A vocabulary string holding a lone surrogate (a token's bytes that are not UTF-8, decoded with
``surrogateescape``, as some byte-level tokenizers give them) no longer stops ``tracer.Tracer(...)``:
writing tokens.json raised UnicodeEncodeError in the constructor, so the trainer died of its tracer.
The file is written as ASCII JSON with escapes; the reader shows the token as U+FFFD, the others as
they are."""

from __future__ import annotations

import json

import torch

import tracer
from tracer.read import Trace


def test_the_writer_starts_records_and_the_reader_shows_the_token(tmp_path):
    odd = b"\xff".decode("utf-8", "surrogateescape")  # '\udcff'
    out = tmp_path / "run"
    with tracer.Tracer(out, algorithm="grpo", vocabulary=["<pad>", "ok", odd], guard="off",
                       hyperparameters={"num_generations": 1}) as tr:
        tr.record(0, {"completion_ids": torch.tensor([[1, 2]]), "completion_mask": torch.tensor([[True, True]]),
                      "policy_logprobs": torch.tensor([[-0.5, -1.0]]), "rewards": torch.tensor([1.0])})
    raw = (out / "tokens.json").read_bytes()
    assert raw.isascii() and "\\udcff" in raw.decode("ascii")
    assert odd in json.dumps(json.loads(raw), ensure_ascii=False)  # the escape reads back as the same string
    trace = Trace(out)
    assert trace.tokens[:3] == ["<pad>", "ok", "\ufffd"]
    assert trace.token_table(trace.steps()[0], 0)["token_text"].tolist()[:2] == ["ok", "\ufffd"]
