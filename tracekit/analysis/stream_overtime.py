"""The tail over time (`analyze --by`) of a long run read in slices, in bounded memory
(docs/reports.md, "Reading a long run in slices"; the rules: "The tail over time").

Each bucket's ITL percentiles are exact (`tracekit.analysis.quantiles.GroupQuantiles`: two
reads of the emissions, a sparse histogram per bucket), known before any slice is
partitioned; each slice then adds its own gaps' parts to their buckets' own tails (gaps
>= the bucket's p99) and counts the run's tail (gaps >= the run's p99) per bucket. The
rows equal `tracekit.analysis.overtime.over_time` of the whole run: counts and
percentiles exactly, tail shares to float rounding. Given a `mapper` (`-j N` or `--ray` of
one long run), the slices are partitioned by its workers, each task holding the p99s of
its own buckets; their sums are added here in slice order, so the rows are the same.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from tracekit.allocator import give_back_freed_memory
from tracekit.analysis.overtime import Bucket, bucket_of, check_bucket_count, over_time
from tracekit.analysis.quantiles import GroupQuantiles
from tracekit.analysis.stream import (
    DEFAULT_SLICE_EMISSIONS,
    Index,
    SliceTask,
    gap_lengths,
    index_pass,
    keep_gap_values,
    slice_partition,
    slice_tasks,
)
from tracekit.analysis.stream_index import index_pass_spread
from tracekit.analysis.stream_window import read_window
from tracekit.analysis.window import WindowOptions
from tracekit.attribution.itl import CLEAN, FIT_ALL_CAPTURED, NON_CAUSES
from tracekit.labels import partition_labels
from tracekit.log.slices import SlicedRun

#: runs `fn` on each item (a process pool's or Ray's map, results in order)
Mapper = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]


def over_time_sliced(
    parts_dir: str,
    width_s: float,
    *,
    path: str | None = None,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    max_inflate_mb: float | None = None,
    progress: Callable[[str], None] | None = None,
    mapper: Mapper | None = None,
) -> list[Bucket]:
    """`over_time` of the run in `parts_dir` (no window), read in slices. `mapper(fn,
    items)`: runs the index pass's parts and the slices (a process pool's or Ray's map,
    in order; by default one after the other here): the rows are the same."""
    say = progress or (lambda _msg: None)
    run = SlicedRun(parts_dir, max_inflate_mb=max_inflate_mb)
    if mapper is None:
        ix = index_pass(run, FIT_ALL_CAPTURED, say, spill=True)
    else:
        ix = index_pass_spread(run, FIT_ALL_CAPTURED, say, mapper, spill=True)
    keep_gap_values(run, ix)
    return over_time_of_index(run, ix, width_s, path=path or parts_dir,
                              max_emissions=max_emissions, mapper=mapper)  # fmt: skip


class BucketP99(NamedTuple):
    """The whole run's p99 of each bucket from `first` on (NaN: a bucket without gaps):
    a slice task's, of the buckets its own gaps can end in."""

    first: int
    p99: np.ndarray

    def of(self, b: int) -> float:
        return float(self.p99[b - self.first])

    def cut(self, lo: int, hi: int) -> BucketP99:
        """Buckets `lo`..`hi` (clipped to those held)."""
        lo = max(lo, self.first)
        return BucketP99(lo, self.p99[lo - self.first : max(hi - self.first + 1, 0)])


def _in_process(fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
    return (fn(x) for x in items)


def over_time_of_index(
    run: SlicedRun,
    ix: Index,
    width_s: float,
    *,
    path: str,
    max_emissions: int,
    mapper: Mapper | None = None,
) -> list[Bucket]:
    """`over_time_sliced` of a run whose index pass is made and whose gap values are kept
    (`keep_gap_values`, as `analyze_sliced` leaves its index)."""
    if ix.span_ticks is not None:  # refused before a bucket is counted, from the start
        lo, hi = (float(x) for x in run.secs(np.array(ix.span_ticks)))
        check_bucket_count(min(lo, 0.0), hi, width_s, path)
    run_p99 = ix.gaps.percentiles()[2]
    q, ends = _bucket_quantiles(run, ix, width_s)
    labels = tuple(partition_labels(ix.labels))
    names = (*(lb for lb in labels if lb not in NON_CAUSES), "clean")
    tail_parts: dict[int, Any] = {}
    tail_ms: dict[int, float] = {}
    tail_n: dict[int, int] = {}
    run_tail: dict[int, Any] = {}
    first, last = _bucket_range(run, ix, ends, width_s)
    p99s = BucketP99(first, np.array([q.percentiles(b)[1] if q.n(b) else math.nan
                                      for b in range(first, last + 1)]))  # fmt: skip
    tasks = (
        (t, _own_buckets(t, p99s, width_s)) for t in slice_tasks(run, ix, max_emissions, run_p99)
    )
    one = functools.partial(_slice_buckets, labels=labels, names=names, width_s=width_s)
    for got in (mapper or _in_process)(one, tasks):
        for bk, (parts, ms, n, counts) in got.items():
            tail_parts[bk] = tail_parts.get(bk, 0.0) + parts
            tail_ms[bk] = tail_ms.get(bk, 0.0) + ms
            tail_n[bk] = tail_n.get(bk, 0) + n
            run_tail[bk] = run_tail.get(bk, 0) + counts
        give_back_freed_memory()  # the slice's, kept by the analysis's allocator
    out = []
    for b in range(first, last + 1):
        n = q.n(b)
        qs = q.percentiles(b) if n else [math.nan] * 3
        t_ms = tail_ms.get(b, 0.0)
        shares = tail_parts.get(b, np.zeros(len(labels)))
        shares = shares / t_ms if t_ms > 0 else np.zeros(len(labels))
        counts = run_tail.get(b, np.zeros(len(names), dtype=np.int64))
        out.append(Bucket(
            run=path, start_s=b * width_s, end_s=(b + 1) * width_s, gaps=n,
            itl_p50=float(qs[0]), itl_p99=float(qs[1]), itl_p999=float(qs[2]),
            tail_gaps=tail_n.get(b, 0),
            tail_share={lb: float(v) for lb, v in zip(labels, shares, strict=True)},
            run_tail_gaps=int(counts.sum()),
            run_tail_count={nm: int(c) for nm, c in zip(names, counts, strict=True)},
        ))  # fmt: skip
    return out


def over_time_window(
    parts_dir: str,
    width_s: float,
    view: WindowOptions,
    *,
    path: str | None = None,
    max_inflate_mb: float | None = None,
) -> list[Bucket]:
    """`over_time` of the window `view` asks for, of the run in `parts_dir`: read from the
    parts the window needs (`read_window`), its run-tail counts against the whole run's
    exact p99 (from the index pass)."""
    wr = read_window(parts_dir, view, path=path, max_inflate_mb=max_inflate_mb,
                     run_percentiles=True)  # fmt: skip
    p99 = wr.index.gaps.percentiles()[2]
    return over_time(wr.log, wr.part, width_s, wr.window, run_p99=p99)


def _own_buckets(task: SliceTask, p99s: BucketP99, width_s: float) -> BucketP99:
    """The p99s of the buckets the gaps `task`'s slice owns can end in ([t_from, t_to))."""
    lo, hi = p99s.first, p99s.first + len(p99s.p99) - 1
    if math.isfinite(task.t_from_s):
        lo = max(lo, int(bucket_of(np.array([task.t_from_s]), width_s)[0]))
    if math.isfinite(task.t_to_s):
        hi = min(hi, int(bucket_of(np.array([task.t_to_s]), width_s)[0]))
    return p99s.cut(lo, hi)


def _slice_buckets(
    work: tuple[SliceTask, BucketP99],
    labels: tuple[str, ...],
    names: tuple[str, ...],
    width_s: float,
) -> dict[int, tuple[np.ndarray, float, int, np.ndarray]]:
    """One slice's own gaps by bucket: their own tail's parts (by `labels`), its time and
    gaps, and the run's tail by primary cause (by `names`); `work`: the slice and the
    whole run's p99 of its buckets. A function of its own, so the slice's log and
    partition are gone before the next slice is read (a worker sends back these)."""
    task, p99s = work
    p = slice_partition(task)[2]
    out: dict[int, tuple[np.ndarray, float, int, np.ndarray]] = {}
    if not len(p):
        return out
    k = bucket_of(p.t1_s, width_s)
    cols = [labels.index(lb) for lb in p.labels]
    to_run = np.array([names.index(n) for n in (*p.causes, "clean")], dtype=np.int64)
    prim = to_run[np.where(p.primary == CLEAN, len(p.causes), p.primary)]
    for b in np.unique(k).tolist():
        rows = np.flatnonzero(k == b)
        g = p.gap_ms[rows]
        tail = rows[g >= p99s.of(b)]
        parts = np.zeros(len(labels))
        parts[cols] = p.parts_ms[tail].sum(axis=0)
        counts = np.bincount(prim[rows[g >= task.p99]], minlength=len(names))
        out[b] = (parts, float(p.gap_ms[tail].sum()), len(tail), counts)
    return out


def _bucket_quantiles(
    run: SlicedRun, ix: Index, width_s: float
) -> tuple[GroupQuantiles, tuple[float, float]]:
    """Each bucket's exact ITL p50/p99/p99.9 (two reads of the emissions), and the
    earliest and latest gap end."""
    q = GroupQuantiles([50.0, 99.0, 99.9])
    lo, hi = math.inf, -math.inf
    for keep in (False, True):
        last = np.full(len(ix.last_tick), np.iinfo(np.int64).min)
        for i in range(len(run.parts)):
            em = run.read(i)["tables"].get("emissions")
            if em is None or not len(em):
                continue
            gap, t1 = gap_lengths(run, last, em)
            if not len(gap):
                continue
            (q.keep if keep else q.count)(bucket_of(t1, width_s), gap)
            lo, hi = min(lo, float(t1.min())), max(hi, float(t1.max()))
        if not keep:
            q.wanted()
    return q, (lo, hi)


def _bucket_range(
    run: SlicedRun, ix: Index, ends: tuple[float, float], width_s: float
) -> tuple[int, int]:
    """`overtime._bucket_range` without a window, from the index pass."""
    lo, hi = (0.0, 0.0)
    if ix.span_ticks is not None:
        lo, hi = (float(x) for x in run.secs(np.array(ix.span_ticks)))
    if math.isfinite(ends[0]):
        lo, hi = min(lo, ends[0]), max(hi, ends[1])
    lo = min(lo, 0.0)
    first = int(bucket_of(np.array([lo]), width_s)[0])
    last = int(bucket_of(np.array([hi]), width_s)[0])
    return first, max(first, last)
