"""The HTML report's view of a long run read in slices, in bounded memory (docs/reports.md,
"Reading a long run in slices"): the fields of `tracekit.render.html.ReportRun` equal to
the whole run's (`tracekit.analysis.workers.report_path`).

- `analysis`: `tracekit.analysis.stream.analyze_sliced`;
- `buckets`: `tracekit.analysis.stream_overtime.over_time_sliced` at the report's bucket
  width (`report_width_of_span_s` of the run's span from the index pass), none for a run
  shorter than `REPORT_MIN_BUCKETS` of them, as `report_buckets` does;
- `worst_stalls` and `series` (`tracekit.analysis.gaps.worst_stalls`, `itl_series`): the
  tail's threshold (the exact p99) and one read of the emissions counting each request's
  gaps and non-tail gaps, so every gap a slice partitions knows its place in the whole
  run's partition (gaps by request, then time: `emission_order`).
  Each slice then keeps its tail gaps (a few numbers each: the page draws every one) and
  the non-tail gaps the even stride picks by their rank among all non-tail gaps. The
  stall events are grouped from the tail gaps of all slices at once (an event is the gaps
  closed by one step with one primary cause, so one may cross a slice's edge); the record
  of each of the `n` worst events' longest gap is made from its slice's partition, with
  the whole run's step numbers and request names.

Every reader takes `analyze_sliced`'s index pass (made once, its gap values kept), and so
does the what-if (`report_whatif_sliced`: `stream_whatif.whatif_of_index`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tracekit.allocator import give_back_freed_memory
from tracekit.analysis.gaps import add_steps, gap_records
from tracekit.analysis.overtime import (
    REPORT_MIN_BUCKETS,
    Bucket,
    bucket_of,
    report_width_of_span_s,
)
from tracekit.analysis.stream import (
    DEFAULT_SLICE_EMISSIONS,
    Index,
    SliceTask,
    analyze_sliced,
    gap_lengths,
    index_pass,
    slice_partition,
    slice_tasks,
)
from tracekit.analysis.stream_overtime import over_time_of_index
from tracekit.analysis.stream_whatif import whatif_of_index
from tracekit.analysis.whatif import WhatIf
from tracekit.log.flush import TABLES
from tracekit.log.parts import merge_flushed
from tracekit.log.request_names import RequestNames
from tracekit.log.slices import SlicedRun

_EM = {c: TABLES["emissions"].index(c) for c in TABLES["emissions"]}
_GC = {c: TABLES["gc_pauses"].index(c) for c in TABLES["gc_pauses"]}
NO_TICK = np.iinfo(np.int64).min  # a request's last emission, before it has one
#: `itl_series`'s default: about this many points in the ITL-over-time chart
MAX_POINTS = 2500
#: `worst_stalls`' defaults: steps listed per stall, request ids per stall
MAX_STEPS, MAX_REQUESTS = 12, 24


def report_sliced(
    parts_dir: str,
    n_worst: int,
    *,
    path: str | None = None,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    max_inflate_mb: float | None = None,
    progress: Callable[[str], None] | None = None,
    max_points: int = MAX_POINTS,
) -> dict[str, Any]:
    """The report's view of the run in `parts_dir` (no window), read in slices: the fields
    of `ReportRun` (analysis, worst_stalls, series, buckets), equal to the whole run's
    (`max_points`: `itl_series`')."""
    return _report(parts_dir, n_worst, path=path, sizes=(max_emissions, max_points),
                   max_inflate_mb=max_inflate_mb, progress=progress)[0]  # fmt: skip


def report_whatif_sliced(
    parts_dir: str,
    n_worst: int,
    *,
    path: str | None = None,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    max_inflate_mb: float | None = None,
    progress: Callable[[str], None] | None = None,
    max_points: int = MAX_POINTS,
) -> tuple[dict[str, Any], WhatIf]:
    """`report_sliced`'s view and the run's what-if (`whatif_sliced`), from one index pass
    handed to each reader: the same page and the same what-if."""
    page, w = _report(parts_dir, n_worst, path=path, sizes=(max_emissions, max_points),
                      max_inflate_mb=max_inflate_mb, progress=progress, whatif=True)  # fmt: skip
    assert w is not None
    return page, w


def _report(
    parts_dir: str,
    n_worst: int,
    *,
    path: str | None,
    sizes: tuple[int, int],
    max_inflate_mb: float | None,
    progress: Callable[[str], None] | None,
    whatif: bool = False,
) -> tuple[dict[str, Any], WhatIf | None]:
    """The page's fields (and the what-if), every reader taking `analyze_sliced`'s index
    pass (its gap values kept: the run's p99 known) rather than making its own."""
    say = progress or (lambda _msg: None)
    shown = path or parts_dir
    max_emissions = sizes[0]
    held: list[tuple[SlicedRun, Index]] = []

    def indexer(run: SlicedRun, fit: str, said: Callable[[str], None], **kw: Any) -> Index:
        held.append((run, index_pass(run, fit, said, **kw)))
        return held[-1][1]

    analysis = analyze_sliced(parts_dir, max_emissions=max_emissions, indexer=indexer,
                              max_inflate_mb=max_inflate_mb, progress=say, path=shown)  # fmt: skip
    run, ix = held[0]
    give_back_freed_memory()  # what each reader freed, before the next one's slices
    stalls, series, span = _stalls_and_series(run, ix, n_worst, sizes)
    give_back_freed_memory()
    w = whatif_of_index(run, ix, path=shown, max_emissions=max_emissions, progress=say) if (
        whatif) else None  # fmt: skip
    width_s = report_width_of_span_s(*span)
    # from the one holding min(start, 0) to the one holding the last moment (every gap ends
    # inside the span): `over_time`'s buckets without a window
    first, last = bucket_of(np.array([min(span[0], 0.0), span[1]]), width_s).tolist()
    buckets: list[Bucket] = []
    if max(first, last) - first + 1 >= REPORT_MIN_BUCKETS:  # else the report shows none
        buckets = over_time_of_index(run, ix, width_s, path=shown, max_emissions=max_emissions)
    page = {"analysis": analysis, "worst_stalls": stalls, "series": series, "buckets": buckets}
    return page, w


def _stalls_and_series(
    run: SlicedRun, ix: Index, n_worst: int, sizes: tuple[int, int]
) -> tuple[list[dict[str, Any]], dict[str, Any], tuple[float, float]]:
    """`worst_stalls` and `itl_series` of the whole run, and its span (s, `run_span_s`),
    from the index pass (its gap values kept), the tail's threshold and one partition of
    each slice."""
    p99 = ix.gaps.percentiles()[2]
    lo, hi = (0.0, 0.0)
    if ix.span_ticks is not None:
        lo, hi = (float(x) for x in run.secs(np.array(ix.span_ticks)))
    tail, points, tasks = _tail_and_points(run, ix, p99, sizes)
    stalls = _worst_stalls(run, (tail, tasks), ix.names, n_worst)
    return stalls, _series(run, ix, points), (lo, hi)


@dataclass
class _Gaps:
    """Some of the run's gaps, column by column: where each is in the whole run's partition
    (`idx`), which slice owns it, and what the page shows of it."""

    idx: list[np.ndarray] = field(default_factory=list)
    slice_: list[np.ndarray] = field(default_factory=list)
    request: list[np.ndarray] = field(default_factory=list)
    t1_s: list[np.ndarray] = field(default_factory=list)
    gap_ms: list[np.ndarray] = field(default_factory=list)
    step1: list[np.ndarray] = field(default_factory=list)
    primary: list[np.ndarray] = field(default_factory=list)

    def add(self, rows: np.ndarray, j: int, gidx: np.ndarray, cols: dict[str, np.ndarray]) -> None:
        self.idx.append(gidx[rows])
        self.slice_.append(np.full(len(rows), j, dtype=np.int64))
        for k, v in cols.items():
            getattr(self, k).append(v[rows])

    def column(self, k: str) -> np.ndarray:
        parts = getattr(self, k)
        if parts:
            return np.concatenate(parts)
        return np.zeros(0, dtype=object if k == "primary" else np.float64)


def _request_gaps(run: SlicedRun, ix: Index, p99: float) -> tuple[np.ndarray, np.ndarray]:
    """Per request, its gaps and its gaps below `p99` (the non-tail ones), from one read of
    the emissions (`gap_lengths`: the gaps in the order of a part's emissions sorted by
    request, then time)."""
    n = len(ix.last_tick)
    last = np.full(n, NO_TICK)
    n_gaps, n_rest = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for i in range(len(run.parts)):
        em = run.read(i)["tables"].get("emissions")
        if em is None or not len(em):
            continue
        rs = np.sort(em[:, _EM["request"]], kind="stable")
        head = np.ones(len(rs), dtype=bool)
        head[1:] = rs[1:] != rs[:-1]
        has = ~head | (last[rs] != NO_TICK)  # before `gap_lengths` moves `last` on
        gap = gap_lengths(run, last, em)[0]
        req = rs[has]
        n_gaps += np.bincount(req, minlength=n)
        n_rest += np.bincount(req[gap < p99], minlength=n)
    return n_gaps, n_rest


def _starts(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _rank_in_request(req: np.ndarray) -> np.ndarray:
    """Each row's place among the rows of its request (rows by request, then time)."""
    o = np.argsort(req, kind="stable")
    rs = req[o]
    first = np.searchsorted(rs, rs, side="left")
    out = np.empty(len(req), dtype=np.int64)
    out[o] = np.arange(len(req)) - first
    return out


def _tail_and_points(
    run: SlicedRun, ix: Index, p99: float, sizes: tuple[int, int]
) -> tuple[_Gaps, _Gaps, list[SliceTask]]:
    """Every slice partitioned once: its tail gaps (>= `p99`) and the other gaps the
    series' even stride picks (`itl_series`), each with its index in the whole run's
    partition (by request, then time: the request's gaps before this slice, and this
    slice's before it). `sizes`: the emissions a slice reads, the series' points."""
    max_emissions, max_points = sizes
    n_gaps, n_rest = _request_gaps(run, ix, p99)
    gap_start, rest_start = _starts(n_gaps), _starts(n_rest)
    n_other = int(n_rest.sum())
    room = max(max_points - (int(n_gaps.sum()) - n_other), 0)
    picks = np.arange(n_other)
    if n_other > room:
        picks = np.linspace(0, n_other - 1, room).astype(np.int64) if room else picks[:0]
    seen, rest_seen = np.zeros_like(n_gaps), np.zeros_like(n_rest)
    tail, points = _Gaps(), _Gaps()
    first_step = run.parts[0].first_step
    tasks = slice_tasks(run, ix, max_emissions, p99)
    for j, task in enumerate(tasks):
        p = slice_partition(task)[2]
        if not len(p):
            continue
        req = p.request.astype(np.int64)
        gidx = gap_start[req] + seen[req] + _rank_in_request(req)
        seen += np.bincount(req, minlength=len(seen))
        is_tail = p.gap_ms >= p99
        rest = np.flatnonzero(~is_tail)
        rank = rest_start[req[rest]] + rest_seen[req[rest]] + _rank_in_request(req[rest])
        rest_seen += np.bincount(req[rest], minlength=len(rest_seen))
        off = run.parts[task.c].first_step - first_step  # the slice's steps: from part c's
        cols = {"request": req, "t1_s": p.t1_s, "gap_ms": p.gap_ms,
                "step1": np.where(p.step1 >= 0, p.step1 + off, p.step1),
                "primary": p.primary_names()}  # fmt: skip
        tail.add(np.flatnonzero(is_tail), j, gidx, cols)
        hit = np.minimum(np.searchsorted(picks, rank), len(picks) - 1)
        chosen = rest[picks[hit] == rank] if len(picks) else rest[:0]
        points.add(np.sort(np.concatenate([np.flatnonzero(is_tail), chosen])), j, gidx, cols)
        del p, cols
        give_back_freed_memory()  # the slice's partition, before the next one's
    return tail, points, tasks


def _series(run: SlicedRun, ix: Index, points: _Gaps) -> dict[str, Any]:
    """`itl_series` of the whole run: the picked gaps in the partition's order, then by
    their end (stable), and the marks (every eviction, GC pauses of 1 ms or more)."""
    idx = points.column("idx")
    o = np.argsort(idx, kind="stable")
    t1 = points.column("t1_s")[o]
    by_t = np.argsort(t1, kind="stable")
    gc = np.concatenate(ix.gc) if ix.gc else np.zeros((0, len(_GC)), dtype=np.int64)
    gc_t0, gc_t1 = run.secs(gc[:, _GC["t0_tick"]]), run.secs(gc[:, _GC["t1_tick"]])
    gc_ms = (gc_t1 - gc_t0) * 1e3
    big = gc_ms >= 1.0  # `itl_series`' min_gc_ms
    marks = merge_flushed(run.meta, ix.sparse, path=run.parts_dir, retained=run.retained(0))
    return {
        "num_gaps": int(ix.gaps.n),
        "t_s": t1[by_t].tolist(),
        "gap_ms": points.column("gap_ms")[o][by_t].tolist(),
        "primary": points.column("primary")[o][by_t].tolist(),
        "evict_t_s": marks.evictions.t_evict_s.tolist(),
        "gc_t_s": gc_t0[big].tolist(),
        "gc_ms": gc_ms[big].tolist(),
        "gc_generation": gc[big, _GC["generation"]].tolist(),
    }


def _events(tail: _Gaps, n: int) -> list[np.ndarray]:
    """`stall_events` of the run's tail gaps, the `n` worst: rows of `tail` grouped by
    (closing step, primary cause), longest gap first (ties: the earlier in the whole run's
    partition); events by their longest gap, the same way."""
    idx, gap = tail.column("idx"), tail.column("gap_ms")
    if not len(idx) or n <= 0:
        return []
    _, code = np.unique(tail.column("primary").astype(str), return_inverse=True)
    key = tail.column("step1").astype(np.int64) * (int(code.max()) + 2) + code.ravel()
    order = np.lexsort((idx, -gap, key))
    starts = np.flatnonzero(np.r_[True, key[order][1:] != key[order][:-1]])
    groups = np.split(order, starts[1:])
    return sorted(groups, key=lambda g: (-float(gap[g[0]]), int(idx[g[0]])))[:n]


def _worst_stalls(
    run: SlicedRun, found: tuple[_Gaps, list[SliceTask]], names: RequestNames, n: int
) -> list[dict[str, Any]]:
    """`worst_stalls` of the whole run, from its tail gaps: each event's longest gap as a
    record (`gap_records`, `add_steps`; from its slice, one slice at a time), the requests
    it hit (longest gap first) and its shortest gap."""
    tail, tasks = found
    events = _events(tail, n)
    sl, req = tail.column("slice_"), tail.column("request")
    t1, gap = tail.column("t1_s"), tail.column("gap_ms")
    records: list[dict[str, Any]] = [{} for _ in events]
    for j in sorted({int(sl[g[0]]) for g in events}):
        mine = [k for k, g in enumerate(events) if int(sl[g[0]]) == j]
        heads = [int(events[k][0]) for k in mine]
        for k, rec in zip(mine, _head_records(run, tasks[j], names, req[heads], t1[heads],
                                              gap[heads]), strict=True):  # fmt: skip
            g = events[k]
            rec["num_requests"] = int(len(g))
            rec["requests"] = [names[int(r)] for r in req[g[:MAX_REQUESTS]].tolist()]
            rec["gap_ms_min"] = float(gap[g].min())
            records[k] = rec
        _steps_of(run, tasks[j], [records[k] for k in mine])
    return records


def _head_records(
    run: SlicedRun,
    task: SliceTask,
    names: RequestNames,
    req: np.ndarray,
    t1: np.ndarray,
    gap: np.ndarray,
) -> list[dict[str, Any]]:
    """`gap_records` of the gaps of `task`'s slice that end for request `req` at `t1`, `gap`
    long (the same gap: one request's emissions at one tick would make a second, 0 ms),
    with the whole run's step numbers and request names (the slice names those named
    before its first part ``(removed N)`` and numbers steps from that part's first)."""
    log, _, p = slice_partition(task)
    rows = [int(np.flatnonzero((p.request == r) & (p.t1_s == t) & (p.gap_ms == g))[0])
            for r, t, g in zip(req.tolist(), t1.tolist(), gap.tolist(), strict=True)]  # fmt: skip
    real = names.head(len(log.request_ids))  # the run's names: none made but those read
    recs = gap_records(replace(log, request_ids=real), p, index=np.array(rows, dtype=np.int64))
    off = run.parts[task.c].first_step - run.parts[0].first_step
    for rec in recs:
        rec["step0"], rec["step1"] = _step(rec["step0"], off), _step(rec["step1"], off)
        for piece in rec.get("preempt_causes", []) + rec.get("recompute_causes", []):
            if piece["step"] is not None:
                piece["step"] = _step(piece["step"], off)
    return recs


def _step(s: int, off: int) -> int:
    return s + off if s >= 0 else s


def _steps_of(run: SlicedRun, task: SliceTask, records: list[dict[str, Any]]) -> None:
    """`add_steps` of records whose gaps end in `task`'s slice, from the steps and segments
    of its parts and one part either side (a step's rows may be flushed a part from its
    emissions'), numbered as in the whole run."""
    c, b = max(task.c - 1, 0), min(task.b + 1, len(run.parts))
    log = run.log_of(c, b, tables=frozenset({"steps", "segments"}))
    add_steps(log, records, MAX_STEPS)
    off = run.parts[c].first_step - run.parts[0].first_step
    for rec in records:
        for st in rec["steps"]:
            st["step"] += off
