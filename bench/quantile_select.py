"""Sort or select for the writer's per-step quantiles .

``python -m bench.quantile_select``: :func:`tracer.formulas.masked_row_quantiles` sorts every row of a
step's fields once to read 7 order statistics per row. ``np.partition`` with those positions as
``kth`` (the union over the rows, in one call; or each row's own, a call a row) needs no full sort;
this times both side by side on float32 rows of the writer's shapes (rows = fields, N = B x T kept
values), checks that they read the same values, and prints partition / sort.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import machine

QS = np.array([0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0])
SHAPES = ((14, 64), (14, 4096), (14, 65536), (14, 2_000_000), (28, 500_000))


def _best(fn, reps: int, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(machine())
    rng = np.random.default_rng(0)
    for R, N in SHAPES:
        values = rng.standard_normal((R, N)).astype(np.float32)
        keep = rng.random((R, N)) < 0.8
        counts = keep.sum(1)
        pos = QS * np.maximum(counts - 1, 0)[:, None]
        lo, hi = np.floor(pos).astype(np.int64), np.ceil(pos).astype(np.int64)
        kth_all = np.unique(np.concatenate([lo.ravel(), hi.ravel()]))
        kth_rows = [np.unique(np.concatenate([lo[r], hi[r]])) for r in range(R)]
        ordered = np.where(keep, values, np.inf)
        rows = np.arange(R)[:, None]
        sorted_ = np.sort(ordered, axis=1)
        parted = np.partition(ordered, kth_all, axis=1)
        assert (sorted_[rows, lo] == parted[rows, lo]).all() and (sorted_[rows, hi] == parted[rows, hi]).all()
        reps = max(1, int(2e7 // (R * N)))
        t_sort = _best(lambda: np.sort(ordered, axis=1), reps, args.rounds)
        t_all = _best(lambda: np.partition(ordered, kth_all, axis=1), reps, args.rounds)
        t_rows = _best(lambda: [np.partition(ordered[r], kth_rows[r]) for r in range(R)], reps, args.rounds)
        print(f"rows {R:>3} x N {N:>9,}: sort {1e3 * t_sort:9.3f} ms | partition, union kth ({len(kth_all):>3}) "
              f"{1e3 * t_all:9.3f} ms ({t_all / t_sort:.2f}x) | partition per row {1e3 * t_rows:9.3f} ms "
              f"({t_rows / t_sort:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
