"""The HTML report: one self-contained file that opens offline.

plotly.js is inlined once (`plotly.offline.get_plotlyjs()`); nothing else is loaded: no
CDN, no web font, no MathJax. The same input gives byte-identical HTML (fixed element
ids, no timestamps, figures serialised with sorted keys).

Safety: every string that comes from a log (labels, config values, request ids, paths)
is HTML-escaped where it lands in the page and in chart text (plotly draws pseudo-HTML
in labels), and the figures' JSON inside ``<script>`` has ``<``, ``>`` and ``&`` written
as ``\\u003c``, ``\\u003e``, ``\\u0026``, so nothing in a log can close the script.

Sections: the verdict in words with its caveats (`tracekit.analysis.verdict`); summary per run
and per group; ITL over time per run (each gap a point coloured by primary cause,
evictions and GC pauses marked); the ITL histogram by primary cause; tail-time share by
cause with tail-gap counts beside it; the ladder (p99 and p99.9, median with [min-max]
whiskers per group); forward-pass share of clean vs tail gaps; TTFT; who evicted whom
(each run's evictions by reason, recompute tax, top evictors, thrash and costliest
evictions); the worst stalls of each run (gaps grouped by the event that caused them)
with their partition and steps.
Runs appear in the order given (the CLI sorts them by `--order-by`). The page fits a
1000 px window: wide tables scroll inside their box.

Pure rendering: it consumes `RunAnalysis`, `Comparison`, `Verdict`, and
`tracekit.analysis.gaps.worst_stalls` / `itl_series` records, and returns a string.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from tracekit.analysis.compare import Comparison
from tracekit.analysis.figures import RunAnalysis
from tracekit.analysis.overtime import Bucket, worst_buckets
from tracekit.analysis.verdict import Verdict
from tracekit.formats import json_safe, num
from tracekit.labels import colour
from tracekit.render.client import client_html, spec_html
from tracekit.render.html_tables import (
    esc,
    evictions_html,
    group_tables,
    run_share_table,
    run_table,
    swatch,
    table_html,
    tp_ranks_html,
    verdict_html,
    worst_stalls_html,
)
from tracekit.version import __version__

#: Colours that are not labels: the two sides of the forward-share and TTFT charts.
_INK = "#333333"
_LIGHT = "#BBBBBB"
_CONFIG = {"displaylogo": False, "responsive": True}


@dataclass(frozen=True)
class ReportRun:
    """What the report shows of one run."""

    analysis: RunAnalysis
    # gaps.worst_stalls (gaps.worst_gaps records read as stalls that hit one request)
    worst_stalls: list[dict[str, Any]] = field(default_factory=list)
    series: Mapping[str, Any] | None = None  # gaps.itl_series
    #: the tail over time (`tracekit.analysis.overtime.report_buckets`): none for a short run
    buckets: Sequence[Bucket] = ()


def script_json(obj: Any) -> str:
    """JSON safe inside ``<script>``: sorted keys, no NaN, and ``< > &`` (and the JS line
    separators) escaped so no string can end the script or open a comment."""
    s = json.dumps(json_safe(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return (
        s.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def run_labels(runs: Sequence[RunAnalysis]) -> list[str]:
    """A short, unique name per run: the file name, or the whole path where names repeat."""
    base = [os.path.basename(a.path) or a.path for a in runs]
    names: list[str] = []
    for i, (a, b) in enumerate(zip(runs, base, strict=True)):
        name = a.path if base.count(b) > 1 else b
        names.append(name if names.count(name) == 0 else f"{name} #{i + 1}")
    return names


def _bin_names(a: RunAnalysis) -> list[str]:
    return [
        f"{b.lo_ms:g}-{b.hi_ms:g}" if math.isfinite(b.hi_ms) else f"{b.lo_ms:g}+" for b in a.hist
    ]


def _causes(runs: Sequence[RunAnalysis]) -> list[str]:
    """Primary causes in display order: `clean` first, then as the runs list them."""
    out = ["clean"]
    for a in runs:
        for b in a.hist:
            out += [c for c in b.by_primary if c not in out]
        out += [c for c in a.tail_count if c not in out]
    return out


# -- figures (plain plotly JSON) --------------------------------------------------------


def _layout(title: str, **kw: Any) -> dict[str, Any]:
    lay: dict[str, Any] = {
        "title": {"text": esc(title), "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        "font": {
            "family": "system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif",
            "size": 12,
        },  # fmt: skip
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "margin": {"l": 60, "r": 20, "t": 60, "b": 60},
        "legend": {"orientation": "h", "y": -0.18},
        "hovermode": "closest",
    }
    lay.update(kw)
    return lay


def _axis(title: str, **kw: Any) -> dict[str, Any]:
    ax = {"title": {"text": esc(title)}, "gridcolor": "#eeeeee", "zerolinecolor": "#cccccc"}
    ax.update(kw)
    return ax


def log_ticks(lo: float, hi: float) -> dict[str, Any]:
    """Tick marks for a log axis over [lo, hi]: 1-2-5 steps, every label the full number
    (plotly's own log ticks label minor steps "2" and "5" alone, which reads as 2 above
    1000). Thinned to 1-10-100 steps over wide ranges."""
    if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)):
        return {}
    lo, hi = min(lo, hi), max(lo, hi)
    vals: list[float] = []
    e = math.floor(math.log10(lo))
    while 10**e <= hi * 1.0001:
        vals += [m * 10.0**e for m in (1, 2, 5)]
        e += 1
    vals = [v for v in vals if lo / 1.0001 <= v <= hi * 1.0001] or [10.0 ** round(math.log10(lo))]
    if len(vals) > 12:
        vals = [v for v in vals if f"{v:g}".lstrip("0.").startswith("1")]
    text_ = [f"{v:,.0f}" if v >= 1 else f"{v:g}" for v in vals]
    return {"tickmode": "array", "tickvals": vals, "ticktext": text_}


def _log_range(values: Sequence[float]) -> tuple[float, float]:
    v = [x for x in values if x is not None and math.isfinite(x) and x > 0]
    return (min(v), max(v)) if v else (1.0, 10.0)


def histogram_figure(runs: Sequence[RunAnalysis], names: Sequence[str]) -> dict[str, Any]:
    """Stacked bars of gap counts per ITL bin, one colour per primary cause; a menu picks
    the run (runs are never pooled) and the y scale."""
    causes = _causes(runs)
    data: list[dict[str, Any]] = []
    owner: list[int] = []
    counts = [b.count for a in runs for b in a.hist]
    for k, a in enumerate(runs):
        x = _bin_names(a)
        for c in causes:
            y = [b.by_primary.get(c, 0) for b in a.hist]
            if not any(y) and c != "clean":
                continue
            data.append(
                {
                    "type": "bar",
                    "name": esc(c),
                    "legendgroup": esc(c),
                    "x": x,
                    "y": y,
                    "marker": {"color": colour(c)},
                    "visible": k == 0,
                    "hovertemplate": f"%{{x}} ms: %{{y}} gaps, primary {esc(c)}<extra></extra>",
                }
            )
            owner.append(k)
    menus = [
        {
            "type": "buttons",
            "direction": "right",
            "x": 1.0,
            "xanchor": "right",
            "y": 1.12,
            "yanchor": "bottom",
            "showactive": True,
            "buttons": [
                {
                    "label": "log y",
                    "method": "relayout",
                    "args": [{"yaxis.type": "log", "yaxis.tickmode": "array"}],
                },
                {
                    "label": "linear y",
                    "method": "relayout",
                    "args": [{"yaxis.type": "linear", "yaxis.tickmode": "auto"}],
                },
            ],
        }
    ]
    if len(runs) > 1:
        menus.append(_run_menu(names, owner, x=0.78))
    title = "ITL histogram by primary cause" + (f" ({names[0]})" if len(runs) == 1 else "")
    return {
        "data": data,
        "layout": _layout(
            title,
            barmode="stack",
            height=430,
            margin={"l": 60, "r": 20, "t": 90, "b": 60},
            xaxis=_axis("inter-token gap (ms), bins [lo, hi)", type="category"),
            yaxis=_axis("gaps", type="log", **log_ticks(1, max(counts, default=10))),
            updatemenus=menus,
        ),
    }


def _run_menu(names: Sequence[str], owner: Sequence[int], x: float = 1.0) -> dict[str, Any]:
    """A dropdown that shows one run's traces at a time (`owner[i]`: trace i's run)."""
    return {
        "type": "dropdown",
        "x": x,
        "xanchor": "right",
        "y": 1.12,
        "yanchor": "bottom",
        "showactive": True,
        "buttons": [
            {
                "label": esc(n),
                "method": "restyle",
                "args": [{"visible": [o == k for o in owner]}],
            }
            for k, n in enumerate(names)
        ],
    }


def itl_time_figure(series: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """ITL over time, one run at a time (a menu picks it): each gap a point at the time it
    ended, coloured by primary cause; GC pauses as open diamonds at their length; evictions
    as triangles along the bottom. Log y."""
    data: list[dict[str, Any]] = []
    owner: list[int] = []
    lo, hi = _log_range([v for s_ in series for v in s_["gap_ms"]])
    floor = lo / 1.6  # where eviction marks sit, below every gap
    for k, s_ in enumerate(series):
        by_cause: dict[str, list[int]] = {}
        for i, c in enumerate(s_["primary"]):
            by_cause.setdefault(str(c), []).append(i)
        for c in sorted(by_cause, key=lambda c: (c != "clean", c)):
            idx = by_cause[c]
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": esc(c),
                    "legendgroup": esc(c),
                    "x": [s_["t_s"][i] for i in idx],
                    "y": [s_["gap_ms"][i] for i in idx],
                    "marker": {"color": colour(c), "size": 4 if c == "clean" else 6},
                    "visible": k == 0,
                    "hovertemplate": f"t %{{x:.3f}} s: gap %{{y:.1f}} ms, primary {esc(c)}"
                    "<extra></extra>",
                }
            )
            owner.append(k)
        if s_["gc_t_s"]:
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": "GC pause",
                    "legendgroup": "GC pause",
                    "x": s_["gc_t_s"],
                    "y": [max(v, floor) for v in s_["gc_ms"]],
                    "customdata": s_["gc_generation"],
                    "marker": {"color": colour("gc"), "symbol": "diamond-open", "size": 9},
                    "visible": k == 0,
                    "hovertemplate": "GC gen %{customdata} at %{x:.3f} s: %{y:.1f} ms"
                    "<extra></extra>",
                }
            )
            owner.append(k)
        if s_["evict_t_s"]:
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": "eviction",
                    "legendgroup": "eviction",
                    "x": s_["evict_t_s"],
                    "y": [floor] * len(s_["evict_t_s"]),
                    "marker": {"color": colour("preempt"), "symbol": "triangle-up", "size": 8},
                    "visible": k == 0,
                    "hovertemplate": "eviction at %{x:.3f} s<extra></extra>",
                }
            )
            owner.append(k)
    menus = [_run_menu(names, owner)] if len(series) > 1 else []
    shown = [f"{len(s_['t_s'])} of {s_['num_gaps']}" for s_ in series]
    title = "ITL over time" + (f" ({names[0]})" if len(series) == 1 else "")
    return {
        "data": data,
        "layout": _layout(
            title,
            height=430,
            margin={"l": 60, "r": 20, "t": 90, "b": 60},
            xaxis=_axis("engine clock (s)"),
            yaxis=_axis("inter-token gap (ms)", type="log", **log_ticks(floor, hi)),
            updatemenus=menus,
            meta={"points": shown},
        ),
    }


def tail_share_figure(
    rows: Sequence[tuple[str, Mapping[str, float], Mapping[str, float]]],
    labels: Sequence[str],
    causes: Sequence[str],
    per: str,
) -> dict[str, Any]:
    """Left: share of tail time by label (%). Right: tail gaps by primary cause (count).
    `rows` are (name, tail share by label, tail count by cause), top to bottom."""
    y = [esc(r[0]) for r in rows]
    data: list[dict[str, Any]] = []
    for lb in labels:
        xs = [100 * r[1].get(lb, 0.0) for r in rows]
        if not any(xs):
            continue
        data.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": esc(lb),
                "legendgroup": esc(lb),
                "x": xs,
                "y": y,
                "marker": {"color": colour(lb)},
                "xaxis": "x",
                "yaxis": "y",
                "hovertemplate": f"%{{y}}: {esc(lb)} %{{x:.1f}}% of tail time<extra></extra>",
            }
        )
    shown = {d["legendgroup"] for d in data}
    for c in causes:
        xs = [r[2].get(c, 0) for r in rows]
        if not any(xs):
            continue
        data.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": esc(c),
                "legendgroup": esc(c),
                "showlegend": esc(c) not in shown,
                "x": xs,
                "y": y,
                "marker": {"color": colour(c)},
                "xaxis": "x2",
                "yaxis": "y2",
                "hovertemplate": f"%{{y}}: %{{x}} tail gaps, primary {esc(c)}<extra></extra>",
            }
        )
    h = max(300, 170 + 28 * len(rows))
    return {
        "data": data,
        "layout": _layout(
            f"Where the tail went, per {per}: time (share of tail-gap time by label) and "
            "count (tail gaps by primary cause)",
            barmode="stack",
            height=h,
            margin={"l": 160, "r": 20, "t": 60, "b": 120},
            legend={
                "orientation": "h",
                "x": 0,
                "y": 0.01,
                "yanchor": "bottom",
                "yref": "container",
            },
            xaxis=_axis("share of tail time (%)", domain=[0.0, 0.48], range=[0, 100]),
            yaxis=_axis("", autorange="reversed", type="category"),
            xaxis2=_axis("tail gaps (count)", domain=[0.55, 1.0], anchor="y2"),
            yaxis2=_axis(
                "", autorange="reversed", type="category", anchor="x2", showticklabels=False
            ),
        ),
    }


def ladder_figure(cmp: Comparison) -> dict[str, Any]:
    """p99 and p99.9 per group: median with [min-max] whiskers across runs, log y."""
    x = [esc(g.key) for g in cmp.groups]
    data = []
    for name, label, col in (("itl_p99", "p99", _LIGHT), ("itl_p999", "p99.9", _INK)):
        med = [g.figures[name].median for g in cmp.groups]
        lo = [g.figures[name].lo for g in cmp.groups]
        hi = [g.figures[name].hi for g in cmp.groups]
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": f"ITL {label}",
                "x": x,
                "y": med,
                "marker": {"color": col, "size": 9},
                "line": {"color": col},
                "error_y": {
                    "type": "data",
                    "symmetric": False,
                    "array": [h - m for h, m in zip(hi, med, strict=True)],
                    "arrayminus": [m - v for m, v in zip(med, lo, strict=True)],
                    "color": col,
                    "thickness": 1.5,
                    "width": 6,
                },
                "customdata": [[a, b] for a, b in zip(lo, hi, strict=True)],
                "hovertemplate": (
                    f"%{{x}}: {label} %{{y:.1f}} ms [%{{customdata[0]:.1f}}-"
                    "%{customdata[1]:.1f}]<extra></extra>"
                ),
            }
        )
    return {
        "data": data,
        "layout": _layout(
            f"The ladder: ITL p99 and p99.9 per {cmp.by}, median with [min-max] across runs",
            height=420,
            xaxis=_axis(cmp.by, type="category"),
            yaxis=_axis(
                "ITL (ms)",
                type="log",
                **log_ticks(
                    *_log_range(
                        [g.figures[n].lo for g in cmp.groups for n in ("itl_p99", "itl_p999")]
                        + [g.figures[n].hi for g in cmp.groups for n in ("itl_p99", "itl_p999")]
                    )
                ),
            ),
        ),
    }


def forward_share_figure(runs: Sequence[RunAnalysis], names: Sequence[str]) -> dict[str, Any]:
    """Median forward-pass share of a gap, clean gaps vs tail gaps, per run."""
    x = [esc(n) for n in names]
    data = [
        {
            "type": "bar",
            "name": name,
            "x": x,
            "y": [100 * getattr(a, attr) for a in runs],
            "marker": {"color": col},
            "hovertemplate": f"%{{x}}: {name} %{{y:.0f}}% forward<extra></extra>",
        }
        for attr, name, col in (
            ("fwd_share_clean_median", "clean gaps", _LIGHT),
            ("fwd_share_tail_median", "tail gaps", _INK),
        )
    ]
    return {
        "data": data,
        "layout": _layout(
            "Forward pass share of a gap (median): clean gaps vs tail gaps",
            barmode="group",
            height=380,
            xaxis=_axis("run", type="category"),
            yaxis=_axis("forward / gap (%)", range=[0, 100]),
        ),
    }


def ttft_figure(runs: Sequence[RunAnalysis], names: Sequence[str]) -> dict[str, Any]:
    """TTFT p50 and p99 per run (ms)."""
    x = [esc(n) for n in names]
    data = [
        {
            "type": "bar",
            "name": name,
            "x": x,
            "y": [getattr(a, attr) for a in runs],
            "marker": {"color": col},
            "hovertemplate": f"%{{x}}: {name} %{{y:.0f}} ms<extra></extra>",
        }
        for attr, name, col in (("ttft_p50", "TTFT p50", _LIGHT), ("ttft_p99", "TTFT p99", _INK))
    ]
    return {
        "data": data,
        "layout": _layout(
            "Time to first token per run (arrival to first token)",
            barmode="group",
            height=380,
            xaxis=_axis("run", type="category"),
            yaxis=_axis("TTFT (ms)"),
        ),
    }


# -- TTFT by cause (docs/ttft.md) -------------------------------------------------------

_TTFT_PHASES = ("queued", "prefilling", "evicted", "unsplit")


def ttft_cause_figure(
    rows: Sequence[tuple[str, Mapping[str, float]]], labels: Sequence[str], per: str
) -> dict[str, Any]:
    """Share of tail TTFT time (requests >= the run's TTFT p90) by label, one bar per row."""
    y = [esc(r[0]) for r in rows]
    data = [
        {
            "type": "bar",
            "orientation": "h",
            "name": esc(lb),
            "x": [100 * r[1].get(lb, 0.0) for r in rows],
            "y": y,
            "marker": {"color": colour(lb)},
            "hovertemplate": f"%{{y}}: {esc(lb)} %{{x:.1f}}% of tail TTFT<extra></extra>",
        }
        for lb in labels
        if any(r[1].get(lb, 0.0) for r in rows)
    ]
    return {
        "data": data,
        "layout": _layout(
            f"Where TTFT went, per {per}: share of tail TTFT time (requests at or above the "
            "run's TTFT p90) by cause",
            barmode="stack",
            height=max(300, 170 + 28 * len(rows)),
            margin={"l": 160, "r": 20, "t": 60, "b": 110},
            legend={"orientation": "h", "y": -0.1, "yanchor": "top", "yref": "container"},
            xaxis=_axis("share of tail TTFT time (%)", range=[0, 100]),
            yaxis=_axis("", autorange="reversed", type="category"),
        ),
    }


def ttft_section(
    runs: Sequence[RunAnalysis], names: Sequence[str], cmp: Comparison, chart: Any
) -> str:
    """The report's TTFT section: where TTFT went per run and per group (phases, tail share
    by cause, primary causes). `chart(div_id, figure, note)` places a figure."""
    have = [(t, n) for a, n in zip(runs, names, strict=True) if (t := a.ttft) is not None]
    if not have:
        return ""
    labels: list[str] = []
    for t, _ in have:
        labels += [lb for lb in t.all_share if lb not in labels]
    g_ttft = [(g, gt) for g in cmp.groups if (gt := g.ttft) is not None]
    grouped = any(g.num_runs > 1 for g in cmp.groups) and len(g_ttft) == len(cmp.groups)
    if grouped:
        rows = [(g.key, gt.tail_share) for g, gt in g_ttft]
        per = cmp.by
    else:
        rows = [(n, t.tail_share) for t, n in have]
        per = "run"
    header = ["run", "TTFT p50", "p90", "p99", "max", *_TTFT_PHASES, "tail primary causes",
              "reconcile err (ms)"]  # fmt: skip
    body = []
    for t, n in have:
        counts = ", ".join(
            f"{esc(k)} {v}" for k, v in sorted(t.tail_count.items(), key=lambda kv: -kv[1])
        )
        body.append(
            [esc(n), *(num(x, 0) for x in (t.p50_ms, t.p90_ms, t.p99_ms, t.max_ms))]
            + [f"{100 * t.phase_share.get(ph, 0.0):.1f}%" for ph in _TTFT_PHASES]
            + [counts or "-", f"{t.reconcile_max_err_ms:.1e}"]
        )
    out = [
        "<h2>Where TTFT went</h2><p class=note>Each request's window [arrival, first token] "
        "split exclusively into phases (queued until admission, prefilling, evicted) and "
        "causes; both sum to the TTFT. wait_* is queue time the scheduler explained (why it "
        "did not admit the request); prefill_own/prefill_other split a step's prefill by "
        "token share; decode_other is other requests' decoding.</p>",
        chart("tk-ttft-causes", ttft_cause_figure(rows, labels, per)),
        "<p class=note>Per run: TTFT (ms), share of TTFT time by phase, and tail requests "
        "(TTFT &gt;= p90) by primary cause:</p>",
        table_html([esc(h) for h in header], body),
    ]
    if grouped:
        g_head = [cmp.by, "queued", "prefilling", "evicted", *labels]
        g_rows = [
            [esc(g.key)]
            + [f"{100 * gt.phase_share.get(ph, 0.0):.1f}%" for ph in _TTFT_PHASES[:3]]
            + [f"{100 * gt.tail_share.get(lb, 0.0):.1f}%" for lb in labels]
            for g, gt in g_ttft
        ]
        out.append(
            f"<p class=note>Per {esc(cmp.by)}: median phase share and median tail TTFT share "
            "by cause across runs (a row need not sum to 100%):</p>"
            + table_html([esc(h) if h not in labels else swatch(h) for h in g_head], g_rows)
        )
    notes = sorted({nt for t, _ in have for nt in t.notes})
    if notes:
        out.append("<p class=note>" + "<br>".join(esc(nt) for nt in notes) + "</p>")
    return "".join(out)


# -- the page ---------------------------------------------------------------------------


def _asset(name: str) -> str:
    """A file of the page's own CSS or JS, shipped beside this module (`assets/`)."""
    return (resources.files("tracekit.render") / "assets" / name).read_text(encoding="utf-8")


_CSS = "\n" + _asset("report.css")  # the page's style sheet
_LOADER = "\n" + _asset("report.js")  # draws every figure from the JSON in the page


class _Charts:
    """The page's charts: each call places a chart's div (and its note) and keeps its
    figure for the page's one JSON block, in the order placed."""

    def __init__(self) -> None:
        self.figs: dict[str, dict[str, Any]] = {}

    def __call__(self, div_id: str, fig: dict[str, Any], note: str = "") -> str:
        self.figs[div_id] = fig
        h = int(fig["layout"].get("height", 400))
        n = f"<p class=note>{note}</p>" if note else ""
        return f'<div id="{div_id}" class="chart" style="height:{h}px"></div>{n}'


def _title_section(title: str, comparison: Comparison, n_runs: int) -> str:
    """The title, and what the page's figures are: units, the tail, runs as evidence."""
    return (
        f"<h1>{esc(title)}</h1><p class=note>{n_runs} run{'s' if n_runs != 1 else ''}, "
        f"{len(comparison.groups)} group{'s' if len(comparison.groups) != 1 else ''} by "
        f"<code>{esc(comparison.by)}</code>. ITL and TTFT in ms. The tail of a run is its gaps at "
        "or above its own p99; runs are the unit of evidence (figures are per run, or the "
        f"median and [min-max] across runs). tracekit {esc(__version__)}.</p>"
    )


def _window_section(analyses: Sequence[RunAnalysis], names: Sequence[str]) -> str:
    """Which window each run shows (`report --window/--around`), and which figures stay the
    whole run's (docs/reports.md, "Windows: part of a long run"); empty for whole runs."""
    rows = []
    for a, name in zip(analyses, names, strict=True):
        w = a.window
        span = "the whole run" if w is None else (
            f"{'' if w['from_s'] is None else format(w['from_s'], '.6g')}.."
            f"{'' if w['to_s'] is None else format(w['to_s'], '.6g')} s from engine start "
            f"({esc(str(w['how']))})")  # fmt: skip
        rows.append(f"<li><b>{esc(name)}</b>: {span}</li>")
    if all(a.window is None for a in analyses):
        return ""
    return (
        "<h2>Window</h2><p class=note>This page shows part of each run: the gaps that end in "
        "its window and the TTFTs whose first token lands in it, each partitioned as in the "
        "whole run. Of the window: gaps, ITL percentiles, the tail (gaps at or above the "
        "window's p99) and its shares, the histogram, ITL over time, the tail over time, the "
        "worst stalls, TTFT figures and the what-if. Of the whole run: requests, tokens, "
        "tok/s, steps, preemptions, GC counts and pauses, the graph baseline, device timing, "
        "the client boundary, speculative decoding, tensor-parallel ranks, the recompute tax "
        "and the eviction summary.</p><ul>" + "".join(rows) + "</ul>"
    )


def _table_sections(
    analyses: Sequence[RunAnalysis], names: Sequence[str], labels: list[str], comparison: Comparison
) -> list[str]:
    """The runs table, each run's share of tail time by label, the groups, the warnings."""
    sections = ["<h2>Runs</h2><div class=tw>" + run_table(analyses, names) + "</div>"]
    sections.append(
        "<p class=note>Share of tail time by label, per run (each row sums to 100%):</p>"
        "<div class=tw>" + run_share_table(analyses, names, labels) + "</div>"
    )
    sections.append(
        f"<h2>Groups by {esc(comparison.by)}</h2><div class=tw>"
        + group_tables(comparison)
        + "</div>"
    )
    warn = [(n, w) for a, n in zip(analyses, names, strict=True) for w in a.warnings]
    if warn:
        sections.append(
            "<h2>Warnings</h2><ul>"
            + "".join(f"<li>{esc(n)}: {esc(w)}</li>" for n, w in warn)
            + "</ul>"
        )
    return sections


def _itl_time_section(runs: Sequence[ReportRun], names: Sequence[str], chart: _Charts) -> str:
    """ITL over time, where every run has its series ("" where one has none)."""
    series = [r.series for r in runs]
    if not (all(x is not None for x in series) and series):
        return ""
    return "<h2>ITL over time</h2>" + chart(
        "tk-itl-time",
        itl_time_figure(series, names),  # type: ignore[arg-type]
        "Each point is one gap, at the time it ended, coloured by its primary cause; "
        "the tail (gaps at or above the run's p99) is drawn first, whole where it fits, "
        "else its worst gaps and an even stride over it; the others are thinned evenly "
        "in long runs ("
        + ", ".join(
            f"{esc(n)}: {len(x['t_s'])} of {x['num_gaps']}"  # type: ignore[index]
            for n, x in zip(names, series, strict=True)
        )
        + "). Pick the run in the menu.",
    )


def over_time_figure(runs: Sequence[Sequence[Bucket]], names: Sequence[str]) -> dict[str, Any]:
    """ITL p50, p99 and p99.9 per time bucket, one run at a time (a menu picks it). Log y."""
    data: list[dict[str, Any]] = []
    owner: list[int] = []
    styles = (
        ("p50", "itl_p50", _LIGHT),
        ("p99", "itl_p99", _INK),
        ("p99.9", "itl_p999", "#D62728"),
    )
    for k, rows in enumerate(runs):
        x = [(b.start_s + b.end_s) / 2 for b in rows]
        for name, attr, ink in styles:
            y = [getattr(b, attr) if b.gaps else None for b in rows]
            data.append({
                "type": "scatter", "mode": "lines+markers", "name": name, "x": x, "y": y,
                "line": {"color": ink}, "marker": {"color": ink, "size": 5},
                "visible": k == 0, "connectgaps": False,
                "hovertemplate": f"%{{x:.1f}} s: {name} %{{y:.1f}} ms<extra></extra>",
            })  # fmt: skip
            owner.append(k)
    ys = [v for rows in runs for b in rows if b.gaps for v in (b.itl_p50, b.itl_p999)]
    lo, hi = _log_range(ys)
    title = "ITL percentiles over time" + (f" ({names[0]})" if len(runs) == 1 else "")
    return {
        "data": data,
        "layout": _layout(
            title, height=400, margin={"l": 60, "r": 20, "t": 90, "b": 60},
            xaxis=_axis("engine clock (s), bucket middle"),
            yaxis=_axis("ITL (ms)", type="log", **log_ticks(lo, hi)),
            updatemenus=[_run_menu(names, owner)] if len(runs) > 1 else [],
        ),
    }  # fmt: skip


def tail_mix_figure(runs: Sequence[Sequence[Bucket]], names: Sequence[str]) -> dict[str, Any]:
    """Each bucket's own tail (its gaps >= its p99) by label: stacked shares of its time,
    one run at a time, so a change of the tail's cause shows as a change of colour."""
    data: list[dict[str, Any]] = []
    owner: list[int] = []
    for k, rows in enumerate(runs):
        labels = [lb for lb in (rows[0].tail_share if rows else {})
                  if any(b.tail_share.get(lb, 0.0) > 0 for b in rows)]  # fmt: skip
        x = [(b.start_s + b.end_s) / 2 for b in rows]
        width = [b.end_s - b.start_s for b in rows]
        for lb in labels:
            data.append({
                "type": "bar", "name": esc(lb), "legendgroup": esc(lb), "x": x, "width": width,
                "y": [100 * b.tail_share.get(lb, 0.0) for b in rows],
                "marker": {"color": colour(lb)}, "visible": k == 0,
                "hovertemplate": f"%{{x:.1f}} s: {esc(lb)} %{{y:.0f}}% of the tail<extra></extra>",
            })  # fmt: skip
            owner.append(k)
    title = "The tail's cause mix over time" + (f" ({names[0]})" if len(runs) == 1 else "")
    return {
        "data": data,
        "layout": _layout(
            title, height=420, barmode="stack", margin={"l": 60, "r": 20, "t": 90, "b": 80},
            legend={"orientation": "h", "y": -0.25},
            xaxis=_axis("engine clock (s)"),
            yaxis=_axis("share of the bucket's tail time (%)", range=[0, 100]),
            updatemenus=[_run_menu(names, owner)] if len(runs) > 1 else [],
        ),
    }  # fmt: skip


def worst_windows_html(runs: Sequence[ReportRun], names: Sequence[str], n: int = 5) -> str:
    """Per run, the buckets with the highest p99.9, each with the command that drills in."""
    rows = []
    for r, name in zip(runs, names, strict=True):
        for b in worst_buckets(list(r.buckets), n):
            top = max(b.tail_share, key=lambda lb: b.tail_share[lb], default="")
            window = f"{b.start_s:g}..{b.end_s:g}"
            cmd = f"tracekit analyze {shlex.quote(r.analysis.path)} --window {window}"
            share = num(100 * b.tail_share.get(top, 0.0), 0)
            rows.append(
                f"<tr><td>{esc(name)}</td><td class=num>{window}</td>"
                f"<td class=num>{b.gaps}</td><td class=num>{num(b.itl_p99)}</td>"
                f"<td class=num>{num(b.itl_p999)}</td><td>{esc(top)} {share}%</td>"
                f"<td><code>{esc(cmd)}</code></td></tr>"
            )
    return (
        "<div class=tw><table class=worst-windows><thead><tr><th>run</th><th>window (s)</th>"
        "<th>gaps</th><th>p99</th><th>p99.9</th><th>top label of its tail</th><th>drill in"
        "</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>"
    )


def _over_time_section(runs: Sequence[ReportRun], names: Sequence[str], chart: _Charts) -> str:
    """The tail over time, for the runs long enough to have it ("" where none is)."""
    long = [(r, nm) for r, nm in zip(runs, names, strict=True) if r.buckets]
    if not long:
        return ""
    rs, ns = [r for r, _ in long], [nm for _, nm in long]
    width = ", ".join(
        f"{esc(nm)}: {r.buckets[0].end_s - r.buckets[0].start_s:g} s" for r, nm in long
    )
    return (
        "<h2 id=tk-over-time-h>The tail over time</h2>"
        + chart("tk-over-time", over_time_figure([r.buckets for r in rs], ns),
                f"Each point is one time bucket ({width}): the percentiles of the gaps that "
                "ended in it. An empty bucket leaves a hole.")
        + chart("tk-tail-mix", tail_mix_figure([r.buckets for r in rs], ns),
                "Each bar is a bucket's own tail (its gaps at or above its p99): the share of "
                "its time by label.")
        + "<p class=note>The worst windows (highest p99.9), each with the command that "
        "shows its gaps partitioned as in the whole run:</p>" + worst_windows_html(rs, ns)
    )  # fmt: skip


def _tail_section(
    analyses: Sequence[RunAnalysis],
    names: Sequence[str],
    comparison: Comparison,
    labels: list[str],
    causes: list[str],
    chart: _Charts,
) -> str:
    """Where the tail went: per group (medians) where a group has several runs, else per
    run."""
    if any(g.num_runs > 1 for g in comparison.groups):
        rows = [(g.key, g.tail_share, g.tail_count) for g in comparison.groups]
        per, note = comparison.by, "Medians across the runs of each group."
    else:
        rows = [(n, a.tail_share, a.tail_count) for a, n in zip(analyses, names, strict=True)]
        per, note = "run", ""
    return "<h2>Where the tail went</h2>" + chart(
        "tk-tail",
        tail_share_figure(rows, labels, causes, per),
        "Time and count disagree: a cause can cross p99 often and hold little tail time, "
        "or rarely and hold most of it. " + note,
    )


def _worst_stalls_section(runs: Sequence[ReportRun], names: Sequence[str]) -> str:
    """Each run's worst stalls (the first run's open)."""
    worst = "".join(
        worst_stalls_html(n, r.worst_stalls, open_=(k == 0))
        for k, (r, n) in enumerate(zip(runs, names, strict=True))
    )
    return (
        '<h2 id="tk-stalls">Worst stalls</h2><p class=note>The worst stalls of each run '
        "among its tail gaps: gaps closed by the same step with the same primary cause are "
        "one stall (a GC pause or a long prefill stalls the whole batch at once), listed "
        "once with every request it hit; the partition (parts sum to the gap) and steps are "
        "those of its longest gap.</p>" + worst
    )


def _page(
    title: str, sections: list[str], legend: str, figs: dict[str, Any], plotly_js: str
) -> str:
    """The document: head and style, the title section, the colour legend, the other
    sections, then the figures, the plot config, plotly.js and the loader."""
    return "".join(
        [
            "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>",
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>\n",
            sections[0],
            f"\n<p class=note>Colours: {legend}</p>\n",
            "\n".join(sections[1:]),
            '\n<script type="application/json" id="tk-figures">',
            script_json(figs),
            '</script>\n<script type="application/json" id="tk-config">',
            script_json(_CONFIG),
            "</script>\n<script>",
            plotly_js,
            "</script>\n<script>",
            _LOADER,
            "</script>\n</body></html>\n",
        ]
    )


def render_report(
    runs: Sequence[ReportRun],
    comparison: Comparison,
    verdict: Verdict | None = None,
    *,
    title: str = "tracekit report",
    plotly_js: str | None = None,
    whatif_section: str = "",
) -> str:
    """The whole page as one string, runs in the order given. Without `verdict` the page
    has no verdict section. `whatif_section` (`tracekit.render.whatif.whatif_html`) goes
    right after the verdict. `plotly_js` overrides the inlined bundle (tests)."""
    if plotly_js is None:
        from plotly.offline import get_plotlyjs  # deferred: plotly only where the page inlines it

        plotly_js = get_plotlyjs()
    analyses = [r.analysis for r in runs]
    names = run_labels(analyses)
    labels = list(comparison.labels)
    causes = _causes(analyses)
    chart = _Charts()
    sections = [_title_section(title, comparison, len(analyses))]
    window = _window_section(analyses, names)
    if window:
        sections.append(window)
    if verdict is not None:
        sections.append(verdict_html(verdict))
    if whatif_section:
        sections.append(whatif_section)
    sections += _table_sections(analyses, names, labels, comparison)
    itl_time = _itl_time_section(runs, names, chart)
    if itl_time:
        sections.append(itl_time)
    sections.append(
        "<h2>ITL histogram by primary cause</h2>"
        + chart(
            "tk-hist",
            histogram_figure(analyses, names),
            "A gap's primary cause is its largest cause if that is at least 1 ms and 25% of "
            "the gap; otherwise it is clean. Pick the run in the menu; runs are not pooled.",
        )
    )
    sections.append(_tail_section(analyses, names, comparison, labels, causes, chart))
    sections.append(_over_time_section(runs, names, chart))
    sections.append(
        f"<h2>The ladder</h2>{chart('tk-ladder', ladder_figure(comparison))}"
        f"<h2>Forward pass in clean and tail gaps</h2>"
        f"{chart('tk-fwd', forward_share_figure(analyses, names))}"
        f"<h2>TTFT</h2>{chart('tk-ttft', ttft_figure(analyses, names))}"
    )
    sections.append(ttft_section(analyses, names, comparison, chart))
    sections.append(client_html([(n, a.client) for a, n in zip(analyses, names, strict=True)]))
    sections.append(spec_html([(n, a) for a, n in zip(analyses, names, strict=True)]))
    sections.append(tp_ranks_html(analyses, names))
    sections.append(evictions_html(analyses, names))
    sections.append(_worst_stalls_section(runs, names))
    legend = " ".join(swatch(c) for c in dict.fromkeys([*labels, *causes]))
    return _page(title, sections, legend, chart.figs, plotly_js)
