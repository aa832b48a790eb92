"""Terminal tables: consume analysis results, return strings (the CLI prints them)."""

from __future__ import annotations

import html
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tracekit.analysis.compare import FIGURES, Comparison, Spread
from tracekit.analysis.figures import RunAnalysis
from tracekit.analysis.ranks import RankView
from tracekit.attribution.ttft import TtftFigures
from tracekit.errors import one_line
from tracekit.formats import num
from tracekit.labels import STANDARD_LABELS, glyphs
from tracekit.render.client import client_text, spec_text


def table(rows: Sequence[Sequence[str]], header: Sequence[str], align: str | None = None) -> str:
    """A plain aligned table; `align` is one char per column, 'l' or 'r' (default: l then r)."""
    cols = len(header)
    align = align or ("l" + "r" * (cols - 1))
    # strings from a log (run names, config values, labels) are shown, never obeyed: a
    # terminal escape (an OSC title, a colour, a cursor move) or a newline is escaped
    header = [one_line(str(c)) for c in header]
    rows = [[one_line(str(c)) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(cols)]

    def line(r: Sequence[str]) -> str:
        cells = [
            str(c).ljust(w) if a == "l" else str(c).rjust(w)
            for c, w, a in zip(r, widths, align, strict=True)
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def run_name(a: RunAnalysis) -> str:
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
            num(a.tok_per_s, 0),
            num(a.itl_p50),
            num(a.itl_p90),
            num(a.itl_p99),
            num(a.itl_p999),
            num(a.itl_max),
            num(a.ttft_p50, 0),
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
        [run_name(a), num(a.itl_p99)]
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
    lines = [f"ITL histogram by primary cause, {one_line(run_name(a))} (p99 = {num(a.itl_p99)} ms)"]
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
    legend = ", ".join(f"{g[c]} {one_line(c)}" for c in ["clean", *causes])
    lines.append(f"  ({legend})")
    return "\n".join(lines)


def tail_counts(a: RunAnalysis) -> str:
    items = sorted(a.tail_count.items(), key=lambda kv: -kv[1])
    return "Tail gaps by primary cause (count): " + ", ".join(
        f"{one_line(k)} {v}" for k, v in items
    )


def evictions_lines(a: RunAnalysis) -> list[str]:
    """Who evicted whom (docs/partition.md): by reason, the recompute tax, top evictors and
    thrash; nothing for a run without evictions."""
    e = a.evictions
    if e is None:
        return []
    reasons = ", ".join(f"{one_line(k)} {v}" for k, v in e.by_reason.items())
    top = ", ".join(
        f"{one_line(r)} ({n} victim{'s' * (n != 1)}, {num(ms, 1)} ms)"
        for r, n, ms in e.top_evictors[:3]
    )
    thrash = ", ".join(f"{one_line(r)} x{n}" for r, n in e.thrash[:3])
    return [
        f"evictions {e.num_evictions} ({e.num_with_cause} with a recorded cause; by reason: "
        f"{reasons}); recompute tax {num(100 * e.recompute_tax, 1)}% ({e.recomputed_tokens} of "
        f"{e.computed_tokens} computed tokens, {num(e.recompute_ms, 1)} ms in recompute)",
        f"top evictors (their victims' debt): {top or 'none recorded'}; evicted more than "
        f"once: {e.num_thrashed} request(s){': ' + thrash if thrash else ''}",
    ]


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
        + evictions_lines(a)
        + (
            [
                f"device windows {a.device_windows}; device clock drift "
                f"{num(a.device_clock_drift_ppm, 2)} ppm, worst placement error "
                f"{num(a.device_max_placement_err_ms, 4)} ms"
            ]
            if a.device_windows
            else []
        )
    )


def _pct(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.0f}%"


def window_text(
    w: Mapping[str, Any], per_run: str = "requests, steps, GC, preemptions: the whole run"
) -> str:
    """A `RunAnalysis.window` (or a `WhatIf.window`) in words: which part of the run the
    per-gap figures are of, and (`per_run`) which figures stay the whole run's."""
    lo = "" if w["from_s"] is None else f"{w['from_s']:.6g}"
    hi = "" if w["to_s"] is None else f"{w['to_s']:.6g}"
    return (
        f"window {lo}..{hi} s from engine start ({w['how']}): gaps ending in it, TTFTs whose "
        f"first token lands in it; {per_run}"
    )


def analyze_report(runs: Sequence[RunAnalysis]) -> str:
    parts = [f"{run_name(a)}: {window_text(a.window)}" for a in runs if a.window]
    parts += [summary(runs), "", shares(runs, "tail_share")]
    if len(runs) == 1:
        parts += ["", histogram(runs[0]), "", run_details(runs[0])]

    parts += [f"\n{run_name(a)}: {spec_text(a)}" for a in runs if a.spec and not a.client]
    parts += [f"\n{run_name(a)}: {client_text(a.client)}" for a in runs if a.client]
    parts += [f"\n{run_name(a)}: {tp_ranks_text(a.tp_ranks)}" for a in runs if a.tp_ranks]
    return "\n".join(parts)


def tp_ranks_text(v: RankView) -> str:
    """Tensor parallel: per rank, the slow steps it held (`tracekit.analysis.ranks`)."""
    lines = [
        f"tensor parallel: {len(v.slow_steps)} slow steps (closing gaps >= p99 "
        f"{num(v.itl_p99_ms, 2)} ms); which rank held them:",
        f"{'rank':<8}{'held':>6}{'slow ms':>10}{'run ms':>10}  top cause in slow steps",
    ]
    for r in v.ranks:
        top = "-"
        if r.top_cause:
            top = f"rank{r.rank}:{r.top_cause} {num(r.top_cause_ms, 2)} ms"
        lines.append(
            f"{r.rank:<8}{r.slow_steps_held:>6}{num(r.charged_slow_ms, 2):>10}"
            f"{num(r.charged_run_ms, 2):>10}  {top}"
        )
    return "\n".join(lines)


# -- cross-run comparison (tracekit compare) ---------------------------------------------

#: Column headers of the comparison table, by `tracekit.analysis.compare.FIGURES` name.
FIGURE_HEADERS = {
    "itl_p50": "p50",
    "itl_p99": "p99",
    "itl_p999": "p99.9",
    "itl_max": "max",
    "ttft_p50": "ttft p50",
    "tok_per_s": "tok/s",
}


def spread_cell(s: Spread, nd: int = 1) -> str:
    """`13.7 [10.5-16.0]`: median [min-max] across runs, as in the published fix ladder."""
    if s.num_runs == 0:
        return "-"
    return f"{num(s.median, nd)} [{num(s.lo, nd)}-{num(s.hi, nd)}]"


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


def _comparison_titles(cmp: Comparison, by: str | None = None) -> tuple[str, str]:
    """The two tables' titles; `by`: the grouping key as it should be printed."""
    n_runs = sum(g.num_runs for g in cmp.groups)
    by = one_line(cmp.by).upper() if by is None else by
    name = "FIX LADDER" if cmp.by == "rung" else f"BY {by}"
    return (
        f"{name}  ({n_runs} runs in {len(cmp.groups)} groups; median [min-max] across runs; "
        "ITL and TTFT in ms)",
        f"MEDIAN TAIL-TIME SHARE PER {by}  (gaps >= each run's p99; median across runs, "
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
    """A table cell of tracekit's own text: only what would break the table is escaped."""
    return one_line(s).replace("\\", "\\\\").replace("|", "\\|")


#: Characters markdown (or the HTML a markdown renderer passes through) would interpret.
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+!|~])")


def md_text(s: str) -> str:
    """A string from a log (a config value, a label) as literal markdown text: control
    characters escaped, HTML's ``< > &`` as entities, markdown's specials backslashed,
    so that ``<script>``, ``[x](javascript:...)`` or ``**`` show as written."""
    return _MD_SPECIAL.sub(r"\\\1", html.escape(one_line(s), quote=False))


def markdown_table(rows: Sequence[Sequence[str]], header: Sequence[str], align: str) -> str:
    """A markdown table of cells already escaped (`_md_cell` or `md_text`)."""

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(r) + " |"

    rule = "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


def comparison_markdown(cmp: Comparison) -> str:
    """The same two tables as GitHub-flavoured markdown. Group keys, the grouping key and
    labels come from the logs: they are escaped as literal text (`md_text`)."""
    head, rows, share_head, share_rows = _comparison_cells(cmp)
    t1, t2 = _comparison_titles(cmp, md_text(cmp.by.upper()))

    def cells(rs: Sequence[Sequence[str]]) -> list[list[str]]:  # a log's key, then figures
        return [[md_text(r[0]), *map(_md_cell, r[1:])] for r in rs]

    return "\n".join(
        [
            f"**{t1}**",
            "",
            markdown_table(cells(rows), cells([head])[0], "l" + "r" * (len(head) - 1)),
            "",
            f"**{t2}**",
            "",
            markdown_table(
                cells(share_rows),
                [md_text(c) for c in share_head],
                "l" + "r" * (len(share_head) - 1),
            ),
        ]
    )


# -- TTFT (tracekit ttft, and the TTFT block of analyze and compare) ----------------------

#: TTFT columns shown in terminal tables: phases, then the causes that move with the rungs.
TTFT_TABLE_LABELS = (
    "wait_kv_blocks", "wait_max_num_seqs", "wait_token_budget", "wait_preempted_first",
    "wait_tokenizing", "wait_other", "prefill_other", "decode_other", "preempt", "gc", "tok",
    "prefill_own", "residual",
)  # fmt: skip


def _ttft_share_cells(share: Mapping[str, float], labels: Sequence[str]) -> list[str]:
    return [f"{100 * share.get(lb, 0.0):.1f}%" for lb in labels]


def ttft_runs(runs: Sequence[RunAnalysis]) -> str:
    """Per run: TTFT p50/p90/p99/max, phase shares, and the tail share by label."""
    phases = ("queued", "prefilling", "evicted", "unsplit")
    rows, share_rows = [], []
    labels = [
        lb for lb in TTFT_TABLE_LABELS if any(a.ttft and a.ttft.all_share.get(lb) for a in runs)
    ]
    for a in runs:
        t = a.ttft
        if not t:
            continue
        name = run_name(a)
        pct = [num(x, 0) for x in (t.p50_ms, t.p90_ms, t.p99_ms, t.max_ms)]
        phase_cells = _ttft_share_cells(t.phase_share, phases)
        err = f"{t.reconcile_max_err_ms:.1e}"
        rows.append([name, str(t.requests), *pct, *phase_cells, err])
        share_rows.append([name, *_ttft_share_cells(t.tail_share, labels)])
    if not rows:
        return "TTFT: no request with an arrival and a first token"
    head = ["run", "reqs", "p50", "p90", "p99", "max", *phases, "err ms"]
    notes = [f"{run_name(a)}: {one_line(n)}" for a in runs if a.ttft for n in a.ttft.notes]
    return "\n".join(
        [
            "TTFT  (ms; phase share of all TTFT time)",
            table(rows, head, "l" + "r" * (len(head) - 1)),
            *(f"note: {n}" for n in notes),
            "",
            "TTFT TAIL SHARE BY CAUSE  (requests >= each run's TTFT p90)",
            table(share_rows, ["run", *labels], "l" + "r" * len(labels)),
        ]
    )


def ttft_comparison(cmp: Comparison, *, markdown: bool = False) -> str:
    """Per group: TTFT p50/p90/p99 (median [min-max]), the median queued share, and the
    median TTFT tail share by cause: what each rung did to TTFT's causes."""
    groups = [(g, t) for g in cmp.groups if (t := g.ttft) is not None]
    if not groups:
        return ""
    labels = [lb for lb in TTFT_TABLE_LABELS if any(t.tail_share.get(lb) for _, t in groups)]
    head = [cmp.by, "ttft p50", "ttft p90", "ttft p99", "queued", *labels]
    rows = [
        [
            g.key,
            spread_cell(g.figures["ttft_p50"], 0),
            spread_cell(t.p90_ms, 0),
            spread_cell(t.p99_ms, 0),
            f"{100 * t.phase_share.get('queued', 0.0):.1f}%",
            *_ttft_share_cells(t.tail_share, labels),
        ]
        for g, t in groups
    ]
    what = (
        "(ms, median [min-max] across runs; queued: median share of TTFT time; then the "
        "median share of tail TTFT time (requests >= each run's p90) by cause)"
    )
    align = "l" + "r" * (len(head) - 1)
    if markdown:  # group keys and the grouping key come from the logs: literal text
        md_rows = [[md_text(r[0]), *map(_md_cell, r[1:])] for r in rows]
        md_head = [md_text(head[0]), *map(_md_cell, head[1:])]
        title = f"TTFT PER {md_text(cmp.by.upper())}  {_md_cell(what)}"
        return "\n".join([f"**{title}**", "", markdown_table(md_rows, md_head, align)])
    return "\n".join([f"TTFT PER {one_line(cmp.by).upper()}  {what}", table(rows, head, align)])


def ttft_requests(
    name: str, figures: TtftFigures, records: Sequence[Mapping[str, Any]], top: int
) -> str:
    """`tracekit ttft RUN`: the run's TTFT figures, then the slowest requests' partitions."""
    f = figures
    out = [
        f"{name}: {f.requests} requests with a first token; TTFT p50 {num(f.p50_ms)} "
        f"p90 {num(f.p90_ms)} p99 {num(f.p99_ms)} max {num(f.max_ms)} ms; "
        f"reconcile max err {f.reconcile_max_err_ms:.2e} ms",
        "phases (share of all TTFT time): "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in f.phase_share.items() if v),
        "tail (>= p90) by primary cause: "
        + (", ".join(f"{k} {v}" for k, v in f.tail_count.items()) or "-"),
    ]
    slow = sorted(records, key=lambda r: -r["ttft_ms"])[:top]
    if slow:
        rows = []
        for r in slow:
            parts = sorted(((v, k) for k, v in r["parts"].items() if v > 0.05), reverse=True)
            rows.append(
                [
                    str(r["request"]),
                    num(r["ttft_ms"]),
                    *(num(r["phases"][ph]) for ph in ("queued", "prefilling", "evicted")),
                    str(r["primary"]),
                    ", ".join(f"{k} {v:.1f}" for v, k in parts[:5]),
                ]
            )
        head = ["request", "ttft ms", "queued", "prefilling", "evicted", "primary", "parts (ms)"]
        out += ["", f"SLOWEST {len(slow)} (ms)", table(rows, head, "lrrrrll")]
    return "\n".join(out)


def gaps_table(records: Sequence[dict], top: int = 20) -> str:
    """`tracekit gaps --format table`: the `top` longest of `records` (0: all), longest
    first, each with its largest parts; a last line says how many are not shown."""
    order = sorted(range(len(records)), key=lambda i: (-records[i]["gap_ms"], i))
    shown = order if top <= 0 else order[:top]
    return longest_gaps_table([records[i] for i in shown], len(records))


def longest_gaps_table(shown: Sequence[dict], total: int) -> str:
    """`gaps_table` of the records it shows (longest first, chosen already) out of `total`
    selected gaps (a long run's listing keeps only those: `tracekit.analysis.stream_listing`)."""
    rows = []
    for r in shown:
        parts = sorted(((v, lb) for lb, v in r["parts"].items() if v > 0), reverse=True)
        rows.append(
            [
                num(r["gap_ms"]),
                str(r["request"]),
                f"{r['t0_s']:.3f}",
                r["primary"],
                ", ".join(f"{lb} {v:.1f}" for v, lb in parts[:4]),
            ]
        )
    out = table(rows, ["gap ms", "request", "t0 s", "primary", "parts ms (largest first)"],
                "rllll")  # fmt: skip
    if len(shown) < total:
        out += (
            f"\n({total - len(shown)} shorter gaps not shown: --top 0 shows all, "
            "--format jsonl or csv writes every field)"
        )
    return out


def client_ttft_requests(
    name: str, figures: Mapping[str, Any], records: Sequence[Mapping[str, Any]], top: int
) -> str:
    """`tracekit ttft RUN --boundary client`: the run's client-boundary TTFT figures beside
    the engine boundary's (same requests), then the slowest requests' partitions."""
    f = figures
    share = sorted(((v, k) for k, v in f["share"].items() if v > 0), reverse=True)
    out = [
        f"{name}: {f['requests']} requests with a first chunk; client-boundary TTFT (arrival to "
        f"the first chunk's write) p50 {num(f['p50_ms'])} p90 {num(f['p90_ms'])} p99 "
        f"{num(f['p99_ms'])} ms; engine boundary (to the first token) p50 "
        f"{num(f['engine_p50_ms'])} p99 {num(f['engine_p99_ms'])} ms; reconcile max err "
        f"{f['reconcile_max_err_ms']:.2e} ms",
        f"frontend part (first token to the write): {100 * f['frontend_share']:.1f}% of all "
        "client TTFT time; by label: " + (", ".join(f"{k} {100 * v:.1f}%" for v, k in share[:8])
                                          or "-"),
    ]  # fmt: skip
    slow = sorted(records, key=lambda r: -r["ttft_ms"])[:top]
    if slow:
        rows = []
        for r in slow:
            parts = sorted(((v, k) for k, v in r["parts"].items() if v > 0.05), reverse=True)
            rows.append([str(r["request"]), num(r["ttft_ms"]), num(r["engine_ttft_ms"]),
                         num(r["frontend_ms"]), str(r["primary"]),
                         ", ".join(f"{k} {v:.1f}" for v, k in parts[:5])])  # fmt: skip
        head = ["request", "ttft ms", "engine ms", "frontend ms", "primary", "parts (ms)"]
        out += ["", f"SLOWEST {len(slow)} (ms)", table(rows, head, "lrrrll")]
    return "\n".join(out)


def process_line(p: Mapping[str, Any]) -> str:
    """`tracekit merge`'s line for one process of a server run (meta ``processes``): its
    role, pid, whether it was recovered from parts, and its clock fit to the engine core."""
    c = p.get("clock_fit")
    how = "reference clock" if c is None else (
        f"offset {c['offset_s']:+.6f} s, correction {c['correction_s'] * 1e6:+.1f} us, "
        f"uncertainty {c['uncertainty_s'] * 1e6:.1f} us, paired stamps {c['pairs']} "
        f"(bound {c['bound_s'][0] * 1e6:+.1f}..{c['bound_s'][1] * 1e6:+.1f} us, "
        f"{c['violations']} violations): {c['method']}"
    )  # fmt: skip
    state = "recovered from parts" if p["recovered"] else "complete"
    pid = p.get("pid", "?")  # an identity may name no pid (the log is still merged)
    return f"{p['role']:<12} pid {pid:<7} {state:<21} {how}"


def over_time(rows: Sequence[Mapping[str, Any]]) -> str:
    """`analyze --by`: one line per time bucket (`tracekit.analysis.overtime.Bucket`'s
    records): its gaps, ITL percentiles, the run's tail gaps in it, and the label with the
    largest share of the bucket's own tail."""
    header = ["run", "from s", "to s", "gaps", "p50", "p99", "p99.9", "run tail",
              "bucket tail: top label"]  # fmt: skip
    body = []
    for r in rows:
        share = r["tail_share"]
        top = max(share, key=lambda lb: share[lb] or 0.0) if share else None
        top_text = f"{top} {100 * share[top]:.0f}%" if top and r["gaps"] and share[top] else "-"
        body.append([
            os.path.basename(r["run"]), f"{r['bucket_start_s']:g}", f"{r['bucket_end_s']:g}",
            str(r["gaps"]), num(r["itl_p50"]), num(r["itl_p99"]), num(r["itl_p999"]),
            str(r["run_tail_gaps"]), top_text,
        ])  # fmt: skip
    return table(body, header, "lrrrrrrrl")
