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
does the what-if (`report_whatif_sliced`: `stream_whatif.whatif_of_index`). Given a
`mapper` (`report -j N` or `--ray` of one long run), every pass's slices are partitioned
by its workers: the index pass's parts, the analysis's, the stall pass's (each slice's
gap columns, `slice_gaps`), the what-if's and the tail over time's; what each slice gives
back is folded here in slice order, so the page is the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from tracekit.allocator import give_back_freed_memory
from tracekit.analysis.gaps import add_steps, even_picks, gap_records, thin_marks, with_labels
from tracekit.analysis.overtime import (
    REPORT_MIN_BUCKETS,
    Bucket,
    bucket_of,
    report_width_of_span_s,
)
from tracekit.analysis.stream import (
    DEFAULT_SLICE_EMISSIONS,
    Index,
    SliceRead,
    SliceTask,
    analyze_sliced,
    gap_lengths,
    index_pass,
    slice_partition,
    slice_tasks,
)
from tracekit.analysis.stream_index import index_pass_spread
from tracekit.analysis.stream_overtime import over_time_of_index
from tracekit.analysis.stream_whatif import whatif_of_index
from tracekit.analysis.whatif import WhatIf
from tracekit.labels import partition_labels
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
#: runs `fn` on each item (a process pool's or Ray's map, results in order)
Mapper = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]


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
    mapper: Mapper | None = None,
) -> tuple[dict[str, Any], WhatIf]:
    """`report_sliced`'s view and the run's what-if (`whatif_sliced`), from one index pass
    handed to each reader: the same page and the same what-if. `mapper(fn, items)`: runs
    the slices of every pass (see the module's docstring; by default one after the other
    here)."""
    page, w = _report(parts_dir, n_worst, path=path, sizes=(max_emissions, max_points),
                      max_inflate_mb=max_inflate_mb, progress=progress, whatif=True,
                      mapper=mapper)  # fmt: skip
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
    mapper: Mapper | None = None,
) -> tuple[dict[str, Any], WhatIf | None]:
    """The page's fields (and the what-if), every reader taking `analyze_sliced`'s index
    pass (its gap values kept: the run's p99 known) rather than making its own."""
    say = progress or (lambda _msg: None)
    shown = path or parts_dir
    max_emissions = sizes[0]
    held: list[tuple[SlicedRun, Index]] = []

    def indexer(run: SlicedRun, fit: str, said: Callable[[str], None], **kw: Any) -> Index:
        if mapper is None:
            held.append((run, index_pass(run, fit, said, **kw)))
        else:  # the parts read by the mapper's workers
            held.append((run, index_pass_spread(run, fit, said, mapper, **kw)))
        return held[-1][1]

    analysis = analyze_sliced(parts_dir, max_emissions=max_emissions, indexer=indexer,
                              max_inflate_mb=max_inflate_mb, progress=say, path=shown,
                              mapper=mapper)  # fmt: skip
    run, ix = held[0]
    give_back_freed_memory()  # what each reader freed, before the next one's slices
    stalls, series, span = _stalls_and_series(run, ix, n_worst, sizes, mapper or _in_process)
    give_back_freed_memory()
    w = whatif_of_index(run, ix, path=shown, max_emissions=max_emissions, progress=say,
                        mapper=mapper) if whatif else None  # fmt: skip
    width_s = report_width_of_span_s(*span)
    # from the one holding min(start, 0) to the one holding the last moment (every gap ends
    # inside the span): `over_time`'s buckets without a window
    first, last = bucket_of(np.array([min(span[0], 0.0), span[1]]), width_s).tolist()
    buckets: list[Bucket] = []
    if max(first, last) - first + 1 >= REPORT_MIN_BUCKETS:  # else the report shows none
        buckets = over_time_of_index(run, ix, width_s, path=shown, max_emissions=max_emissions,
                                     mapper=mapper)  # fmt: skip
    page = {"analysis": analysis, "worst_stalls": stalls, "series": series, "buckets": buckets}
    return page, w


def _in_process(fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
    return (fn(x) for x in items)


def _stalls_and_series(
    run: SlicedRun, ix: Index, n_worst: int, sizes: tuple[int, int], each: Mapper
) -> tuple[list[dict[str, Any]], dict[str, Any], tuple[float, float]]:
    """`worst_stalls` and `itl_series` of the whole run, and its span (s, `run_span_s`),
    from the index pass (its gap values kept), the tail's threshold, one partition of
    each slice, and one more of the slices that hold the worst stall events."""
    p99 = ix.gaps.percentiles()[2]
    lo, hi = (0.0, 0.0)
    if ix.span_ticks is not None:
        lo, hi = (float(x) for x in run.secs(np.array(ix.span_ticks)))
    heads, points, tasks = _tail_and_points(run, ix, (p99, n_worst), sizes, each)
    stalls = _worst_stalls(run, (heads, tasks, p99), ix, n_worst)
    return stalls, _series(run, ix, points, sizes[1]), (lo, hi)


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

    def earliest(self, k: int) -> _Gaps:
        """The `k` gaps of these that come first in the whole run's partition."""
        keep = np.sort(np.argsort(self.column("idx"), kind="stable")[: max(k, 0)])
        out = _Gaps()
        for name in ("idx", "slice_", "request", "t1_s", "gap_ms", "step1", "primary"):
            getattr(out, name).append(self.column(name)[keep])
        return out


#: rows of stall events added between two folds of `StallHeads` beyond twice those kept
HEAD_FOLD_ROWS = 65536
#: an event's head columns (`StallHeads`): its step and primary cause (the event), its longest
#: gap (length, place in the whole run's partition, slice, request, end) and the first and
#: last slice holding one of its gaps
_HEAD_COLS = ("step", "code", "gap", "idx", "slice_", "request", "t1", "first", "last")


@dataclass
class StallHeads:
    """The stall events of the tail gaps seen so far (docs/reports.md, "Worst stalls"): one
    row per event, its longest gap (ties: the earlier in the whole run's partition) and
    the slices holding its gaps, so that only those slices are read again for the worst
    events' other gaps. Rows a slice at a time, folded by event once they double."""

    cols: dict[str, list[np.ndarray]] = field(default_factory=lambda: {c: [] for c in _HEAD_COLS})
    codes: dict[str, int] = field(default_factory=dict)  # primary cause -> its number
    rows: int = 0
    folded: int = 0
    #: the worst events asked for: of the events no later slice can add a gap to, only
    #: the `keep` worst are kept (a day's tail has millions of events, ~70 bytes each)
    keep: int | None = None
    #: rows added between two folds, beyond twice those kept (what a fold bounds)
    fold_rows: int = 65536

    def add(self, j: int, step: np.ndarray, primary: np.ndarray, gap: np.ndarray,
            idx: np.ndarray, request: np.ndarray, t1: np.ndarray) -> None:  # fmt: skip
        """The events of slice `j`'s tail gaps (their whole-run steps and causes)."""
        code = np.array([self.codes.setdefault(str(c), len(self.codes)) for c in primary],
                        dtype=np.int64)  # fmt: skip
        jj = np.full(len(gap), j, dtype=np.int64)
        cols = {"step": step.astype(np.int64), "code": code, "gap": gap, "idx": idx,
                "slice_": jj, "request": request, "t1": t1, "first": jj, "last": jj}  # fmt: skip
        for c, v in _fold(cols).items():
            self.cols[c].append(v)
        self.rows += len(self.cols["step"][-1])
        if self.rows > 2 * self.folded + self.fold_rows:
            self.fold(j)

    def fold(self, now: int | None = None) -> dict[str, np.ndarray]:
        """One row per event: the rows so far folded (and returned). `now`: the slice
        last added; the events whose gaps all lie two slices before it or more (a step's
        gaps end within it: no later slice adds one; step -1's may come anywhere) are
        cut to the `keep` worst (the longest gap, ties: the earlier in the partition's
        order): those the run's worst can be."""
        if not self.cols["step"]:
            return {c: np.zeros(0) for c in _HEAD_COLS}
        folded = _fold({c: np.concatenate(v) for c, v in self.cols.items()})
        if now is not None and self.keep is not None:
            done = np.flatnonzero((folded["last"] < now - 1) & (folded["step"] >= 0))
            if len(done) > self.keep:
                worst = done[np.lexsort((folded["idx"][done], -folded["gap"][done]))]
                gone = np.zeros(len(folded["step"]), dtype=bool)
                gone[worst[self.keep :]] = True
                folded = {c: v[~gone] for c, v in folded.items()}
        self.cols = {c: [v] for c, v in folded.items()}
        self.rows = self.folded = len(folded["step"])
        return folded


def _fold(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows of events folded into one per event (step, code): the row of its longest gap
    (ties: the smallest `idx`), the smallest `first` and the largest `last`."""
    step, code = cols["step"], cols["code"]
    if not len(step):
        return cols
    order = np.lexsort((cols["idx"], -cols["gap"], code, step))
    s, c = step[order], code[order]
    starts = np.flatnonzero(np.r_[True, (s[1:] != s[:-1]) | (c[1:] != c[:-1])])
    out = {k: v[order][starts] for k, v in cols.items()}
    out["first"] = np.minimum.reduceat(cols["first"][order], starts)
    out["last"] = np.maximum.reduceat(cols["last"][order], starts)
    return out


def _request_gaps(
    run: SlicedRun, ix: Index, bounds: tuple[float, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request, its gaps and its gaps below `p99` (the non-tail ones), from one read of
    the emissions (`gap_lengths`: the gaps in the order of a part's emissions sorted by
    request, then time), and the run's `k` longest gaps' lengths (`bounds`: p99, k)."""
    p99, k = bounds
    n = len(ix.last_tick)
    last = np.full(n, NO_TICK)
    n_gaps, n_rest = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    top = np.zeros(0, dtype=np.float64)
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
        _count(n_gaps, req)  # the part's requests only: a day names ~3.9 M
        _count(n_rest, req[gap < p99])
        if k > 0:
            top = np.concatenate([top, gap[gap >= p99]])
            if len(top) > k:
                top = np.partition(top, len(top) - k)[len(top) - k :]
    return n_gaps, n_rest, top


def _count(counts: np.ndarray, req: np.ndarray) -> None:
    """Add each request's rows in `req` to `counts` (touching only those requests: a
    `bincount` the length of the run's requests, per part, made reading a day quadratic)."""
    u, k = np.unique(req, return_counts=True)
    counts[u] += k.astype(counts.dtype)


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


@dataclass
class _Picks:
    """Which gaps the series draws (`itl_series`' rule), by their rank in the whole run's
    partition: every tail gap when they fit (`tail` None), else the `worst` longest and an
    even stride over the tail (`tail`); an even stride over the others (`rest`)."""

    rest: np.ndarray
    tail: np.ndarray | None = None
    longer: float = math.inf  # a tail too long: the gaps longer than this are all worst
    ties: int = 0  # and this many of those equal to it, the earliest


def _picks(n_gaps: np.ndarray, n_rest: np.ndarray, top: np.ndarray, max_points: int) -> _Picks:
    n_tail = int(n_gaps.sum() - n_rest.sum())
    if n_tail <= max_points:
        return _Picks(rest=even_picks(int(n_rest.sum()), max_points - n_tail))
    worst = max_points // 2
    out = _Picks(rest=even_picks(0, 0), tail=even_picks(n_tail, max_points - worst))
    if worst > 0:  # `top`: the run's `worst` longest gaps
        out.longer = float(top.min())
        out.ties = worst - int((top > out.longer).sum())
    return out


def _chosen(picks: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Which of the gaps ranked `rank` an even stride `picks` (sorted) keeps."""
    if not len(picks):
        return np.zeros(len(rank), dtype=bool)
    hit = np.minimum(np.searchsorted(picks, rank), len(picks) - 1)
    return picks[hit] == rank


class SliceGaps(NamedTuple):
    """What the stall pass keeps of one slice's partition (`slice_gaps`, made where the
    slice is read: by a worker, with a mapper): its own gaps' requests (numbered as in
    the run), ends (s), lengths (ms), closing steps (numbered from the slice's first part)
    and primary causes (`primary` into `causes`, `CLEAN` -1: "clean")."""

    request: np.ndarray
    t1_s: np.ndarray
    gap_ms: np.ndarray
    step1: np.ndarray
    primary: np.ndarray
    causes: tuple[str, ...]

    def primary_names(self) -> np.ndarray:
        return np.array([*self.causes, "clean"], dtype=object)[self.primary]


def slice_gaps(task: SliceTask) -> SliceGaps:
    """One slice partitioned (`slice_partition`), and of it only its gaps' columns: the
    slice's log and partition are gone when this returns (a worker sends back these)."""
    read = slice_partition(task)
    p = read.p
    return SliceGaps(read.numbers[p.request], p.t1_s, p.gap_ms, p.step1, p.primary,
                     tuple(p.causes))  # fmt: skip


def _tail_and_points(
    run: SlicedRun,
    ix: Index,
    tail_of: tuple[float, int],
    sizes: tuple[int, int],
    each: Mapper,
) -> tuple[StallHeads, _Gaps, list[SliceTask]]:
    """Every slice partitioned once (by `each`, `slice_gaps`): its tail gaps' stall events
    (>= p99, `StallHeads`: the `n_worst` worst of those complete, and those still open;
    `tail_of`: p99, n_worst) and the gaps the series draws (`_Picks`), each with its
    index in the whole run's partition (by request, then time: the request's gaps before
    this slice, and this slice's before it). `sizes`: the emissions a slice reads, the
    series' points."""
    (p99, n_worst), (max_emissions, max_points) = tail_of, sizes
    n_gaps, n_rest, top = _request_gaps(run, ix, (p99, max_points // 2))
    pk = _picks(n_gaps, n_rest, top, max_points)
    # per request, where its gaps (all, the others, the tail's when thinned) start in the
    # whole run's partition and how many each slice has passed: a day's ~3 M requests
    # hold 8 + 4 bytes a kind each, the counts let go
    starts = {"gap": _starts(n_gaps), "rest": _starts(n_rest)}
    if pk.tail is not None:
        starts["tail"] = _starts(n_gaps - n_rest)
    n = len(n_gaps)
    del n_gaps, n_rest
    seen = {k: np.zeros(n, dtype=np.int32) for k in starts}  # a request's gaps < 2**31
    heads, points, ties = StallHeads(keep=n_worst, fold_rows=HEAD_FOLD_ROWS), _Gaps(), _Gaps()
    first_step = run.parts[0].first_step
    tasks = slice_tasks(run, ix, max_emissions, p99)

    def ranks(kind: str, req: np.ndarray) -> np.ndarray:
        out = starts[kind][req] + seen[kind][req] + _rank_in_request(req)
        _count(seen[kind], req)
        return out

    for j, g in enumerate(each(slice_gaps, tasks)):
        if not len(g.gap_ms):
            continue
        req = g.request
        gidx = ranks("gap", req)
        tail = np.flatnonzero(g.gap_ms >= p99)
        rest = np.flatnonzero(g.gap_ms < p99)
        off = run.parts[tasks[j].c].first_step - first_step  # the slice's steps: part c's on
        cols = {"request": req, "t1_s": g.t1_s, "gap_ms": g.gap_ms,
                "step1": np.where(g.step1 >= 0, g.step1 + off, g.step1),
                "primary": g.primary_names()}  # fmt: skip
        heads.add(j, cols["step1"][tail], cols["primary"][tail], g.gap_ms[tail], gidx[tail],
                  req[tail], g.t1_s[tail])  # fmt: skip
        drawn = [rest[_chosen(pk.rest, ranks("rest", req[rest]))]]
        if pk.tail is None:
            drawn.append(tail)
        else:
            gt = g.gap_ms[tail]
            drawn += [tail[_chosen(pk.tail, ranks("tail", req[tail]))], tail[gt > pk.longer]]
            if pk.ties:  # the earliest of those equal to the last worst one, so far
                ties.add(tail[gt == pk.longer], j, gidx, cols)
                ties = ties.earliest(pk.ties)
        points.add(np.unique(np.concatenate(drawn)), j, gidx, cols)
        del g, cols  # (two slices' columns at once were a day's peak)
        give_back_freed_memory()  # the slice's partition, before the next one's
    for k in ("idx", "slice_", "request", "t1_s", "gap_ms", "step1", "primary"):
        getattr(points, k).extend(getattr(ties, k))
    return heads, points, tasks


def _series(run: SlicedRun, ix: Index, points: _Gaps, max_points: int) -> dict[str, Any]:
    """`itl_series` of the whole run: the picked gaps (each once) in the partition's order,
    then by their end (stable), and the marks (evictions, GC pauses of 1 ms or more),
    thinned as `itl_series` thins them."""
    idx = points.column("idx")
    o = np.unique(idx, return_index=True)[1]  # by idx; a gap picked twice drawn once
    t1 = points.column("t1_s")[o]
    by_t = np.argsort(t1, kind="stable")
    gc = np.concatenate(ix.gc) if ix.gc else np.zeros((0, len(_GC)), dtype=np.int64)
    gc_t0, gc_t1 = run.secs(gc[:, _GC["t0_tick"]]), run.secs(gc[:, _GC["t1_tick"]])
    gc_ms = (gc_t1 - gc_t0) * 1e3
    big = np.flatnonzero(gc_ms >= 1.0)  # `itl_series`' min_gc_ms
    big = big[thin_marks(gc_t0[big], gc_ms[big], max_points)]
    marks = merge_flushed(run.meta, ix.sparse, path=run.parts_dir, retained=run.retained(0))
    evict_t_s = marks.evictions.t_evict_s
    return {
        "num_gaps": int(ix.gaps.n),
        "t_s": t1[by_t].tolist(),
        "gap_ms": points.column("gap_ms")[o][by_t].tolist(),
        "primary": points.column("primary")[o][by_t].tolist(),
        "evict_t_s": evict_t_s[thin_marks(evict_t_s, None, max_points)].tolist(),
        "gc_t_s": gc_t0[big].tolist(),
        "gc_ms": gc_ms[big].tolist(),
        "gc_generation": gc[big, _GC["generation"]].tolist(),
    }


def _worst_stalls(
    run: SlicedRun,
    found: tuple[StallHeads, list[SliceTask], float],
    ix: Index,
    n: int,
) -> list[dict[str, Any]]:
    """`worst_stalls` of the whole run: its `n` worst events (by their longest gap, ties:
    the earlier in the whole run's partition), each read again from the slices holding
    its gaps: its longest gap as a record (`gap_records` with the run's labels,
    `add_steps`), the requests it hit (longest gap first, then in the partition's order)
    and its shortest gap."""
    heads, tasks, p99 = found
    names, labels = ix.names, tuple(partition_labels(ix.labels))
    h = heads.fold()
    if n <= 0 or not len(h["step"]):
        return []
    top = np.lexsort((h["idx"], -h["gap"]))[:n]
    event = {(int(h["step"][e]), int(h["code"][e])): k for k, e in enumerate(top.tolist())}
    members: list[list[np.ndarray]] = [[] for _ in top]
    records: list[dict[str, Any]] = [{} for _ in top]
    spans = [range(int(h["first"][e]), int(h["last"][e]) + 1) for e in top.tolist()]
    wanted = sorted({j for span in spans for j in span})  # the slices holding their gaps
    for j in wanted:
        read = slice_partition(tasks[j])
        p = read.p
        off = run.parts[tasks[j].c].first_step - run.parts[0].first_step
        tail = np.flatnonzero(p.gap_ms >= p99)
        req = read.numbers[p.request]
        rank = _rank_in_request(req)[tail]
        step1 = np.where(p.step1 >= 0, p.step1 + off, p.step1)[tail]
        kinds, inv = np.unique(p.primary_names()[tail].astype(str), return_inverse=True)
        code = np.array([heads.codes.get(c, -1) for c in kinds.tolist()], dtype=np.int64)
        code = code[inv.ravel()] if len(tail) else np.zeros(0, dtype=np.int64)
        keys = zip(step1.tolist(), code.tolist(), strict=True)
        which = np.array([event.get(sc, -1) for sc in keys], dtype=np.int64)
        for e in np.unique(which[which >= 0]).tolist():
            r = np.flatnonzero(which == e)
            members[e].append(np.stack([p.gap_ms[tail[r]], req[tail[r]],
                                        np.full(len(r), j), rank[r]], axis=1))  # fmt: skip
        mine = [k for k, e in enumerate(top.tolist()) if int(h["slice_"][e]) == j]
        if mine:
            heads_here = [int(top[k]) for k in mine]
            recs = _head_records(run, (tasks[j], read), names, h["request"][heads_here],
                                 h["t1"][heads_here], h["gap"][heads_here])  # fmt: skip
            for k, rec in zip(mine, with_labels(recs, labels), strict=True):
                records[k] = rec
            _steps_of(run, tasks[j], [records[k] for k in mine])
        del read, p  # before the next slice's is read
    for k, rows in enumerate(members):
        m = np.concatenate(rows)  # gap, request, slice, rank: longest first, then the
        # partition's order (by request, then time: slice, then rank in the slice)
        m = m[np.lexsort((m[:, 3], m[:, 2], m[:, 1], -m[:, 0]))]
        records[k]["num_requests"] = int(len(m))
        records[k]["requests"] = [names[int(r)] for r in m[:MAX_REQUESTS, 1].tolist()]
        records[k]["gap_ms_min"] = float(m[:, 0].min())
        for key in ("num_steps", "steps"):  # last, as `worst_stalls` adds them
            records[k][key] = records[k].pop(key)
    return records


def _head_records(
    run: SlicedRun,
    read: tuple[SliceTask, SliceRead],
    names: RequestNames,
    req: np.ndarray,
    t1: np.ndarray,
    gap: np.ndarray,
) -> list[dict[str, Any]]:
    """`gap_records` of the gaps of a slice (`read`: its task, log and partition) that end
    for request `req` at `t1`, `gap` long (the same gap: one request's emissions at one
    tick would make a second, 0 ms), with the whole run's step numbers and request names
    (`names`, the index pass's: the slice's log does not name those named before its
    first part, and numbers steps from that part's first)."""
    task, (log, _, p, numbers, _) = read
    run_req = numbers[p.request]
    rows = [int(np.flatnonzero((run_req == r) & (p.t1_s == t) & (p.gap_ms == g))[0])
            for r, t, g in zip(req.tolist(), t1.tolist(), gap.tolist(), strict=True)]  # fmt: skip
    real = names.picked(numbers)  # the run's names: none made but those read
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
