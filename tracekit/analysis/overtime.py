"""The tail over time: a run's gaps in buckets of fixed width (`analyze --by 1m`).

Rules (docs/reports.md, "The tail over time"): bucket k is ``[k*width, (k+1)*width)``
seconds from engine start; a gap belongs to the bucket its end (`t1_s`) lies in, so a gap
ending exactly on an edge belongs to the later bucket. Buckets run from the one holding
the run's start (or the window's FROM) to the one holding its last recorded moment (or the
window's TO, exclusive), the first and last cut to the window; a bucket without gaps is
listed with 0 gaps, never dropped. Every
gap keeps the whole run's partition (partition the whole run, then select).

Per bucket: its gaps; numpy's linear ITL p50/p99/p99.9 of its gaps; its own tail (gaps >=
the bucket's p99) with each label's share of that tail's time; and the run's tail (gaps >=
the whole run's p99) counted in the bucket, by primary cause.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.analysis.window import Window, run_span_s, select_gaps
from tracekit.attribution.itl import CLEAN, Partition
from tracekit.errors import UsageError
from tracekit.formats import json_safe
from tracekit.log.rawlog import RawLog

#: The most buckets one run lists (a day at 1 s is 86,400): a finer `--by` is refused in
#: one line before any bucket is computed, as their rows grow with the count, not the run.
MAX_BUCKETS = 100_000


def check_bucket_count(lo_s: float, hi_s: float, width_s: float, path: str) -> None:
    """Refuse (UsageError) a width that cuts ``[lo_s, hi_s]`` into more than `MAX_BUCKETS`
    buckets, naming the narrowest width that fits."""
    span = hi_s - lo_s
    if span / width_s + 1 > MAX_BUCKETS:
        raise UsageError(
            f"{path}: --by {width_s:g} s cuts the {span:.3f} s it lists into "
            f"{span / width_s + 1:,.0f} buckets; at most {MAX_BUCKETS:,}: give --by "
            f"{span / (MAX_BUCKETS - 1):.3g} or wider, or a --window"
        )


@dataclass(frozen=True, slots=True)
class Bucket:
    """One time bucket of a run (ms unless the name says otherwise; shares are fractions)."""

    run: str
    start_s: float
    end_s: float
    gaps: int
    itl_p50: float  # NaN: no gaps
    itl_p99: float
    itl_p999: float
    tail_gaps: int  # the bucket's own tail: its gaps >= its p99
    tail_share: dict[str, float]  # per label: its time in that tail / the tail's time
    run_tail_gaps: int  # the run's tail: gaps >= the whole run's p99, ending in the bucket
    run_tail_count: dict[str, int]  # the same by primary cause ("clean" last)

    def to_record(self) -> dict[str, Any]:
        """JSON-ready (NaN becomes null), in the fields' order."""
        return json_safe({
            "run": self.run, "bucket_start_s": self.start_s, "bucket_end_s": self.end_s,
            "gaps": self.gaps, "itl_p50": self.itl_p50, "itl_p99": self.itl_p99,
            "itl_p999": self.itl_p999, "tail_gaps": self.tail_gaps,
            "tail_share": dict(self.tail_share), "run_tail_gaps": self.run_tail_gaps,
            "run_tail_count": dict(self.run_tail_count),
        })  # fmt: skip


def bucket_of(t_s: np.ndarray, width_s: float) -> np.ndarray:
    """The bucket index of each time: k with ``k*width <= t < (k+1)*width``, the edges
    computed as written (so float rounding of ``t / width`` never moves a time across one)."""
    t = np.asarray(t_s, dtype=float)
    k = np.floor(t / width_s)
    k = np.where(t >= (k + 1) * width_s, k + 1, k)
    k = np.where(t < k * width_s, k - 1, k)
    return k.astype(np.int64)


def _bucket_range(
    log: RawLog, part: Partition, width_s: float, win: Window | None
) -> tuple[int, int]:
    """(first, last) bucket index to list (both included)."""
    lo, hi = run_span_s(log)
    if len(part):
        lo, hi = min(lo, float(part.t1_s.min())), max(hi, float(part.t1_s.max()))
    lo = min(lo, 0.0)  # from the run's start
    if win is not None and math.isfinite(win.t0_s):
        lo = win.t0_s
    if win is not None and math.isfinite(win.t1_s):
        hi = win.t1_s
    check_bucket_count(lo, hi, width_s, log.path)
    first = int(bucket_of(np.array([lo]), width_s)[0])
    if win is not None and math.isfinite(win.t1_s):  # the window's TO is not in it
        last = int(bucket_of(np.array([win.t1_s]), width_s)[0])
        if last * width_s >= win.t1_s:
            last -= 1
    else:
        last = int(bucket_of(np.array([hi]), width_s)[0])
    return first, max(first, last)


def over_time(
    log: RawLog,
    part: Partition,
    width_s: float,
    window: Window | None = None,
    *,
    run_p99: float | None = None,
) -> list[Bucket]:
    """The run's buckets of `width_s` seconds (module docstring), over `window` if given.
    `part`: the whole run's partition, or (with `run_p99`, the whole run's ITL p99) one
    holding at least every gap that ends in `window` (a window read in slices)."""
    if run_p99 is not None:
        whole_p99 = run_p99
    else:
        whole_p99 = float(np.percentile(part.gap_ms, 99.0)) if len(part) else math.nan
    first, last = _bucket_range(log, part, width_s, window)
    p = select_gaps(part, window)
    lo, hi = (window.t0_s, window.t1_s) if window is not None else (-math.inf, math.inf)
    k = bucket_of(p.t1_s, width_s)
    order = np.argsort(k, kind="stable")
    ks = np.arange(first, last + 1)
    bounds = np.searchsorted(k[order], np.concatenate([ks, [last + 1]]), side="left")
    names = (*p.causes, "clean")
    prim = np.where(p.primary == CLEAN, len(p.causes), p.primary)
    out = []
    for j, b in enumerate(ks.tolist()):
        rows = order[bounds[j] : bounds[j + 1]]
        g = p.gap_ms[rows]
        qs = np.percentile(g, [50.0, 99.0, 99.9]) if len(g) else [math.nan] * 3
        tail = rows[g >= qs[1]] if len(g) else rows
        tail_ms = float(p.gap_ms[tail].sum())
        shares = p.parts_ms[tail].sum(axis=0) / tail_ms if tail_ms > 0 else np.zeros(len(p.labels))
        run_tail = rows[g >= whole_p99]
        counts = np.bincount(prim[run_tail], minlength=len(names))
        out.append(
            Bucket(
                run=log.path, start_s=max(b * width_s, lo), end_s=min((b + 1) * width_s, hi),
                gaps=len(rows),
                itl_p50=float(qs[0]), itl_p99=float(qs[1]), itl_p999=float(qs[2]),
                tail_gaps=len(tail),
                tail_share={lb: float(v) for lb, v in zip(p.labels, shares, strict=True)},
                run_tail_gaps=len(run_tail),
                run_tail_count={n: int(c) for n, c in zip(names, counts, strict=True)},
            )
        )  # fmt: skip
    return out


#: bucket widths the HTML report picks from (s): the smallest that gives a run at most
#: `REPORT_MAX_BUCKETS` buckets
NICE_WIDTHS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
REPORT_MAX_BUCKETS = 60
#: a run is long enough for the report's over-time view from this many buckets on
REPORT_MIN_BUCKETS = 10


def report_width_s(log: RawLog, window: Window | None = None) -> float:
    """The bucket width of the report's over-time view of `log` (`NICE_WIDTHS_S`), or of
    the part of it `window` covers."""
    lo, hi = run_span_s(log)
    return report_width_of_span_s(lo, hi, window)


def report_width_of_span_s(lo: float, hi: float, window: Window | None = None) -> float:
    """`report_width_s` of a run that spans `lo`..`hi` seconds (`run_span_s`), known
    without its log (a run read in slices: from its index)."""
    lo = min(lo, 0.0)
    if window is not None:  # the window's span, within the run's
        lo, hi = max(lo, window.t0_s), min(hi, window.t1_s)
    span_s = max(hi - lo, 0.0)
    for w in NICE_WIDTHS_S:
        if span_s / w <= REPORT_MAX_BUCKETS:
            return float(w)
    return float(math.ceil(span_s / REPORT_MAX_BUCKETS / 86400) * 86400)


def report_buckets(
    log: RawLog, part: Partition, window: Window | None = None, *, run_p99: float | None = None
) -> list[Bucket]:
    """The report's over-time view: the run's (or the window's) buckets of
    `report_width_s`, or none for a span shorter than `REPORT_MIN_BUCKETS` of them.
    `part`: the whole run's partition (or, with `run_p99`, as `over_time` takes it)."""
    rows = over_time(log, part, report_width_s(log, window), window, run_p99=run_p99)
    return rows if len(rows) >= REPORT_MIN_BUCKETS else []


def worst_buckets(rows: list[Bucket], n: int = 5) -> list[Bucket]:
    """The `n` buckets with the highest ITL p99.9 (ties: the earlier), of those with gaps."""
    return sorted((b for b in rows if b.gaps), key=lambda b: (-b.itl_p999, b.start_s))[:n]


__all__ = [
    "MAX_BUCKETS",
    "NICE_WIDTHS_S",
    "REPORT_MAX_BUCKETS",
    "REPORT_MIN_BUCKETS",
    "Bucket",
    "bucket_of",
    "check_bucket_count",
    "over_time",
    "report_buckets",
    "report_width_of_span_s",
    "report_width_s",
    "worst_buckets",
]
