"""What-if speed: every removal of a ~112 k-gap run, both models, on one core.

    python bench/bench_whatif.py            # prints times and ratios, asserts nothing

Goal (issue 23): the what-if for every cause of a 112 k-gap run in under a second on one
core. The ratio is against the run's own ITL partition, timed in the same process and
interleaved with it (A/B pairs), so it holds on any machine; the absolute time is this
machine's. The slow references are timed on a small log for the speed-up.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from synthetic import synthetic_log  # noqa: E402

from tracekit.analysis import whatif as W  # noqa: E402
from tracekit.attribution.itl import partition  # noqa: E402
from tracekit.attribution.ttft import ttft_partition  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def with_ttfts(log):
    """`log` with every request's first token (its first emission) and an arrival up to
    0.5 s before it, so the TTFT side of the what-if has work too."""
    from dataclasses import replace

    import numpy as np

    em = log.emissions
    first = np.full(len(log.requests), np.inf)
    np.minimum.at(first, em.request, em.t_s)
    first[~np.isfinite(first)] = np.nan
    arrival = np.maximum(0.0, first - np.random.default_rng(0).uniform(0, 0.5, len(first)))
    return replace(log, requests=replace(log.requests, arrival_s=arrival, first_token_s=first))


def main() -> None:
    log = with_ttfts(synthetic_log(num_steps=3_500, batch=32))
    part, tpart = partition(log), ttft_partition(log)
    rs = W.removals(part, tpart)
    print(f"run: {len(part):,} gaps, {len(tpart):,} TTFTs, {len(log.steps):,} steps, "
          f"{len(rs)} removals ({', '.join(r.name for r in rs)})")  # fmt: skip
    whatif_s, part_s = [], []
    for _ in range(5):  # interleaved A/B pairs
        part_s.append(timed(lambda: partition(log)))
        whatif_s.append(timed(lambda: W.whatif(log, part, tpart)))
    ratios = sorted(w / p for w, p in zip(whatif_s, part_s, strict=True))
    ws = sorted(whatif_s)
    print(f"whatif, every removal x both models: {ws[2]:.3f} s median [{ws[0]:.3f}-{ws[-1]:.3f}] "
          f"(5 runs; goal < 1 s): {ratios[2]:.2f}x the ITL partition "
          f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]")  # fmt: skip
    per = {}
    for model, fn in (("first", W.first_order), ("second", None)):
        t = time.perf_counter()
        for r in rs:
            if fn is None:
                W.second_order(log, part, tpart, r)
            else:
                fn(part, tpart, r)
        per[model] = (time.perf_counter() - t) / len(rs)
    print(f"per removal: first order {1e3 * per['first']:.1f} ms, second order "
          f"{1e3 * per['second']:.1f} ms")  # fmt: skip

    # what the what-if adds to `compare` / `report`: their worker partitions once and
    # analyses and what-ifs from that partition
    from tracekit.analysis.figures import analyze

    def with_whatif():
        p_, t_ = partition(log), ttft_partition(log)
        analyze(log, p_, t_)
        W.whatif(log, p_, t_)

    plain, both = [], []
    for _ in range(3):  # interleaved A/B pairs
        plain.append(timed(lambda: analyze(log)))
        both.append(timed(with_whatif))
    ra = sorted(b / a for a, b in zip(plain, both, strict=True))
    print(f"compare's per-run work with the what-if: {ra[1]:.2f}x without it "
          f"[{ra[0]:.2f}-{ra[-1]:.2f}] (3 interleaved pairs)")  # fmt: skip

    small = synthetic_log(num_steps=60, batch=32, seed=1)
    sp, st = partition(small), ttft_partition(small)
    r = W.find_removal(sp, st, "host")
    t_ref = timed(lambda: W.first_order_reference(sp, st, r))
    t_fast = min(timed(lambda: W.first_order(sp, st, r)) for _ in range(5))
    w = W.removable_windows(small, sp, r.itl_labels)
    xs = list(sp.t1_s)
    t_rref = timed(lambda: W.replay_removed_reference(w, True, xs))
    t_rfast = min(timed(lambda: W.replay_removed(w, True)) for _ in range(5))
    tiny = synthetic_log(num_steps=12, batch=8, seed=2)
    tp_, tt_ = partition(tiny), ttft_partition(tiny)
    rp = W.find_removal(tp_, tt_, "memory")
    t_sref = timed(lambda: W.second_order_reference(tiny, tp_, tt_, rp))
    t_sfast = min(timed(lambda: W.second_order(tiny, tp_, tt_, rp)) for _ in range(5))
    print(f"references on {len(sp):,} gaps: first order {t_ref / t_fast:,.0f}x slower, "
          f"replayed timeline {t_rref / t_rfast:,.0f}x slower than the vectorised ones; "
          f"the whole second order on {len(tp_)} gaps {t_sref / t_sfast:,.0f}x slower")  # fmt: skip


if __name__ == "__main__":
    main()
