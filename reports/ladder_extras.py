"""Per-rung details for the ladder report, from `tracekit analyze --format jsonl` output.

    tracekit analyze raw-ladder/*.npz --format jsonl -o reports/ladder-runs.jsonl
    python reports/ladder_extras.py reports/ladder-runs.jsonl

Prints markdown: per rung, median [min-max] across runs of the counts the fixes act on
(preemptions, eager steps, GC collections and generation-2 pauses while serving, forward
share of clean and tail gaps); each run's tail by cause; and TTFT p50 per run, with the
number of requests that had a first token (TTFT covers only those); and the fix ladder
and the median tail shares side by side with the published tables
(shared/reference/decode-step-stalls.md, 5 runs x 60 s; its figures are copied below as
printed there). Everything here is read from the per-run analyses; it computes nothing
from gaps itself.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import numpy as np

from demo_engine.config import RUNG_NAMES

LABELS = ("preempt", "gc", "tok", "prefill", "graph", "forward", "residual")

#: The published FIX LADDER: (p50, p99, p99.9, max), each (median, min, max), in ms.
PUBLISHED_LADDER = {
    "baseline": ((13.7, 10.5, 16.0), (47.0, 30.9, 62.8), (950, 149, 7395), (9466, 895, 12764)),
    "+gc.freeze": ((14.3, 7.9, 14.7), (49.0, 27.0, 60.7), (581, 112, 953), (3805, 368, 6100)),
    "+compact history": (
        (11.3, 6.0, 14.7), (40.4, 21.6, 49.2), (258, 56, 827), (2268, 451, 5165)
    ),
    "+graphs to 48": ((12.3, 10.6, 14.0), (37.3, 31.9, 50.6), (234, 122, 447), (2971, 1295, 3824)),
    "+budget 256": ((12.6, 9.4, 14.8), (29.5, 25.2, 32.7), (149, 54, 542), (1933, 612, 2646)),
    "+tokenize off-loop": (
        (12.5, 10.8, 15.5), (29.6, 26.3, 39.0), (133, 53, 967), (2698, 889, 4210)
    ),
    "+admit watermark": ((12.0, 10.4, 14.1), (27.8, 24.2, 32.5), (50, 31, 70), (108, 39, 651)),
}  # fmt: skip
#: The published MEDIAN TAIL-TIME SHARE PER RUNG, in LABELS order (%).
PUBLISHED_SHARE = {
    "baseline": (77.1, 2.1, 3.6, 12.4, 0.2, 2.8, 0.2),
    "+gc.freeze": (70.6, 1.6, 5.7, 14.0, 0.1, 5.7, 0.2),
    "+compact history": (59.0, 0.0, 7.4, 23.1, 0.2, 8.3, 0.3),
    "+graphs to 48": (49.0, 0.0, 6.6, 30.5, 0.0, 9.8, 0.5),
    "+budget 256": (56.0, 0.0, 8.9, 12.0, 0.0, 25.7, 0.3),
    "+tokenize off-loop": (63.2, 0.0, 0.0, 8.5, 0.0, 27.4, 0.8),
    "+admit watermark": (0.2, 0.0, 0.0, 34.7, 0.0, 63.2, 1.9),
}


def spread(vals: list[float], fmt: str = "{:.0f}") -> str:
    a = np.asarray(vals, dtype=float)
    return f"{fmt.format(np.median(a))} [{fmt.format(a.min())}-{fmt.format(a.max())}]"


def main(path: str) -> None:
    runs = [json.loads(line) for line in open(path) if line.strip()]
    by_rung: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_rung[r["rung"]].append(r)
    for rs in by_rung.values():
        rs.sort(key=lambda r: r["seed"])
    order = {name: i for i, name in enumerate(RUNG_NAMES)}
    by_rung = dict(sorted(by_rung.items(), key=lambda kv: order.get(kv[0], len(order))))

    print(
        "| rung | runs | requests | preemptions | eager steps | max decode B | gen-0 GCs "
        "| gen-2 pauses serving (n) | gen-2 serving max ms | fwd share clean | fwd share tail "
        "| graph share of all gap time | reconcile max err ms | skipped w/o eviction |"
    )
    print("|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rung, rs in by_rung.items():
        g2 = [len(r["gen2_serving_ms"]) for r in rs]
        g2max = [max(r["gen2_serving_ms"], default=0.0) for r in rs]
        print(
            f"| {rung} | {len(rs)} | {spread([r['requests'] for r in rs])} "
            f"| {spread([r['preemptions'] for r in rs])} "
            f"| {spread([r['eager_steps'] for r in rs])} "
            f"| {spread([r['max_decode_B'] for r in rs])} "
            f"| {spread([r['gc_counts'].get('0', 0) for r in rs])} | {spread(g2)} "
            f"| {spread(g2max)} "
            f"| {spread([100 * r['fwd_share_clean_median'] for r in rs])}% "
            f"| {spread([100 * r['fwd_share_tail_median'] for r in rs])}% "
            f"| {spread([100 * r['all_share'].get('graph', 0.0) for r in rs], '{:.1f}')}% "
            f"| {max(r['reconcile_max_err_ms'] for r in rs):.1e} "
            f"| {sum(r['skipped_steps_without_eviction'] for r in rs)} |"
        )

    print("\n**Each run's tail by cause** (share of tail time; gaps >= that run's p99)\n")
    print(
        "| rung | seed | p99 ms | p99.9 ms | " + " | ".join(LABELS) + " | tail count by primary |"
    )
    print("|:---|---:|---:|---:|" + "---:|" * len(LABELS) + ":---|")
    for rung, rs in by_rung.items():
        for r in rs:
            ts = r["tail_share"]
            tc = ", ".join(
                f"{k} {v}" for k, v in sorted(r["tail_count"].items(), key=lambda kv: -kv[1]) if v
            )
            print(
                f"| {rung} | {r['seed']} | {r['itl_p99']:.1f} | {r['itl_p999']:.0f} | "
                + " | ".join(f"{100 * ts.get(k, 0.0):.1f}%" for k in LABELS)
                + f" | {tc} |"
            )

    print("\n**TTFT p50 per run** (ms; in parentheses, the requests with a first token)\n")
    seeds = sorted({r["seed"] for r in runs})
    print("| rung | " + " | ".join(f"s{s}" for s in seeds) + " |")
    print("|:---|" + "---:|" * len(seeds))
    for rung, rs in by_rung.items():
        got = {
            r["seed"]: f"{r['ttft_p50']:.0f} ({(r.get('ttft') or {}).get('requests', '?')})"
            for r in rs
        }
        print(f"| {rung} | " + " | ".join(got.get(s, "-") for s in seeds) + " |")

    side_by_side(by_rung)


def _pub(t: tuple[float, float, float]) -> str:
    fmt = "{:.1f}" if t[0] < 100 else "{:.0f}"
    return f"{fmt.format(t[0])} [{fmt.format(t[1])}-{fmt.format(t[2])}]"


def side_by_side(by_rung: dict[str, list[dict]]) -> None:
    """Our ladder and tail shares next to the published ones, the same columns."""
    print("\n**The fix ladder, here and published** (ms, median [min-max] across runs)\n")
    cols = (("p50", "itl_p50"), ("p99", "itl_p99"), ("p99.9", "itl_p999"), ("max", "itl_max"))
    print("| rung | " + " | ".join(f"{c} here | {c} published" for c, _ in cols) + " |")
    print("|:---|" + "---:|---:|" * len(cols))
    for rung, rs in by_rung.items():
        pub = PUBLISHED_LADDER.get(rung)
        cells = []
        for i, (_, key) in enumerate(cols):
            vals = [r[key] for r in rs]
            fmt = "{:.1f}" if np.median(vals) < 100 else "{:.0f}"
            cells += [spread(vals, fmt), _pub(pub[i]) if pub else "-"]
        print(f"| {rung} | " + " | ".join(cells) + " |")
    print(
        "\n**Median tail-time share per rung, here / published** (gaps >= each run's p99; "
        "median across runs)\n"
    )
    print("| rung | " + " | ".join(LABELS) + " |")
    print("|:---|" + "---:|" * len(LABELS))
    for rung, rs in by_rung.items():
        pub = PUBLISHED_SHARE.get(rung)
        cells = [
            f"{100 * np.median([r['tail_share'].get(lb, 0.0) for r in rs]):.1f}% / "
            + (f"{pub[i]:.1f}%" if pub else "-")
            for i, lb in enumerate(LABELS)
        ]
        print(f"| {rung} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
