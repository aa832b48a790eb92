"""A window of a long run read in bounded memory: only the parts its gaps and TTFTs need
(docs/reports.md, "Reading a long run in slices", "A window").

The index pass (`tracekit.analysis.stream`) gives the whole run's graph baselines, its
per-run figures, its longest gap and its ITL percentiles. The window's log is then the
parts its gaps and TTFTs reach back to (`tracekit.log.slices`), with every earlier part's
steps, requests and eviction rows (small: a few integers a step), so that steps keep their
numbers in the run and requests their names: the window's gaps, TTFTs, records and trace
are the whole run's, read from a fraction of it. A request whose first token came before
the window's first part is given no arrival there (its TTFT is not the window's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.analysis.figures import RunAnalysis, analyze
from tracekit.analysis.quantiles import ExactQuantiles
from tracekit.analysis.stream import (
    NEVER,
    TTFT_LABEL_GROUPS,
    Index,
    gap_lengths,
    index_pass,
    keep_gap_values,
    ordered,
    run_fields,
    whole_baselines,
)
from tracekit.analysis.window import DEFAULT_WIDTH_S, Window, WindowOptions, parse_window
from tracekit.attribution.itl import FIT_ALL_CAPTURED, NON_CAUSES, Partition, partition
from tracekit.attribution.reprefill import NEXT_EMISSION_META, next_emission
from tracekit.attribution.timeline import PreparedRun
from tracekit.attribution.ttft import TTFT_NON_CAUSES, TtftPartition, ttft_partition
from tracekit.errors import UsageError
from tracekit.labels import partition_labels
from tracekit.log.carried import with_carried
from tracekit.log.flush import TABLES, UNKNOWN_TICK
from tracekit.log.parts import merge_flushed
from tracekit.log.rawlog import RawLog
from tracekit.log.slices import SlicedRun

_REQ = TABLES["requests"].index("request")


@dataclass(frozen=True)
class WindowRead:
    """A window of a run read in slices: its log (the parts it needs), the partitions of
    that log (the whole run's for every gap and TTFT that ends in the window), the
    window, and what the index pass knew of the whole run."""

    log: RawLog
    part: Partition
    tpart: TtftPartition
    window: Window
    run: SlicedRun
    index: Index


def read_window(
    parts_dir: str,
    view: WindowOptions,
    *,
    path: str | None = None,
    baseline_fit: str = FIT_ALL_CAPTURED,
    max_inflate_mb: float | None = None,
    progress: Callable[[str], None] | None = None,
    run_percentiles: bool = False,
) -> WindowRead:
    """The window `view` asks for, of the run in `parts_dir` (`NotSliceable` where the
    folder must be read whole; `UsageError` for a window the run refuses).
    `run_percentiles`: also find the whole run's exact ITL percentiles (`index.gaps`)."""
    say = progress or (lambda _msg: None)
    run = SlicedRun(parts_dir, max_inflate_mb=max_inflate_mb)
    qs = _around_q(view)
    ix = index_pass(run, baseline_fit, say, light=True, extra_qs=qs, spill=run_percentiles)
    if run_percentiles:
        keep_gap_values(run, ix)
    win = _resolve(run, ix, view)
    n = len(run.parts)
    a = max([0, *[i for i in range(n) if _cut(run, i) <= win.t0_s]])
    b = next((i for i in range(a + 1, n) if _cut(run, i) >= win.t1_s), n)
    b = min(b + 1, n)  # the step running at the window's end: flushed with its tokens
    c = min(min(e.reaches_back_to for e in run.parts[a:b]), max(0, a - 1))
    c, b = _with_ttfts_across(run, ix, win, c, b)
    log = _window_log(run, ix, c, b, path or parts_dir)
    base_itl, base_ttft = whole_baselines(run, ix)
    m = len(log.steps)
    prep = PreparedRun(log)
    prep.use_baseline(FIT_ALL_CAPTURED, _first(base_ttft, m))
    prep.corrected().use_baseline(baseline_fit, _first(base_itl, m))
    part = partition(log, baseline_fit=baseline_fit, run=prep)
    tpart = ttft_partition(log, run=prep)
    return WindowRead(log, part, tpart, win, run, ix)


def _with_ttfts_across(run: SlicedRun, ix: Index, win: Window, c: int, b: int) -> tuple[int, int]:
    """Parts ``[c, b)`` widened to every TTFT that overlaps the window (a trace of the
    window shows it whole): from its request's arrival to its first token."""
    arr, first = ix.arrival_tick, ix.first_tick
    known = (arr != np.iinfo(np.int64).min) & (arr != UNKNOWN_TICK) & (first != NEVER)
    t_arr, t_first = run.secs(np.where(known, arr, 0)), run.secs(np.where(known, first, 0))
    across = np.flatnonzero(known & (t_arr <= win.t1_s) & (t_first >= win.t0_s))
    if not len(across):
        return c, b
    parts = ix.first_part[across]
    b = max(b, int(parts.max()) + 1)
    arrived = run.arrival_part[across]
    return min(c, int(arrived[arrived >= 0].min()) if (arrived >= 0).any() else c), b


def _cut(run: SlicedRun, i: int) -> float:
    """Where part `i`'s own gaps begin (seconds; -inf for the first part)."""
    return -math.inf if i == 0 else run.cut_s(i)


def _first(base: Any, m: int) -> Any:
    return replace(base, eager_excess_frac=base.eager_excess_frac[:m],
                   decode_net_ms=base.decode_net_ms[:m])  # fmt: skip


def _window_log(run: SlicedRun, ix: Index, c: int, b: int, path: str) -> RawLog:
    """Parts ``[c, b)`` whole, the parts before them light (steps, requests, evictions),
    with what the run's stop wrote (its config and warnings: a window of a run that stopped
    is no interrupted recording); requests whose first token came before part `c` lose
    their arrival here."""
    assert ix.light is not None
    early = np.flatnonzero((ix.first_part >= 0) & (ix.first_part < c))
    parts = []
    for i in range(b):
        p = ix.light[i].part() if i < c else run.read(i)
        rq = p["tables"].get("requests")
        if rq is not None and len(rq) and len(early):
            p = {**p, "tables": {**p["tables"], "requests": rq[~np.isin(rq[:, _REQ], early)]}}
        parts.append(p)
    parts[-1] = with_carried(parts[-1], run.carried_into(c, b))  # open windows' rows, later
    log = merge_flushed(run.meta, parts, path=path, retained=run.retained(0), final=run.final)
    log = replace(log, request_ids=ix.names.picked(np.arange(len(log.request_ids))))
    if b < len(run.parts):  # the run's wall time (an eviction never readmitted runs to it)
        tail = run.log_of(len(run.parts) - 1, len(run.parts), tables=frozenset(), final=True)
        log = replace(log, wall_s=tail.wall_s)
    return _as_the_run_says(run, ix, log)


def _as_the_run_says(run: SlicedRun, ix: Index, log: RawLog) -> RawLog:
    """`log` (the run's parts up to the window's) with what its later parts say of its
    evictions: each one's readmission (one in a later part is not "never readmitted": a
    trace draws the eviction to it), and its victim's first emission after it stated in
    the meta (`reprefill.NEXT_EMISSION_META`: whose re-prefill a step is needs it, and
    the window's log may hold neither the early parts' emissions nor the later parts').
    The index pass kept of every part its eviction rows and each readmitted victim's next
    emission (its sparse parts), in the run's request numbers, which the window's log
    keeps."""
    ev = log.evictions
    if not len(ev):
        return log
    sparse = merge_flushed(run.meta, ix.sparse, path=run.parts_dir, retained=run.retained(0))
    se = sparse.evictions
    run_readmit = {(r, t): x for r, t, x in zip(se.request.tolist(), se.t_evict_s.tolist(),
                                                se.t_readmit_s.tolist(), strict=True)}  # fmt: skip
    readmit = ev.t_readmit_s.copy()
    for i in np.flatnonzero(np.isnan(readmit)).tolist():  # open where the window's log ends
        readmit[i] = run_readmit.get((int(ev.request[i]), float(ev.t_evict_s[i])), np.nan)
    nxt = next_emission(sparse, ev.request, readmit).tolist()
    meta = {**log.meta, NEXT_EMISSION_META: [None if x != x else x for x in nxt]}
    return replace(log, evictions=replace(ev, t_readmit_s=readmit), meta=meta)


def _around_q(view: WindowOptions) -> tuple[float, ...]:
    """The percentile `--around pNN` asks for (none for worst or a window)."""
    if view.around is None or view.around == "worst":
        return ()
    m = re.fullmatch(r"p([0-9]+(?:\.[0-9]+)?)", view.around)
    if m is None or not 0 <= float(m.group(1)) <= 100:
        raise UsageError(f"--around {view.around!r}: expected worst or pNN (p99, p99.9)")
    return (float(m.group(1)),)


def _resolve(run: SlicedRun, ix: Index, view: WindowOptions) -> Window:
    """`WindowOptions.resolve` on the index pass's knowledge of the run."""
    if view.window is not None and view.around is not None:
        raise UsageError("--window and --around both given: pick one")
    if view.window is not None:
        started: Any = run.meta.get("started_unix_s")
        ok = isinstance(started, (int, float)) and math.isfinite(started)
        win = parse_window(view.window, float(started) if ok else None)
        lo, hi = _span_s(run, ix)
        if win.t0_s > hi or win.t1_s <= lo:
            raise UsageError(
                f"{run.parts_dir}: {win.how}: outside the run, which spans {lo:.3f}-{hi:.3f} s "
                "from engine start"
            )  # fmt: skip
        return win
    assert view.around is not None
    width = float(view.width_s) if view.width_s is not None else DEFAULT_WIDTH_S
    if not width > 0:
        raise UsageError(f"--width {width:g}: must be a positive number of seconds")
    if not ix.gaps.n:
        raise UsageError(f"--around {view.around}: the run has no gaps to centre a window on")
    gap, t = ix.worst if view.around == "worst" else _at_or_above(run, ix)
    how = f"--around {view.around}: a {gap:.1f} ms gap ending at {t:.3f} s, {width:g} s wide"
    return Window(t - width / 2, t + width / 2, how)


def _span_s(run: SlicedRun, ix: Index) -> tuple[float, float]:
    if ix.span_ticks is None:
        return 0.0, 0.0
    lo, hi = run.secs(np.array(ix.span_ticks))
    return float(lo), float(hi)


def _at_or_above(run: SlicedRun, ix: Index) -> tuple[float, float]:
    """The shortest gap at or above the run's pNN (`ix.extra`), the first to end of equal
    ones (`pick_gap`'s rule): its length and end, from one more read of the emissions."""
    q: ExactQuantiles = ix.extra
    q.wanted()
    last = np.full(len(ix.last_tick), np.iinfo(np.int64).min)
    for i in range(len(run.parts)):
        em = run.read(i)["tables"].get("emissions")
        if em is not None and len(em):
            q.keep(gap_lengths(run, last, em)[0])
    v = q.percentiles()[0]
    best = (math.inf, math.inf)
    last = np.full(len(ix.last_tick), np.iinfo(np.int64).min)
    for i in range(len(run.parts)):
        em = run.read(i)["tables"].get("emissions")
        if em is None or not len(em):
            continue
        gap, t1 = gap_lengths(run, last, em)
        at = gap >= v
        if at.any():
            g = float(gap[at].min())
            end = float(t1[at & (gap == g)].min())
            if (g, end) < best:
                best = (g, end)
    return best


def analyze_window(wr: WindowRead) -> RunAnalysis:
    """`analyze --window` of a run read in slices: the window's figures from its log, the
    per-run figures from the index pass (docs/reports.md, "Windows": which are which),
    labelled as the whole run is."""
    a = analyze(wr.log, wr.part, wr.tpart, window=wr.window)
    labels = tuple(partition_labels(wr.index.labels))
    names = (*(lb for lb in labels if lb not in NON_CAUSES), "clean")
    per_label = ("tail_share", "all_share", "evicted_context_ms")
    fields: dict[str, Any] = {k: _pad(getattr(a, k), labels, 0.0) for k in per_label}
    fields.update({k: _pad(getattr(a, k), names, 0) for k in ("tail_count", "all_count")})
    hist = [replace(h, by_primary=_pad(h.by_primary, names, 0)) for h in a.hist]
    ttft = a.ttft
    if ttft is not None:  # the TTFT figures under the whole run's TTFT labels
        t_labels = ordered(wr.index.ttft_labels, TTFT_LABEL_GROUPS)
        t_names = (*(lb for lb in t_labels if lb not in TTFT_NON_CAUSES), "clean")
        ttft = replace(
            ttft,
            tail_share=_pad(ttft.tail_share, t_labels, 0.0),
            all_share=_pad(ttft.all_share, t_labels, 0.0),
            # nonzero counts only, as `ttft_figures` writes them
            tail_count={k: ttft.tail_count[k] for k in t_names if ttft.tail_count.get(k)},
            all_count={k: ttft.all_count[k] for k in t_names if ttft.all_count.get(k)},
        )
    run = run_fields(wr.run, wr.index, a.path)
    return replace(a, labels=labels, hist=hist, ttft=ttft, **fields, **run)


def _pad(d: dict[str, Any], keys: tuple[str, ...], zero: Any) -> dict[str, Any]:
    return {k: d.get(k, zero) for k in keys}
