"""The what-if tables (docs/whatif.md): per run, every removal by both models; against a
ladder, each rung's prediction from the rung before it. Terminal, markdown and an HTML
section; pure rendering of `tracekit.analysis.whatif` results."""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence

from tracekit.analysis.compare import Comparison, Spread
from tracekit.analysis.fix_first import FixFirst
from tracekit.analysis.verdict import Verdict
from tracekit.analysis.victim_policy import VictimPolicy
from tracekit.analysis.whatif import (
    ASSUMPTIONS,
    FIGURE_NAMES,
    MODELS,
    LadderCheck,
    WhatIf,
    ranked,
)
from tracekit.errors import one_line
from tracekit.formats import num
from tracekit.render import text

HEADERS = {
    "itl_p50_ms": "p50",
    "itl_p99_ms": "p99",
    "itl_p999_ms": "p99.9",
    "itl_max_ms": "max",
    "ttft_p50_ms": "ttft p50",
    "ttft_p90_ms": "ttft p90",
    "ttft_p99_ms": "ttft p99",
}


def _cell(value: float, measured: float) -> str:
    if not math.isfinite(value):
        return "-"
    nd = 0 if abs(value) >= 100 else 1
    if not math.isfinite(measured) or measured == 0:
        return num(value, nd)
    ch = 100 * (value - measured) / measured
    return f"{num(value, nd)} ({ch:+.0f}%)" if abs(ch) >= 0.5 else f"{num(value, nd)} (=)"


def run_rows(w: WhatIf, models: Sequence[str] = MODELS) -> tuple[list[str], list[list[str]]]:
    """Header and rows: the run as measured, then each removal (by its second-order p99.9
    gain, largest first), one row per model."""
    head = ["removal", "kind", "model", *(HEADERS[k] for k in FIGURE_NAMES)]
    rows = [["(as measured)", "", "", *(_cell(w.measured[k], math.nan) for k in FIGURE_NAMES)]]
    for p2 in ranked(w):
        for model in models:
            p = w.get(p2.removal.name, model)
            if p is None:
                continue
            rows.append([
                p.removal.name, p.removal.kind, model,
                *(_cell(p.figures[k], w.measured[k]) for k in FIGURE_NAMES),
            ])  # fmt: skip
    return head, rows


def assumptions_lines(models: Sequence[str] = MODELS) -> list[str]:
    return [f"{m} order: {a}" for m in models for a in ASSUMPTIONS[m]]


def victim_policy_line(v: VictimPolicy) -> str:
    """The least-computed-victim estimate in one line (docs/whatif.md, "Victim policy")."""
    return (
        f"Victim policy (first order): evicting the least-computed running request at each "
        f"of the {v.num_decisions} recorded recompute decisions ({v.num_changed} would change "
        f"victim): recompute tax {num(100 * v.recompute_tax, 1)}% -> "
        f"{num(100 * v.policy_recompute_tax, 1)}% ({v.recomputed_tokens} -> "
        f"{v.policy_recomputed_tokens} recomputed tokens)"
    )


#: what stays the whole run's in a window's what-if (docs/whatif.md, "A window")
WINDOW_PER_RUN = (
    "each removal's timeline replayed over the whole run; the recompute tax: the whole run"
)


def whatif_table(runs: Sequence[WhatIf], models: Sequence[str] = MODELS, *, md=False) -> str:
    """`tracekit whatif`: one table per run, then the models' assumptions."""
    out = []
    for w in runs:
        name = os.path.basename(w.path)
        head, rows = run_rows(w, models)
        title = f"WHAT-IF  {name}  ({w.num_gaps} gaps; ms, change against the run as measured)"
        if w.window is not None:  # the prediction for the window's gaps and TTFTs
            title += "\n" + text.window_text(w.window, WINDOW_PER_RUN)
        if not w.predictions:
            title += "\n(no cause has time in this run's gaps or TTFTs: nothing to remove)"
        if md:  # removal names come from the log: literal text, one line each
            rows = [[text.md_text(c) for c in r[:3]] + r[3:] for r in rows]
            out.append(f"**{text.md_text(title)}**\n\n" + text.markdown_table(
                rows, head, "lll" + "r" * len(FIGURE_NAMES)))  # fmt: skip
        else:
            out.append(title + "\n" + text.table(rows, head, "lll" + "r" * len(FIGURE_NAMES)))
        if w.victim_policy is not None:
            out[-1] += "\n" + victim_policy_line(w.victim_policy)
    lines = assumptions_lines(models)
    if md:
        out.append("**ASSUMPTIONS**\n\n" + "\n".join(f"- {a}" for a in lines))
    else:
        out.append("ASSUMPTIONS\n" + "\n".join(f"- {a}" for a in lines))
    return "\n\n".join(out) + "\n"


def ladder_rows(checks: Sequence[LadderCheck]) -> tuple[list[str], list[list[str]]]:
    """Per rung, figure and model: predicted (from the rung before) vs measured, median
    [min-max] across runs, the error, and whether it lies outside the measured spread."""
    head = ["rung", "fixes", "figure", "model", "predicted", "measured", "error",
            "error by seed", "in spread"]  # fmt: skip
    rows = []
    for c in checks:
        nd = 0 if abs(c.measured.median) >= 100 else 1
        err = (
            f"{num(c.error_ms, nd)} ms ({100 * c.error_frac:+.0f}%)"
            if math.isfinite(c.error_frac)
            else "-"
        )
        rows.append([
            f"{c.from_key} -> {c.to_key}", c.fixes, HEADERS.get(c.figure, c.figure), c.model,
            text.spread_cell(c.predicted, nd), text.spread_cell(c.measured, nd), err,
            _pct_spread(c.paired_error_frac), "no: MISS" if c.is_outside_spread else "yes",
        ])  # fmt: skip
    return head, rows


def _pct_spread(s: Spread | None) -> str:
    if s is None or not s.num_runs:
        return "-"
    if s.num_runs == 1:
        return f"{100 * s.median:+.0f}%"
    return f"{100 * s.median:+.0f}% [{100 * s.lo:+.0f} to {100 * s.hi:+.0f}]"


def ladder_table(checks: Sequence[LadderCheck], *, md: bool = False) -> str:
    if not checks:
        return ""
    head, rows = ladder_rows(checks)
    title = (
        "WHAT-IF AGAINST THE LADDER  (each rung's fix predicted from the rung before it; "
        "median [min-max] across runs; MISS: the median prediction lies outside the measured "
        "runs' [min-max]; error by seed: the prediction from seed s against seed s's run, "
        "the same workload)"
    )
    if md:  # rung keys and the causes they fix come from the logs: literal text
        rows = [[text.md_text(c) for c in r[:4]] + r[4:] for r in rows]
        return f"**{text.md_text(title)}**\n\n" + text.markdown_table(rows, head, "llllrrrrl")
    return title + "\n" + text.table(rows, head, "llllrrrrl")


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _html_table(head: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    # cells stay on one line: a wide table scrolls inside its box instead of wrapping ranges
    # (a `cls` table may let some columns wrap: see report.css)
    klass = f" class={cls}" if cls else ""
    return (
        f'<div class=tw><table{klass} style="white-space:nowrap">'
        f"<thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>"
    )


def whatif_html(
    fixes: Sequence[FixFirst], group: str, runs: Sequence[WhatIf], checks: Sequence[LadderCheck]
) -> str:
    """The report's what-if section: the ranking of the first group's fixes, each run's
    table, the ladder check, and the models' assumptions."""
    head = ["fix", "family", "model", "p99.9 measured", "p99.9 without it", "gain", "ladder error"]
    rows = []
    for f in fixes:
        le = f.ladder_error_frac
        rows.append([
            f.name, f.family or "-", f.model, text.spread_cell(f.measured, 0),
            text.spread_cell(f.predicted, 0),
            f"{100 * f.gain_frac.median:.0f}% [{100 * f.gain_frac.lo:.0f}-"
            f"{100 * f.gain_frac.hi:.0f}%]",
            f"{_pct_spread(le)} ({f.ladder_basis}, {le.num_runs} rung"
            f"{'s' if le.num_runs != 1 else ''})" if le else "-",
        ])  # fmt: skip
    parts = [
        '<section id="tk-whatif"><h2>What to fix first (what-if)</h2>',
        f"<p class=note>Each cause's time taken out of {_e(group)}'s runs (docs/whatif.md): "
        "p99.9 by the second-order model (the recorded steps replayed without it), median "
        "[min-max] across runs; the ladder error is that model's p99.9 error on the rungs "
        "that fix this cause, or else a cause of its family.</p>",
        _html_table(head, rows),
    ]
    if checks:
        h, r = ladder_rows(checks)
        parts.append("<h3>Predicted against the ladder</h3>" + _html_table(h, r, "ladder"))
    for w in runs:
        h, r = run_rows(w)
        parts.append(
            f"<details><summary>{_e(os.path.basename(w.path))}: every removal, both models"
            f"</summary>{_html_table(h, r)}</details>"
        )
    items = "".join(f"<li>{_e(a)}</li>" for a in assumptions_lines())
    parts.append(f"<h3>Assumptions</h3><ul class=note>{items}</ul></section>")
    return "".join(parts)


def compare_text(cmp: Comparison, v: Verdict, checks: Sequence[LadderCheck], md: bool) -> str:
    """`tracekit compare`'s page (table or markdown): the comparison, the TTFT comparison,
    the ladder's checks, then the verdict and its caveats."""
    # sentences that quote group keys from the logs: literal text in either format
    inert = text.md_text if md else one_line
    lines = ["", "**VERDICT**" if md else "VERDICT", *(f"- {inert(f)}" for f in v.findings)]
    if v.caveats:
        lines += ["", "**CAVEATS**" if md else "CAVEATS"]
        lines += [f"- {inert(c)}" for c in v.caveats]
    tables = text.comparison_markdown(cmp) if md else text.comparison(cmp)
    if ttft_tables := text.ttft_comparison(cmp, markdown=md):
        tables += "\n\n" + ttft_tables
    if ladder := ladder_table(checks, md=md):
        tables += "\n\n" + ladder
    return tables + "\n" + "\n".join(lines) + "\n"
