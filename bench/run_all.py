"""Run every CPU benchmark once and print a Markdown table for BENCHMARKS.md.

    python -m bench.run_all            # ~8 minutes on 2 cores; bench/gpu_check.py needs a GPU
"""

from __future__ import annotations

from bench import (blocked_time, loops, memory_budget, open_scale, overhead, overview_index, overview_scale,
                   record_cost, slow_disk_drop, step_page, verify_cost, write_throughput, writer_cost)
from bench.common import machine


def main() -> None:
    print(f"Machine: {machine()}\n")
    rows = []
    o = overhead.measure()
    rows.append(("overhead: GRPO-shaped CPU loop, B=32 T=256, every step traced", f"{o['step_ms_on']:.1f} vs {o['step_ms_off']:.1f} ms/step",
                 f"{o['ratio']:.3f}", "<= 1.03"))
    for T in (256, 1024):
        b = blocked_time.measure(T=T)
        rows.append((f"blocked time: inside record() vs a plain copy of the same bytes, B=32 T={T} "
                     f"({b['bytes'] / 1e6:.1f} MB), steps {b['gap_ms']:.0f} ms apart",
                     f"{b['record_us']:.0f} vs {b['copy_us']:.0f} us", f"{b['ratio']:.2f}x", "<= 2x"))
        rows.append((f"... the same, record() back-to-back (writer busy beside it), T={T}", "",
                     f"{b['tight_ratio']:.2f}x", "(reported)"))
    w = write_throughput.measure()
    rows.append(("write throughput: writer (checksum + fsync) vs save_file", f"{w['ours_mb_s']:.0f} vs {w['save_file_mb_s']:.0f} MB/s",
                 f"{w['ratio']:.2f}x", "(reported)"))
    s = open_scale.measure()
    rows.append(("open + load one sequence: 10,000 vs 10 steps", f"{s['big_ms']:.2f} vs {s['small_ms']:.2f} ms",
                 f"{s['scale_ratio']:.2f}x", "<= 2x"))
    rows.append(("... vs JSON lines (same data, one file)", f"{s['big_ms']:.2f} vs {s['jsonl_ms']:.0f} ms",
                 f"{s['speedup_vs_jsonl']:.0f}x faster", ">= 20x"))
    rows.append(("... file size vs JSON lines", f"{s['trace_mb']:.0f} vs {s['jsonl_mb']:.0f} MB",
                 f"{s['size_ratio']:.1f}x smaller", ">= 3x"))
    m = memory_budget.measure()
    rows.append(("peak memory queued vs budget (slow disk, block policy)", f"{m['peak_mb']:.2f} vs {m['budget_mb']:.2f} MiB",
                 f"{m['peak_mb'] / m['budget_mb']:.2f}", "<= 1"))
    d = slow_disk_drop.measure(30.0)
    rows.append(("record() p99 with a 30 ms fsync, when_full=drop, vs a plain copy",
                 f"{d['record_p99_ms']:.2f} vs {d['copy_p99_ms']:.2f} ms", f"{d['record_p99_ms'] / d['copy_p99_ms']:.1f}x",
                 "p99 a few ms"))
    v = verify_cost.measure()
    rows.append(("checksum verification vs diff, per GB of step files (page cache warm)",
                 f"{v['verify_s_per_gb']:.2f} vs {v['diff_s_per_gb']:.1f} s/GB", f"{v['verify_vs_diff']:.2f}", "<= 0.5"))
    rows.append(("... verification vs reading the same bytes", f"{v['verify_s_per_gb']:.2f} vs {v['read_s_per_gb']:.2f} s/GB",
                 f"{v['verify_vs_read']:.1f}x", "(reported)"))
    p = step_page.measure()
    rows.append(("Step page, 256 x 1024 tokens, warm rerun vs the Tokens page of one sequence",
                 f"{p['step_warm_s']:.2f} vs {p['tokens_warm_s']:.2f} s", f"{p['warm_ratio']:.1f}x", "warm <= 2 s"))
    rows.append(("... first open (reads the whole step)", f"{p['step_cold_s']:.2f} vs {p['tokens_cold_s']:.2f} s",
                 f"{p['cold_ratio']:.1f}x", "(reported)"))
    c = record_cost.measure()
    rows.append(("record() of 14 small fields (B=8 T=16), steps 4 ms apart, vs a plain copy",
                 f"{c['record_us']:.0f} vs {c['copy_us']:.0f} us", f"{c['record_us']:.0f} us", "<= 100 us"))
    for (name, kind), r in loops.measure(writers=("thread", "process")).items():
        rows.append((f"loop {name} ({r['shape']}), writer {kind}, traced / plain, alternating blocks",
                     f"{r['step_ms']:.1f} ms/step plain", f"{r['ratio']:.3f} ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})",
                     f"<= {loops.TARGETS[name]}"))
        if "capture_us" in r:
            rows.append(("... zero-edit capture on the training thread, per backward", f"{r['capture_us']:.0f} us",
                         "", "<= 500 us"))
    v = overview_scale.measure()
    rows.append((f"overview (step_summary) vs reading every header, {v['steps']} steps of {v['B']}x{v['T']}",
                 f"{1e3 * overview_scale.median(v['times']['overview']):.0f} vs "
                 f"{1e3 * overview_scale.median(v['times']['headers']):.0f} ms", f"{v['overview_vs_headers']:.2f}x", "<= 3x"))
    rows.append(("... the same overview from tensors (traces without summaries)",
                 f"{1e3 * overview_scale.median(v['times']['tensors']):.0f} ms", f"{v['tensors_vs_headers']:.1f}x", "(reported)"))
    rows.append((f"overview of {v['big']} vs 10 steps, per step file", f"{v['large_ms']:.0f} vs {v['small_ms']:.1f} ms",
                 f"{v['per_file_ratio']:.2f}x", "<= 2x"))
    x = overview_index.measure(rounds=3)
    t = x["times"]
    for what, label in (("summary", "step_summary()"), ("page", "Steps page, cold, server side")):
        large, small = overview_index.median(t[(what, x["big"], True)]), overview_index.median(t[(what, 10, True)])
        rows.append((f"{label} with the summary index, {x['big']} vs 10 steps", f"{1e3 * large:.0f} vs {1e3 * small:.0f} ms",
                     f"{large / small:.1f}x", "<= 2x" if what == "page" else "(reported)"))
    wc = writer_cost.measure(steps=200, rounds=3)
    for label, us in wc["median_us"]["this"].items():
        rows.append((f"writer thread CPU per step file, {label}", f"{us:.0f} us", "", "(reported)"))
    print("| benchmark | measured | ratio | target |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
