"""The HTML report's tables and the sections built of them: runs, shares and groups, the
verdict, each run's worst stalls, and tensor-parallel ranks (`tracekit.render.html` puts
them on the page). Every string from a log is HTML-escaped (`esc`) where it lands.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from tracekit.analysis.compare import FIGURES, Comparison
from tracekit.analysis.figures import RunAnalysis
from tracekit.analysis.verdict import Verdict
from tracekit.formats import num
from tracekit.labels import colour
from tracekit.render import text


def esc(x: Any) -> str:
    """HTML-escape anything for the page (quotes too: values also go into attributes)."""
    return html.escape(str(x), quote=True)


def table_html(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """Cells are already HTML (escape before); the first column is left-aligned. A wide
    table scrolls inside its own box (the page keeps to a 1000 px window)."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    c = f' class="{cls}"' if cls else ""
    return (
        f"<div class=tw><table{c}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


def run_table(runs: Sequence[RunAnalysis], names: Sequence[str]) -> str:
    header = ["run", "rung", "seed", "requests", "gaps", "tok/s", "p50", "p90", "p99",
              "p99.9", "max", "TTFT p50", "TTFT p99", "preemptions", "eager steps",
              "gc gen 0/1/2", "reconcile err (ms)"]  # fmt: skip
    rows = []
    for a, n in zip(runs, names, strict=True):
        gc = "/".join(str(a.gc_counts.get(g, 0)) for g in ("0", "1", "2"))
        rows.append(
            [
                esc(n),
                esc(a.rung if a.rung is not None else "-"),
                esc(a.seed if a.seed is not None else "-"),
                str(a.requests),
                str(a.gaps),
                num(a.tok_per_s, 0),
                num(a.itl_p50),
                num(a.itl_p90),
                num(a.itl_p99),
                num(a.itl_p999),
                num(a.itl_max),
                num(a.ttft_p50, 0),
                num(a.ttft_p99, 0),
                str(a.preemptions),
                str(a.eager_steps),
                gc,
                f"{a.reconcile_max_err_ms:.1e}",
            ]
        )
    return table_html([esc(h) for h in header], rows)


def run_share_table(runs: Sequence[RunAnalysis], names: Sequence[str], labels) -> str:
    header = ["run", "p99 (ms)", *labels]
    rows = [
        [esc(n), num(a.itl_p99)] + [f"{100 * a.tail_share.get(lb, 0.0):.1f}%" for lb in labels]
        for a, n in zip(runs, names, strict=True)
    ]
    return table_html([swatch(h) if h in labels else esc(h) for h in header], rows)


def group_tables(cmp: Comparison) -> str:
    names = [n for n, _ in FIGURES]
    nds = {n: text.column_decimals([g.figures[n] for g in cmp.groups]) for n in names}
    header = [cmp.by, "runs", *(text.FIGURE_HEADERS.get(n, n) for n in names)]
    rows = [
        [esc(g.key), str(g.num_runs), *(text.spread_cell(g.figures[n], nds[n]) for n in names)]
        for g in cmp.groups
    ]
    shares = [
        [esc(g.key)] + [f"{100 * g.tail_share.get(lb, 0.0):.1f}%" for lb in cmp.labels]
        for g in cmp.groups
    ]
    return (
        table_html([esc(h) for h in header], rows)
        + f"<p class=note>Median tail-time share per {esc(cmp.by)} (median across runs, "
        "so a row need not sum to 100%):</p>"
        + table_html([esc(cmp.by)] + [swatch(lb) for lb in cmp.labels], shares)
    )


def swatch(label: str) -> str:
    return f'<span class=sw style="background:{colour(label)}"></span>{esc(label)}'


def _parts_bar(parts: Mapping[str, float], total_ms: float) -> str:
    cells = []
    for lb, v in parts.items():
        if v <= 0 or total_ms <= 0:
            continue
        w = 100 * v / total_ms
        cells.append(
            f'<span style="width:{w:.2f}%;background:{colour(lb)}" '
            f'title="{esc(lb)} {v:.1f} ms"></span>'
        )
    return f"<div class=bar>{''.join(cells)}</div>"


def _parts_text(parts: Mapping[str, float], total_ms: float) -> str:
    items = sorted(((v, lb) for lb, v in parts.items() if v > 0), key=lambda t: -t[0])
    return ", ".join(
        f"{swatch(lb)} {v:.1f} ({100 * v / total_ms:.0f}%)" if total_ms > 0 else esc(lb)
        for v, lb in items
    )


def verdict_html(v: Verdict) -> str:
    items = "".join(f"<li>{esc(f)}</li>" for f in v.findings)
    cav = "".join(f"<li>{esc(c)}</li>" for c in v.caveats)
    return (
        f'<section id="tk-verdict"><h2>Verdict</h2><ul class=verdict>{items}</ul>'
        + (f"<h3>Caveats</h3><ul class=caveats>{cav}</ul>" if cav else "")
        + "<p class=note>Computed from the figures below: medians across the runs of each "
        f"group by <code>{esc(v.by)}</code>, in the groups' order.</p></section>"
    )


def _requests_cell(g: Mapping[str, Any]) -> str:
    ids = g.get("requests") or [g["request"]]
    n = int(g.get("num_requests", len(ids)))
    more = f" and {n - len(ids)} more" if n > len(ids) else ""
    return f"<b>{n}</b>: " + ", ".join(esc(i) for i in ids) + more


def worst_stalls_html(name: str, records: Sequence[Mapping[str, Any]], open_: bool) -> str:
    """One row per stall event (its longest gap's partition and steps; every request it
    hit), longest first."""
    if not records:
        return f"<details><summary>{esc(name)}: no gaps</summary></details>"
    rows = []
    for k, g in enumerate(records, 1):
        steps = g.get("steps", [])
        step_rows = [
            [
                str(s["step"]),
                f"{s['t_start_s']:.4f}",
                num(s["dur_ms"], 2),
                str(s["num_decode"]),
                str(s["num_prefill_tokens"]),
                {-1: "no decode", 0: "eager"}.get(s["graph_size"], str(s["graph_size"])),
                str(s["num_preempted"]),
                str(s["num_swapped_in"]),
                ", ".join(f"{esc(lb)} {v:.2f}" for lb, v in s["segments_ms"].items()),
            ]
            for s in steps
        ]
        more = g.get("num_steps", len(steps)) - len(steps)
        note = f"<p class=note>{more} steps in between not listed.</p>" if more > 0 else ""
        step_table = table_html(
            ["step", "start (s)", "ms", "decode rows", "prefill tok", "graph", "preempted",
             "swapped in", "segments (ms)"],
            step_rows, "steps",
        )  # fmt: skip
        ctx = g.get("context") or {}
        ctx_html = (
            f"<p class=note>While evicted, the engine ran: {_parts_text(ctx, sum(ctx.values()))}"
            "</p>"
            if ctx
            else ""
        )
        lo = g.get("gap_ms_min", g["gap_ms"])
        gap = num(g["gap_ms"]) if lo >= g["gap_ms"] else f"{num(g['gap_ms'])}<br>({num(lo)} min)"
        rows.append(
            [
                str(k),
                gap,
                swatch(g["primary"]),
                _requests_cell(g),
                f"{g['t0_s']:.4f}",
                _parts_bar(g["parts"], g["gap_ms"]) + _parts_text(g["parts"], g["gap_ms"]),
                f"<details><summary>{g.get('num_steps', len(steps))} steps "
                f"({g['step0']}-{g['step1']})</summary>{step_table}{note}{ctx_html}</details>",
            ]
        )
    table = table_html(
        ["#", "gap (ms)", "primary", "requests hit", "t0 (s)",
         "partition of the longest gap (ms by label)", "steps"],
        rows, "worst",
    )  # fmt: skip
    op = " open" if open_ else ""
    return f"<details{op}><summary>{esc(name)}</summary><div class=tw>{table}</div></details>"


def _rank_cause(rank: int, cause: str | None, ms: float) -> str:
    return "-" if cause is None else f"{swatch(f'rank{rank}:{cause}')} {num(ms, 2)}"


def tp_ranks_html(runs: Sequence[RunAnalysis], names: Sequence[str]) -> str:
    """Tensor parallel: per rank, the slow steps it held, the wait charged to it and its
    top cause; then each slow step with its wait on every rank ('' when no run has rank
    waits). `RunAnalysis.tp_ranks` holds the figures (`tracekit.analysis.ranks`)."""
    have = [(n, v) for a, n in zip(runs, names, strict=True) if (v := a.tp_ranks) is not None]
    if not have:
        return ""
    out = [
        '<h2 id="tk-ranks">Tensor parallel: which rank held each slow step</h2><p class=note>'
        "A step's wait on rank R is its <code>rankR:CAUSE</code> time (the other ranks "
        "waited at a collective for R, charged to what R was doing); the rank with the most "
        "wait held the step. Slow steps: the steps that closed a tail gap (at or above the "
        "run's ITL p99).</p>"
    ]
    for name, v in have:
        rows = [
            [
                f"rank {r.rank}",
                str(r.slow_steps_held),
                num(r.charged_slow_ms, 2),
                num(r.charged_run_ms, 2),
                _rank_cause(r.rank, r.top_cause, r.top_cause_ms),
            ]
            for r in v.ranks
        ]
        ranks_table = table_html(
            ["rank", "slow steps held", "charged in slow steps (ms)", "charged in the run (ms)",
             "top cause in slow steps (ms)"],
            rows, "ranks",
        )  # fmt: skip
        rank_ids = [str(r.rank) for r in v.ranks]
        step_rows = [
            [
                str(s.step),
                f"{s.t_start_s:.4f}",
                num(s.dur_ms, 2),
                "-" if s.holder is None else f"rank {s.holder}",
                "-" if s.holder is None else esc(f"rank{s.holder}:{s.holder_cause}"),
                *(num(s.wait_ms.get(r, 0.0), 2) for r in rank_ids),
            ]
            for s in v.slow_steps
        ]
        steps_table = table_html(
            ["step", "start (s)", "ms", "held by", "its cause",
             *(f"wait on rank {r} (ms)" for r in rank_ids)],
            step_rows, "rank-steps",
        )  # fmt: skip
        out.append(
            f"<h3>{esc(name)}</h3><p>{len(v.slow_steps)} slow steps (tail: gaps at or "
            f"above {num(v.itl_p99_ms, 2)} ms).</p>{ranks_table}"
            f"<details><summary>slow steps</summary>{steps_table}</details>"
        )
    return "".join(out)


def _count_or_dash(n: int) -> str:
    return "-" if n < 0 else str(n)


def evictions_html(runs: Sequence[RunAnalysis], names: Sequence[str]) -> str:
    """Who evicted whom: per run with evictions, its evictions by reason, the recompute
    tax, the top evictors and thrash, then the evictions that cost their victim most, each
    with who needed the blocks ('' when no run has evictions). `RunAnalysis.evictions`
    holds the figures (`tracekit.analysis.evictions`)."""
    have = [(n, e) for a, n in zip(runs, names, strict=True) if (e := a.evictions) is not None]
    if not have:
        return ""
    out = [
        '<h2 id="tk-evictions">Who evicted whom</h2><p class=note>An eviction\'s cause is '
        "recorded where the scheduler decided it: the victim, the request(s) whose admission, "
        "prefill chunk or decode growth needed the KV blocks (its evictors), the reason, the "
        "computed tokens it lost and the pool then. Its debt is the victim's evicted time "
        "plus readmission to its next token (the re-prefill of what recompute threw away). "
        "Recompute tax: recomputed tokens / all computed tokens.</p>"
    ]
    for name, e in have:
        reasons = ", ".join(f"{esc(k)} {v}" for k, v in e.by_reason.items())
        top = ", ".join(
            f"{esc(r)} ({n} victim{'s' * (n != 1)}, {num(ms, 1)} ms)"
            for r, n, ms in e.top_evictors[:5]
        )
        thrash = ", ".join(f"{esc(r)} &times;{n}" for r, n in e.thrash[:5])
        rows = [
            [
                esc(w.victim),
                ", ".join(esc(x) for x in w.evictors) or "-",
                "-" if w.step is None else str(w.step),
                esc(w.reason),
                _count_or_dash(w.num_computed_tokens_lost),
                f"{_count_or_dash(w.num_free_blocks)} / {_count_or_dash(w.num_used_blocks)}",
                num(w.evicted_ms, 2),
                num(w.resume_ms, 2),
                num(w.debt_ms, 2),
            ]
            for w in e.worst
        ]
        worst = table_html(
            ["victim", "evicted by", "step", "reason", "tokens lost", "free / used blocks",
             "evicted (ms)", "to next token (ms)", "debt (ms)"],
            rows, "evictions",
        )  # fmt: skip
        out.append(
            f"<h3>{esc(name)}</h3><p>{e.num_evictions} evictions ({e.num_with_cause} with a "
            f"recorded cause; {reasons}); recompute tax {num(100 * e.recompute_tax, 1)}% "
            f"({e.recomputed_tokens} of {e.computed_tokens} computed tokens, "
            f"{num(e.recompute_ms, 1)} ms in recompute). Top evictors: {top or 'none recorded'}."
            f" Evicted more than once: {e.num_thrashed} request(s){': ' + thrash if thrash else ''}"
            f".</p>{worst}"
        )
    return "".join(out)
