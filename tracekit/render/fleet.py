"""Terminal table of a fleet rollup (`tracekit fleet`). Renders; never analyses."""

from __future__ import annotations

import math

from tracekit.analysis.fleet import FleetRollup

#: The across-runs figures the table shows (JSONL has every one).
TABLE_FIGURES = ("itl_p50", "itl_p99", "itl_p999", "itl_max", "ttft_p50", "tok_per_s")


def _num(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"


def fleet_table(r: FleetRollup) -> str:
    lines = [f"fleet rollup by {r.by}: {len(r.groups)} group(s)"]
    for g in r.groups:
        lines.append("")
        lines.append(f"{r.by} = {g.key}: {len(g.runs)} run(s), {g.gaps:,} gaps")
        lines.append("  across runs, median [min-max]:")
        for name in TABLE_FIGURES:
            if name in g.figures:
                m, lo, hi, n = g.figures[name]
                spread = f"{_num(m)} [{_num(lo)}-{_num(hi)}]" if n else "-"
                lines.append(f"    {name:<10} {spread}  ({n} runs)")
        others = len(g.figures) - sum(1 for n in TABLE_FIGURES if n in g.figures)
        lines.append(f"    (+{others} more figures: --format jsonl)")
        how = "exact" if g.method == "exact" else "from a quantile sketch"
        lines.append(f"  pooled over all {g.gaps:,} gaps ({how}), ms:")
        for name, (v, err) in g.pooled.items():
            note = ""
            if g.method == "sketch" and name != "itl_max":
                pct = 100.0 * err / g.gaps if g.gaps else 0.0
                note = f"  (within {err:,} ranks = {pct:.4f}% of gaps of the exact value)"
            lines.append(f"    {name:<10} {_num(v)}{note}")
        share = sorted(g.tail_share.items(), key=lambda kv: -kv[1])
        lines.append(
            f"  pooled tail ({g.tail_gaps:,} gaps >= {_num(g.tail_threshold_ms)} ms), "
            "share of its time: " + ", ".join(f"{lb} {100 * v:.1f}%" for lb, v in share if v > 0)
        )
        lines.append(
            "  tail gaps by primary cause: "
            + ", ".join(
                f"{c} {n:,}" for c, n in sorted(g.tail_count.items(), key=lambda kv: -kv[1])
            )
        )
    return "\n".join(lines)
