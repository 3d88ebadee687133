"""The Conversation page on a long agentic episode: one packed row of T = 32,768 tokens holding a
256-token prompt and 64 assistant turns (each 300 trained tokens with a tool call, then a 208-token
tool result), turn_ids and token_roles recorded, old and sampler logprobs placeholders (0.0) at the
masked positions. Measured server side, no browser:

- the view: ``tracer.views.conversation`` (read the row, token table, spans, per-turn table);
- the page's builders on it: the chat HTML of every turn (the worst case; the page shows 16 turns a
  page), the per-turn table as shown, the legend;
- the whole page through Streamlit's ``AppTest`` (the real page script), first open and warm
  rerun, beside the Tokens page of the same sequence measured the same way.

    python -m bench.bench_conversation

Target: the view and the builders of all 64 turns within 1 s on this 2-core machine.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine, median
from tracer.record.writer import TraceWriter

REPO = Path(__file__).resolve().parents[1]
B, T, PROMPT, TURNS, ASSISTANT, TOOL_RESULT = 4, 32_768, 256, 64, 300, 208
SYSTEM, USER, ASSISTANT_ROLE, TOOL_ROLE = 0, 1, 2, 3
PAD, EOS, CALL_OPEN, CALL_CLOSE = 0, 1, 2, 3
VOCAB = ["<pad>", "<eos>", "<tool_call>", "</tool_call>", *[f" w{i}" for i in range(996)]]


class Tokenizer:
    """What TraceWriter reads of a tokenizer: ids decoded one by one."""

    name_or_path = "bench-vocab"
    eos_token_id, pad_token_id = EOS, PAD

    def __len__(self) -> int:
        return len(VOCAB)

    def batch_decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return ["".join(VOCAB[i] for i in row) for row in ids]


def episode_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """B packed rows of the module docstring's episode, GRPO fields."""
    assert PROMPT + TURNS * (ASSISTANT + TOOL_RESULT) == T
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, len(VOCAB), (B, T), generator=gen)  # (B, T)
    turn_ids = torch.zeros(T, dtype=torch.long)
    roles = torch.full((T,), USER, dtype=torch.long)
    roles[:PROMPT // 4] = SYSTEM
    keep = torch.zeros(T, dtype=torch.bool)
    for k in range(TURNS):
        start = PROMPT + k * (ASSISTANT + TOOL_RESULT)
        turn_ids[start:start + ASSISTANT + TOOL_RESULT] = k + 1
        roles[start:start + ASSISTANT] = ASSISTANT_ROLE
        roles[start + ASSISTANT:start + ASSISTANT + TOOL_RESULT] = TOOL_ROLE
        keep[start:start + ASSISTANT] = True
        ids[:, start + 250] = CALL_OPEN  # the turn's tool call: its last 50 tokens
        ids[:, start + ASSISTANT - 2] = CALL_CLOSE
        ids[:, start + ASSISTANT - 1] = EOS
    keep = keep.expand(B, T)
    old = -torch.rand(B, T, generator=gen) * 3 - 0.01  # (B, T) nats
    policy = (old + 0.05 * torch.randn(B, T, generator=gen)).clamp(max=-1e-4)
    ref = (old + 0.1 * torch.randn(B, T, generator=gen)).clamp(max=-1e-4)
    sampler = (old + 0.01 * torch.randn(B, T, generator=gen)).clamp(max=-1e-4)
    zeros = torch.zeros_like(old)
    rewards = torch.rand(B, generator=gen)
    return {"completion_ids": ids, "completion_mask": keep, "turn_ids": turn_ids.expand(B, T).clone(),
            "token_roles": roles.expand(B, T).clone(), "policy_logprobs": policy,
            "old_logprobs": torch.where(keep, old, zeros), "sampler_logprobs": torch.where(keep, sampler, zeros),
            "ref_logprobs": ref, "rewards": rewards, "advantages": rewards - rewards.mean(),
            "group_ids": torch.zeros(B, dtype=torch.long)}


def write_trace(root: Path) -> Path:
    run = root / "agent"
    hyper = {"num_generations": B, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "beta": 0.04}
    with TraceWriter(run, "grpo", tokenizer=Tokenizer(), hyperparameters=hyper, async_write=False) as writer:
        writer.record(0, episode_tensors())
    return run


def time_builders(run: Path, rounds: int = 5) -> dict[str, float]:
    """Median seconds of the view (a fresh Trace each round: nothing cached) and of the page's builders."""
    from app.components.coloured_text import legend_html
    from app.components.conversation import chat_html, turn_display_frame, turns_on_page
    from tracer.read import Trace
    from tracer.views import conversation

    view, chat_all, chat_page, tables = [], [], [], []
    for _ in range(rounds):
        trace = Trace(run)
        key = trace.steps()[0]
        trace.token_text([0])  # the token strings, read once per open trace (not the view's work)
        t0 = time.perf_counter()
        episode = conversation(trace, key, 0)
        view.append(time.perf_counter() - t0)
        hover = [c for c in ("ratio", "ref_kl_k3", "approx_kl_k2", "abs_old_sampler", "advantages",
                             "policy_logprobs", "old_logprobs", "sampler_logprobs") if c in episode.tokens]
        t0 = time.perf_counter()
        html_all = chat_html(episode, "ratio", hover)
        chat_all.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        html_page = chat_html(episode, "ratio", hover, turns_on_page(episode, 0))
        chat_page.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        turn_display_frame(episode)
        legend_html("ratio", episode.tokens)
        tables.append(time.perf_counter() - t0)
    assert episode.assistant_turns == TURNS and len(episode.tokens) == T
    return {"view_s": median(view), "chat_all_turns_s": median(chat_all), "chat_one_page_s": median(chat_page),
            "turn_table_s": median(tables), "html_all_turns_mb": len(html_all) / 1e6,
            "html_one_page_mb": len(html_page) / 1e6,
            "view_and_builders_s": median(view) + median(chat_all) + median(tables)}


def time_page(root: Path, page: str, rounds: int = 3) -> dict[str, float]:
    """Cold (first open, caches cleared) and warm (median rerun) seconds of one page through AppTest."""
    from streamlit.testing.v1 import AppTest

    from app.components import trace_cache

    trace_cache.clear_caches()
    os.environ["TRACER_ROOT"] = str(root)
    at = AppTest.from_file(str(REPO / "app" / "streamlit_app.py"), default_timeout=600)
    at.query_params.update({"run": "agent", "step": "0", "seq": "0"})
    at.run()
    t0 = time.perf_counter()
    at.switch_page(f"app_pages/{page}.py").run()
    cold = time.perf_counter() - t0
    assert not at.exception, [e.value for e in at.exception]
    warm = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        at.run()
        warm.append(time.perf_counter() - t0)
    sent = sum(len(h.proto.body) for h in at.get("html"))
    sent += sum(len(d.proto.arrow_data.data) for d in at.dataframe)
    sent += sum(len(c.proto.spec) for c in at.get("plotly_chart"))
    return {"cold_s": cold, "warm_s": median(warm), "sent_mb": sent / 1e6}


def measure() -> dict[str, float]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = write_trace(root)
        builders = time_builders(run)
        conversation = time_page(root, "conversation")
        tokens = time_page(root, "tokens")
    return {**builders, **{f"conversation_{k}": v for k, v in conversation.items()},
            **{f"tokens_{k}": v for k, v in tokens.items()},
            "warm_ratio": conversation["warm_s"] / tokens["warm_s"],
            "cold_ratio": conversation["cold_s"] / tokens["cold_s"]}


def main() -> None:
    print(f"Machine: {machine()}")
    r = measure()
    print(json.dumps(r, indent=2))
    print(f"Conversation, {T} tokens, {TURNS} turns: view {r['view_s']:.2f} s + chat of every turn "
          f"{r['chat_all_turns_s']:.2f} s + turn table {r['turn_table_s']:.3f} s = {r['view_and_builders_s']:.2f} s "
          f"(target <= 1 s: {'met' if r['view_and_builders_s'] <= 1 else 'missed'}); one page of 16 turns "
          f"{r['chat_one_page_s']:.2f} s, {r['html_one_page_mb']:.2f} MB of HTML ({r['html_all_turns_mb']:.2f} MB "
          f"for all). Page through AppTest: cold {r['conversation_cold_s']:.2f} s, warm {r['conversation_warm_s']:.2f} s, "
          f"{r['conversation_sent_mb']:.2f} MB sent; Tokens page of the same sequence: cold {r['tokens_cold_s']:.2f} s, "
          f"warm {r['tokens_warm_s']:.2f} s; ratio warm {r['warm_ratio']:.1f}x, cold {r['cold_ratio']:.1f}x")


if __name__ == "__main__":
    main()
