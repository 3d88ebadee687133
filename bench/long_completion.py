"""The Tokens page of one very long completion, in a real browser: a fresh server per side, the time from
``page.goto`` to the sequence shown and the app idle, this checkout's app and an earlier commit's side by
side in one run (the order alternating), with the server's script time.

    python -m bench.long_completion [--T 32768] [--rounds 2] [--before 3e868c9 | --before none]

The trace: one GRPO step of one row of ``T`` completion tokens (every 50th masked, the last 5% padding),
written once under /tmp by the project's writer. Headless Chromium through Playwright, as
:mod:`bench.viewer_browser` (``--headless --no-sandbox --disable-gpu --disable-background-networking``).
About 1-2 minutes on 2 cores at T = 32,768. No target: it shows what a completion of tens of thousands of
tokens costs a user (the Tokens page colours 2,000 tokens at a time and sends the chart's values as
float32, :data:`app.components.coloured_text.MAX_COLOURED_TOKENS`, :data:`app.components.figures.MAX_HOVER_TOKENS`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import viewer_traces
from bench.common import machine, median
from bench.viewer_browser import CHROMIUM, CHROMIUM_ARGS, REPO, Server, extract_app, step_label, wait_shown


def long_trace(T: int) -> Path:
    """One step of one row of ``T`` tokens, written once (cached under the viewer traces' cache)."""
    import torch

    import tracer

    out = viewer_traces.CACHE / f"long_{T}"
    if (out / "manifest.json").is_file():
        return out
    kept = int(T * 0.95)
    ids = torch.arange(T) % 50 + 2
    ids[kept:] = 0
    mask = (torch.arange(T) < kept) & (torch.arange(T) % 50 != 49)
    policy = -(torch.arange(T, dtype=torch.float32) % 7) / 10 - 0.05
    with tracer.Tracer(out, algorithm="grpo", vocabulary=["<pad>", "<eos>", *[f"t{i}" for i in range(50)]],
                       guard="off", hyperparameters={"num_generations": 1}) as tr:
        tr.record(0, {"completion_ids": ids[None], "completion_mask": mask[None], "policy_logprobs": policy[None],
                      "old_logprobs": policy[None] - 0.01, "ref_logprobs": policy[None] + 0.02,
                      "rewards": torch.tensor([1.0]), "advantages": torch.tensor([0.0])})
    return out


def first_view(browser, repo: Path, trace: Path, log: Path) -> tuple[float, float]:
    """Seconds from goto to the Tokens page of step 0, sequence 0 shown and idle, and the server's script
    seconds, on a fresh server of the app under ``repo``."""
    with Server(repo, trace, log) as server:
        context = browser.new_context(viewport={"width": 1600, "height": 1200})
        page = context.new_page()
        t0 = time.time()
        page.goto(f"{server.url}/tokens?run=.&step=0&seq=0")
        wall, script, _ = wait_shown(page, server, t0, f"{step_label(0)} · sequence 0")
        context.close()
    return wall, script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=32768, help="completion tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", default="3e868c9", help="git ref of the app to compare with; 'none' to skip")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    trace = long_trace(args.T)
    sides = {"now": REPO}
    if args.before != "none":
        sides[f"before ({args.before})"] = extract_app(args.before)
    times: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    logs = viewer_traces.CACHE / "long_logs"
    logs.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for side in order:
                    times[side].append(first_view(browser, sides[side], trace, logs / f"{len(times[side])}.jsonl"))
        finally:
            browser.close()
    print(f"Machine: {machine()}")
    print(f"Tokens page, one completion of {args.T:,} tokens, fresh server each (median of {args.rounds}):")
    for side, got in times.items():
        print(f"  {side:24s} shown in {median([w for w, _ in got]):6.1f} s (server script {median([s for _, s in got]):.1f} s)")


if __name__ == "__main__":
    main()
