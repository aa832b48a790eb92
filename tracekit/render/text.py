"""Terminal tables: consume analysis results, return strings (the CLI prints them)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..analysis import RunAnalysis
from ..compare import FIGURES, Comparison, Spread
from ..labels import STANDARD_LABELS, glyphs


def _fmt(x: float, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}"


def table(rows: Sequence[Sequence[str]], header: Sequence[str], align: str | None = None) -> str:
    """A plain aligned table; `align` is one char per column, 'l' or 'r' (default: l then r)."""
    cols = len(header)
    align = align or ("l" + "r" * (cols - 1))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(cols)]

    def line(r: Sequence[str]) -> str:
        cells = [
            str(c).ljust(w) if a == "l" else str(c).rjust(w)
            for c, w, a in zip(r, widths, align, strict=True)
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def run_name(a: RunAnalysis) -> str:
    import os

    return os.path.basename(a.path)


def summary(runs: Sequence[RunAnalysis]) -> str:
    header = ["run", "rung", "seed", "gaps", "tok/s", "p50", "p90", "p99", "p99.9", "max",
              "ttft p50", "preempt", "err ms"]  # fmt: skip
    rows = [
        [
            run_name(a),
            a.rung or "-",
            str(a.seed if a.seed is not None else "-"),
            str(a.gaps),
            _fmt(a.tok_per_s, 0),
            _fmt(a.itl_p50),
            _fmt(a.itl_p90),
            _fmt(a.itl_p99),
            _fmt(a.itl_p999),
            _fmt(a.itl_max),
            _fmt(a.ttft_p50, 0),
            str(a.preemptions),
            f"{a.reconcile_max_err_ms:.1e}",
        ]
        for a in runs
    ]
    return "ITL and TTFT in ms\n" + table(rows, header, "lll" + "r" * 10)


def shares(runs: Sequence[RunAnalysis], which: str = "tail_share") -> str:
    labels = list(STANDARD_LABELS)
    for a in runs:
        labels += [lb for lb in a.labels if lb not in labels]
    header = ["run", "p99", *labels]
    rows = [
        [run_name(a), _fmt(a.itl_p99)]
        + [f"{100 * getattr(a, which).get(lb, 0.0):.1f}%" for lb in labels]
        for a in runs
    ]
    title = {
        "tail_share": "Where tail time went (gaps >= the run's p99; each row sums to 100%)",
        "all_share": "Where all gap time went (each row sums to 100%)",
    }[which]
    return title + "\n" + table(rows, header)


def histogram(a: RunAnalysis, width: int = 36) -> str:
    """design.md's bins, each bin's gaps split by primary cause as a bar of glyphs."""
    causes = [c for c in a.hist[0].by_primary if c != "clean"] if a.hist else []
    g = glyphs(["clean", *causes])
    lines = [f"ITL histogram by primary cause, {run_name(a)} (p99 = {_fmt(a.itl_p99)} ms)"]
    lines.append(f"{'ITL ms':>9}  {'gaps':>7}  share of the bin's gaps by primary cause")
    for b in a.hist:
        hi = "inf" if not math.isfinite(b.hi_ms) else f"{b.hi_ms:g}"
        label = f"{b.lo_ms:g}-{hi}"
        bar = ""
        if b.count:
            order = ["clean", *causes]
            cells = [(c, b.by_primary.get(c, 0) * width / b.count) for c in order]
            # largest-remainder rounding so the bar is always `width` wide
            base = [(c, int(x), x - int(x)) for c, x in cells]
            short = width - sum(n for _, n, _ in base)
            extra = {c for c, _, _ in sorted(base, key=lambda t: -t[2])[:short]}
            bar = "".join(g[c] * (n + (c in extra)) for c, n, _ in base)
        lines.append(f"{label:>9}  {b.count:>7}  {bar}")
    legend = ", ".join(f"{g[c]} {c}" for c in ["clean", *causes])
    lines.append(f"  ({legend})")
    return "\n".join(lines)


def tail_counts(a: RunAnalysis) -> str:
    items = sorted(a.tail_count.items(), key=lambda kv: -kv[1])
    return "Tail gaps by primary cause (count): " + ", ".join(f"{k} {v}" for k, v in items)


def run_details(a: RunAnalysis) -> str:
    g2s = ", ".join(f"{x:g}" for x in a.gen2_serving_ms) or "none"
    return "\n".join(
        [
            tail_counts(a),
            f"forward share of a gap (median): clean {_pct(a.fwd_share_clean_median)}, "
            f"tail {_pct(a.fwd_share_tail_median)}",
            f"steps {a.steps}, eager {a.eager_steps}, max decode batch {a.max_decode_B}, "
            f"preemptions {a.preemptions}, skipped steps without eviction "
            f"{a.skipped_steps_without_eviction}",
            f"GC collections by generation {a.gc_counts}; gen-2 pauses while serving (ms): {g2s}",
        ]
        + (
            [
                f"device windows {a.device_windows}; device clock drift "
                f"{_fmt(a.device_clock_drift_ppm, 2)} ppm, worst placement error "
                f"{_fmt(a.device_max_placement_err_ms, 4)} ms"
            ]
            if a.device_windows
            else []
        )
    )


def _pct(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.0f}%"


def analyze_report(runs: Sequence[RunAnalysis]) -> str:
    parts = [summary(runs), "", shares(runs, "tail_share")]
    if len(runs) == 1:
        parts += ["", histogram(runs[0]), "", run_details(runs[0])]
    return "\n".join(parts)


# -- cross-run comparison (tracekit compare) ---------------------------------------------

#: Column headers of the comparison table, by `tracekit.compare.FIGURES` name.
FIGURE_HEADERS = {
    "itl_p50": "p50",
    "itl_p99": "p99",
    "itl_p999": "p99.9",
    "itl_max": "max",
    "ttft_p50": "ttft p50",
    "tok_per_s": "tok/s",
}


def _num(x: float, nd: int) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def spread_cell(s: Spread, nd: int = 1) -> str:
    """`13.7 [10.5-16.0]`: median [min-max] across runs, as in the published fix ladder."""
    if s.num_runs == 0:
        return "-"
    return f"{_num(s.median, nd)} [{_num(s.lo, nd)}-{_num(s.hi, nd)}]"


def column_decimals(spreads: Sequence[Spread]) -> int:
    """One decimal, unless the column's medians reach 100 (then whole numbers), so a
    column reads `47.0 [30.9-62.8]` or `950 [149-7395]` throughout."""
    meds = [s.median for s in spreads if s.num_runs and math.isfinite(s.median)]
    return 0 if meds and max(abs(m) for m in meds) >= 100 else 1


def _comparison_cells(
    cmp: Comparison,
) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    names = [name for name, _ in FIGURES]
    nds = {n: column_decimals([g.figures[n] for g in cmp.groups]) for n in names}
    head = [cmp.by, "runs", *(FIGURE_HEADERS.get(n, n) for n in names)]
    rows = [
        [g.key, str(g.num_runs), *(spread_cell(g.figures[n], nds[n]) for n in names)]
        for g in cmp.groups
    ]
    share_head = [cmp.by, *cmp.labels]
    share_rows = [
        [g.key, *(f"{100 * g.tail_share.get(lb, 0.0):.1f}%" for lb in cmp.labels)]
        for g in cmp.groups
    ]
    return head, rows, share_head, share_rows


def _comparison_titles(cmp: Comparison) -> tuple[str, str]:
    n_runs = sum(g.num_runs for g in cmp.groups)
    name = "FIX LADDER" if cmp.by == "rung" else f"BY {cmp.by.upper()}"
    per = cmp.by.upper()
    return (
        f"{name}  ({n_runs} runs in {len(cmp.groups)} groups; median [min-max] across runs; "
        "ITL and TTFT in ms)",
        f"MEDIAN TAIL-TIME SHARE PER {per}  (gaps >= each run's p99; median across runs, "
        "so a row need not sum to 100%)",
    )


def comparison(cmp: Comparison) -> str:
    """The fix-ladder table and the median tail-share table, for a terminal."""
    head, rows, share_head, share_rows = _comparison_cells(cmp)
    t1, t2 = _comparison_titles(cmp)
    return "\n".join(
        [
            t1,
            table(rows, head, "l" + "r" * (len(head) - 1)),
            "",
            t2,
            table(share_rows, share_head, "l" + "r" * (len(share_head) - 1)),
        ]
    )


def _md_cell(s: str) -> str:
    return s.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[Sequence[str]], header: Sequence[str], align: str) -> str:
    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(_md_cell(str(c)) for c in r) + " |"

    rule = "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


def comparison_markdown(cmp: Comparison) -> str:
    """The same two tables as GitHub-flavoured markdown."""
    head, rows, share_head, share_rows = _comparison_cells(cmp)
    t1, t2 = _comparison_titles(cmp)
    return "\n".join(
        [
            f"**{_md_cell(t1)}**",
            "",
            markdown_table(rows, head, "l" + "r" * (len(head) - 1)),
            "",
            f"**{_md_cell(t2)}**",
            "",
            markdown_table(share_rows, share_head, "l" + "r" * (len(share_head) - 1)),
        ]
    )


def gaps_table(records: Sequence[dict], top: int = 20) -> str:
    """`tracekit gaps --format table`: the `top` longest of `records` (0: all), longest
    first, each with its largest parts; a last line says how many are not shown."""
    order = sorted(range(len(records)), key=lambda i: (-records[i]["gap_ms"], i))
    shown = order if top <= 0 else order[:top]
    rows = []
    for i in shown:
        r = records[i]
        parts = sorted(((v, lb) for lb, v in r["parts"].items() if v > 0), reverse=True)
        rows.append(
            [
                _fmt(r["gap_ms"]),
                str(r["request"]),
                f"{r['t0']:.3f}",
                r["primary"],
                ", ".join(f"{lb} {v:.1f}" for v, lb in parts[:4]),
            ]
        )
    out = table(rows, ["gap ms", "request", "t0 s", "primary", "parts ms (largest first)"],
                "rllll")  # fmt: skip
    if len(shown) < len(records):
        out += (
            f"\n({len(records) - len(shown)} shorter gaps not shown: --top 0 shows all, "
            "--format jsonl or csv writes every field)"
        )
    return out
