"""Per-rung details for the ladder report, from `tracekit analyze --format jsonl` output.

    tracekit analyze raw-ladder/*.npz --format jsonl -o reports/ladder-runs.jsonl
    python reports/ladder_extras.py reports/ladder-runs.jsonl

Prints markdown: per rung, median [min-max] across runs of the counts the fixes act on
(preemptions, eager steps, GC collections and generation-2 pauses while serving, forward
share of clean and tail gaps); each run's tail by cause; and TTFT p50 per run, with the
number of requests that had a first token (TTFT covers only those). Everything here is
read from the per-run analyses; it computes nothing from gaps itself.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import numpy as np

from demo_engine.config import RUNG_NAMES

LABELS = ("preempt", "gc", "tok", "prefill", "graph", "forward", "residual")


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
        "| reconcile max err ms | skipped w/o eviction |"
    )
    print("|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
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


if __name__ == "__main__":
    main(sys.argv[1])
