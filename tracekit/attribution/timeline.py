"""The elementary timeline the partitions are computed on (design.md, "The partition").

Every segment and GC pause boundary of a run cuts the host clock into elementary
intervals; each interval is owned by one *class* (a host cause, or ``gc``) by
`tracekit.labels.precedence`, or by none (``residual``). The ITL partition
(`tracekit.attribution.itl`), the TTFT partition (`tracekit.attribution.ttft`) and, through
the ITL partition, the client-boundary partition (`tracekit.attribution.client`) answer
"how much of class C lies in [a, b]" from the compensated cumulative sums of one
`Timeline`, so a window's parts carry float rounding of the window's size, not of the
run's length.

Also here, as the partitions share them: each segment's cause and timeline class, each
step's GC-free decode time and the graph baseline fitted to it (design.md rule 4), the
device windows' drift correction and the windows made disjoint (ITL rule 6), and the
loop thread's OS intervals with the share of each instant the OS took (docs/partition.md,
"OS evidence").

`PreparedRun` derives all of these once per run: `tracekit.analysis.figures.analyze`
builds one and hands it to the ITL, TTFT and client partitions, which build their own
when not given one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.labels import cause_of, precedence, segment_cause
from tracekit.log.osintervals import OsIntervals, intervals_of
from tracekit.log.rawlog import (
    GRAPH_EAGER,
    OS_SEGMENT_END,
    OS_SEGMENT_START,
    OS_STEP_END,
    OS_STEP_START,
    RawLog,
)


def segment_causes(log: RawLog) -> np.ndarray:
    """Cause name of each segment, as an object array."""
    names = np.array([segment_cause(lb, log.cause_map) for lb in log.labels] or [""], dtype=object)
    return names[log.segments.label] if len(log.segments) else np.zeros(0, dtype=object)


def compensated_cumsum(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Compensated prefix sums: ``hi + lo`` is the exact prefix sum to ~1e-32 relative.

    `np.cumsum` accumulates sequentially, so each prefix is ``fl(prev + v)``; TwoSum recovers
    each addition's rounding error, and those errors (tiny) are summed separately."""
    hi = np.empty(len(v) + 1)
    hi[0] = 0.0
    np.cumsum(v, out=hi[1:])
    a, s = hi[:-1], hi[1:]
    bb = s - a
    err = (a - (s - bb)) + (v - bb)
    lo = np.empty_like(hi)
    lo[0] = 0.0
    np.cumsum(err, out=lo[1:])
    return hi, lo


class Timeline:
    """Elementary intervals between all boundaries, each owned by one class."""

    def __init__(self, bounds: np.ndarray, owner: np.ndarray, graph_rate: np.ndarray) -> None:
        self.bounds = bounds  # m sorted unique times
        # owner/rate indexed by k + 1 for the interval [bounds[k], bounds[k+1]); 0 and m are
        # the open ends before the first and after the last boundary
        self.owner = owner
        self.graph_rate = graph_rate
        self.width = np.diff(bounds)
        self._cum: dict[Any, tuple[np.ndarray, np.ndarray]] = {}

    def integrals(self, cls: int | None, times: np.ndarray, k: np.ndarray | None = None):
        """Cumulative time owned by class `cls` (None: graph-rate weighted decode) at `times`.

        Returned as (hi, lo) pairs so differences keep full relative precision."""
        if k is None:
            k = np.searchsorted(self.bounds, times, side="right")  # interval index + 1
        rate = self.graph_rate if cls is None else (self.owner == cls).astype(np.float64)
        cached = self._cum.get(cls)
        if cached is None:
            # sums at the boundaries
            cached = self._cum[cls] = compensated_cumsum(self.width * rate[1:-1])
        hi, lo = cached
        # C(t) = C(bounds[j]) + (t - bounds[j]) * rate, j = k - 1; before the first boundary
        # (k = 0) it is measured back from bounds[0], so differences still hold
        j = np.maximum(k - 1, 0)
        hv = np.where(k > 0, hi[j], 0.0)
        lv = lo[j] * (k > 0) + (times - self.bounds[j]) * rate[k]
        return hv, lv

    def weighted(self, key: Any, w: np.ndarray, times: np.ndarray, k: np.ndarray):
        """Like `integrals`, of any rate `w` (indexed like `owner`); cached under `key`."""
        cached = self._cum.get(key)
        if cached is None:
            cached = self._cum[key] = compensated_cumsum(self.width * w[1:-1])
        hi, lo = cached
        j = np.maximum(k - 1, 0)
        hv = np.where(k > 0, hi[j], 0.0)
        lv = lo[j] * (k > 0) + (times - self.bounds[j]) * w[k]
        return hv, lv

    def class_integrals(self, n_cls: int, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Integrals of every class, residual (class `n_cls`) and the graph rate up to
        `times`, as (hi, lo) matrices with one column each in that order."""
        k = np.searchsorted(self.bounds, times, side="right")
        hl = [self.integrals(c, times, k) for c in [*range(n_cls + 1), None]]
        return np.column_stack([h for h, _ in hl]), np.column_stack([lo for _, lo in hl])


def coverage(bounds: np.ndarray, starts: np.ndarray, ends: np.ndarray, m: int) -> np.ndarray:
    """For each elementary interval (m - 1 of them), how many windows cover it."""
    d = np.bincount(np.searchsorted(bounds, starts), minlength=m + 1)[: m + 1].astype(np.int64)
    d -= np.bincount(np.searchsorted(bounds, ends), minlength=m + 1)[: m + 1]
    return np.cumsum(d)[: m - 1]


def host_classes(causes: np.ndarray, is_device: np.ndarray) -> list[tuple[str, bool]]:
    """Host timeline classes, highest precedence first (host causes + gc). Device windows
    are not on the timeline: they own time only in device-bound gaps (rule 6)."""
    return [(c, False) for c in precedence(set(causes[~is_device].tolist()))]


#: Host labels that mean "waiting for the device": the host is idle, not busy, in them.
DEVICE_WAIT_LABELS = frozenset({"wait", "sync"})


def is_os_wait(label: str) -> bool:
    """Whether the loop thread's time in `label` is off-CPU by what it is, so the OS rules
    explain off-CPU time by it first (docs/partition.md, "OS evidence"): a wait for the
    device (`DEVICE_WAIT_LABELS`), or the wait of a tensor-parallel step on its slowest
    rank, charged to that rank's cause (``rankR:CAUSE``, carved by `tracekit.log.merge`)."""
    head, sep, _ = label.partition(":")
    return label in DEVICE_WAIT_LABELS or (
        bool(sep) and head.startswith("rank") and head[4:].isdigit()
    )


def loop_threads(log: RawLog, emission_steps: np.ndarray) -> np.ndarray:
    """The thread that made each emission (ITL rule 6): the thread that recorded the
    emission's step, i.e. whose segments carry that step's index (the recorder gives a step
    index only to the loop thread's windows; the lowest such thread, if a hand-built log
    has several). An emission outside a step, or in a step with no segment, is the run's
    loop thread's: the thread most segments with a step index belong to (the lowest on a
    tie; thread 0, the thread that started, if none has)."""
    sg = log.segments
    own = sg.step >= 0
    n_steps = len(log.steps)
    fallback = 0
    if own.any():  # thread numbers may be large (up to 2**31 - 1): count the distinct ones
        ids, counts = np.unique(sg.thread[own], return_counts=True)
        fallback = int(ids[np.argmax(counts)])  # the first (lowest) of the most common
    per_step = np.full(n_steps + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(per_step, sg.step[own], sg.thread[own])
    per_step[per_step == np.iinfo(np.int64).max] = fallback
    s = np.asarray(emission_steps, dtype=np.int64)
    return per_step[np.where((s >= 0) & (s < n_steps), s, n_steps)]


def thread_busy(log: RawLog, bounds: np.ndarray, thread: int) -> np.ndarray:
    """For each interval of a timeline on `bounds` (indexed as `Timeline.owner`: k + 1 for
    [bounds[k], bounds[k+1]), the open ends at 0 and m), whether a host segment of `thread`
    other than a `wait`/`sync` covers it: that thread's own work (ITL rule 6). Every segment
    boundary must be one of `bounds`."""
    sg = log.segments
    mine = (sg.is_device == 0) & (sg.thread == thread)
    is_wait = [cause_of(lb, log.cause_map) in DEVICE_WAIT_LABELS for lb in log.labels]
    mine &= ~np.array([*is_wait, False], dtype=bool)[sg.label]
    m = len(bounds)
    busy = np.zeros(m + 1, dtype=bool)
    if m >= 2 and mine.any():
        busy[1:m] = coverage(bounds, sg.t_start_s[mine], sg.t_end_s[mine], m) > 0
    return busy


def decode_classes(classes: list[tuple[str, bool]]) -> list[int]:
    return [i for i, (c, _) in enumerate(classes) if c == "decode"]


def build_timeline(
    log: RawLog,
    classes: list,
    seg_cls: np.ndarray,
    frac: np.ndarray,
    extra_bounds: np.ndarray | None = None,
):
    """The host timeline of `log`; `extra_bounds` (OS interval ends) cut it further."""
    sg, gcp = log.segments, log.gc_pauses
    gc_cls = classes.index(("gc", False))
    starts = np.concatenate([sg.t_start_s, gcp.t_start_s])
    ends = np.concatenate([sg.t_end_s, gcp.t_end_s])
    cls = np.concatenate([seg_cls, np.full(len(gcp), gc_cls)])
    more = [] if extra_bounds is None else [extra_bounds]
    bounds = np.unique(np.concatenate([starts, ends, [0.0], *more]))  # never empty
    m = len(bounds)
    residual = len(classes)
    owner = np.full(m + 1, residual, dtype=np.int64)
    rate = np.zeros(m + 1)
    inner = owner[1:m]
    if m >= 2:
        for c in reversed(range(len(classes))):  # lowest precedence first, higher overwrite
            sel = cls == c
            if sel.any():
                inner[coverage(bounds, starts[sel], ends[sel], m) > 0] = c
        # graph rate where decode owns: the mean excess fraction of the decode windows of
        # the owning kind (device or host) that cover the interval
        for ci in decode_classes(classes):
            dec = seg_cls == ci
            if not dec.any():
                continue
            f = frac[np.maximum(sg.step[dec], 0)] * (sg.step[dec] >= 0)
            n = coverage(bounds, sg.t_start_s[dec], sg.t_end_s[dec], m)
            ws = np.bincount(np.searchsorted(bounds, sg.t_start_s[dec]), f, m + 1)[: m + 1]
            ws -= np.bincount(np.searchsorted(bounds, sg.t_end_s[dec]), f, m + 1)[: m + 1]
            fsum = np.cumsum(ws)[: m - 1]
            own = (inner == ci) & (n > 0)
            rate[1:m][own] = np.clip(fsum[own] / n[own], 0.0, 1.0)
    return Timeline(bounds, owner, rate)


def os_loop_thread(log: RawLog) -> int | None:
    """The thread whose OS samples are at step boundaries (the one with the most such
    samples, the lowest on a tie); None: no step samples."""
    os_ = log.os_samples
    step_rows = (os_.kind == OS_STEP_START) | (os_.kind == OS_STEP_END)
    if not step_rows.any():
        return None
    threads, counts = np.unique(os_.thread[step_rows], return_counts=True)
    return int(threads[np.argmax(counts)])


def os_intervals(log: RawLog) -> OsIntervals:
    """The loop thread's OS intervals (docs/partition.md, "OS evidence"): consecutive step
    samples of the thread that recorded them, in time order. An interval is used only
    where both samples have CPU time and run-queue wait (not -1) and the counters did not
    go back; its run-queue wait is at most its length, its off-CPU time is what is left
    after CPU time and run-queue wait (never negative)."""
    loop = os_loop_thread(log)
    if loop is None:
        z = np.zeros(0)
        return OsIntervals(z, z, z, z)
    os_ = log.os_samples
    step_rows = (os_.kind == OS_STEP_START) | (os_.kind == OS_STEP_END)
    return intervals_of(np.flatnonzero(step_rows & (os_.thread == loop)), log)


def side_os_intervals(log: RawLog) -> dict[int, OsIntervals]:
    """Every other thread's OS intervals (docs/partition.md, OS rule 7), by thread, lowest
    first: consecutive samples of a thread that samples at its segments' boundaries and is
    not the loop thread, used as `os_intervals` says."""
    os_ = log.os_samples
    seg_rows = (os_.kind == OS_SEGMENT_START) | (os_.kind == OS_SEGMENT_END)
    loop = os_loop_thread(log)
    out = {}
    for th in np.unique(os_.thread[seg_rows]).tolist():
        if th == loop:
            continue
        osi = intervals_of(np.flatnonzero(seg_rows & (os_.thread == th)), log)
        if len(osi):
            out[int(th)] = osi
    return out


def has_os_evidence(log: RawLog) -> bool:
    """Whether any OS interval is usable (then the partitions have the OS labels)."""
    return len(os_intervals(log)) > 0 or bool(side_os_intervals(log))


def os_bounds(
    log: RawLog, loop: OsIntervals | None = None, side: dict[int, OsIntervals] | None = None
) -> np.ndarray | None:
    """Every usable OS interval's ends (the timeline is cut there), or None. `loop`, `side`:
    the log's `os_intervals` and `side_os_intervals`, if already derived."""
    loop = os_intervals(log) if loop is None else loop
    side = side_os_intervals(log) if side is None else side
    all_ = [loop, *side.values()]
    ends = [np.concatenate([o.t0_s, o.t1_s]) for o in all_ if len(o)]
    return np.concatenate(ends) if ends else None


def side_owned(
    log: RawLog, tl: Timeline, seg_cls: np.ndarray, thread: int, loop: int | None = None
) -> np.ndarray:
    """Per interval of `tl` (indexed like its owner): whether its owner is a host segment
    class that a segment of `thread` covers there and no segment of the loop thread (`loop`:
    `os_loop_thread`, if already known) of the same class does (docs/partition.md, OS rule
    7: that thread's evidence applies)."""
    sg = log.segments
    bounds, m = tl.bounds, len(tl.bounds)
    if loop is None:
        loop = os_loop_thread(log)
    out = np.zeros(m + 1, dtype=bool)
    if m < 2:
        return out
    host = (sg.is_device == 0) & (seg_cls >= 0)
    inner = tl.owner[1:m]
    mine = host & (sg.thread == thread)
    for c in np.unique(seg_cls[mine]).tolist():
        sel = mine & (seg_cls == c)
        cov = (coverage(bounds, sg.t_start_s[sel], sg.t_end_s[sel], m) > 0) & (inner == c)
        lp = host & (seg_cls == c) & (sg.thread == loop)
        if lp.any():
            cov &= coverage(bounds, sg.t_start_s[lp], sg.t_end_s[lp], m) == 0
        out[1:m] |= cov
    return out


def os_shares(
    log: RawLog,
    tl: Timeline,
    classes: list[tuple[str, bool]],
    seg_cls: np.ndarray,
    run_os: PreparedRun | None = None,
):
    """Per elementary interval of `tl` (cut at `os_bounds`): the share of each instant that
    is `os_runqueue` and `os_blocked` (docs/partition.md, "OS evidence"): the loop thread's
    intervals' shares, except where another thread's segment owns the instant and that
    thread has an interval there (rule 7): then that thread's (the lowest such thread's).
    `run_os`: the log's prepared run, whose OS intervals are used instead of deriving them."""
    if run_os is None:
        loop_th, loop, side = os_loop_thread(log), os_intervals(log), side_os_intervals(log)
    else:
        loop_th, loop, side = run_os.os_thread, run_os.os_loop, run_os.os_side
    wait_cls = [i for i, (x, _) in enumerate(classes) if is_os_wait(x)]
    run, blk = os_rates(tl, loop, wait_cls)
    taken = np.zeros(len(tl.owner), dtype=bool)
    for th, osi in side.items():
        owned = side_owned(log, tl, seg_cls, th, loop_th) & ~taken
        r, b = os_rates(tl, osi, wait_cls, owned, key=("os_wait", th))
        at = owned & _inside(tl, osi)
        run[at], blk[at] = r[at], b[at]
        taken |= at
    return run, blk


def _inside(tl: Timeline, osi: OsIntervals) -> np.ndarray:
    """Per interval of `tl` (indexed like its owner): whether one of `osi` covers it."""
    m = len(tl.bounds)
    out = np.zeros(m + 1, dtype=bool)
    if m < 2 or not len(osi):
        return out
    left = tl.bounds[:-1]
    j = np.searchsorted(osi.t0_s, left, side="right") - 1
    out[1:m] = (j >= 0) & (left < osi.t1_s[np.maximum(j, 0)])
    return out


def os_rates(
    tl: Timeline,
    osi: OsIntervals,
    wait_cls: list[int],
    where: np.ndarray | None = None,
    key: Any = "os_wait",
):
    """Per elementary interval of `tl` (indexed like its owner; `tl` cut at every OS
    interval's ends): the share of each instant that is `os_runqueue` and `os_blocked`.
    Off-CPU time first goes to the interval's explicit waits (classes `wait_cls`, the
    `is_os_wait` labels: their time is off-CPU by what they are; with `where`, only those
    instants count as the thread's waits); what is left, and the run-queue wait, are
    spread over the rest of the interval. `key`: the cache key of the waits' integral."""
    m = len(tl.bounds)
    run = np.zeros(m + 1)
    blk = np.zeros(m + 1)
    if m < 2 or not len(osi):
        return run, blk
    left = tl.bounds[:-1]
    j = np.searchsorted(osi.t0_s, left, side="right") - 1
    inside = (j >= 0) & (left < osi.t1_s[np.maximum(j, 0)])
    jj = np.maximum(j, 0)
    width = osi.t1_s - osi.t0_s
    is_wait = np.isin(tl.owner, wait_cls)
    # the waits' time in each OS interval
    k0 = np.searchsorted(tl.bounds, osi.t0_s, side="right")
    k1 = np.searchsorted(tl.bounds, osi.t1_s, side="right")
    w_rate = (is_wait if where is None else is_wait & where).astype(np.float64)
    h0, l0 = tl.weighted(key, w_rate, osi.t0_s, k0)
    h1, l1 = tl.weighted(key, w_rate, osi.t1_s, k1)
    wait_s = np.clip((h1 - h0) + (l1 - l0), 0.0, width)
    rest = width - wait_s
    unexplained = np.maximum(osi.offcpu_s - wait_s, 0.0)
    b_rate = np.divide(unexplained, rest, out=np.zeros(len(rest)), where=rest > 0)
    # a thread in an explicit wait is blocked, not runnable: its run-queue wait lies in
    # the interval's other time too
    r_rate = np.divide(
        np.minimum(osi.runqueue_s, rest), rest, out=np.zeros(len(rest)), where=rest > 0
    )
    b_rate = np.minimum(b_rate, 1.0 - r_rate)
    run[1:m] = np.where(inside & ~is_wait[1:m], r_rate[jj], 0.0)
    blk[1:m] = np.where(inside & ~is_wait[1:m], b_rate[jj], 0.0)
    return run, blk


def os_class_integrals(tl: Timeline, n_cls: int, key: str, w: np.ndarray, times: np.ndarray):
    """Like `Timeline.class_integrals`, with every class's time weighted by the rate `w`
    (an `os_rates` share, indexed like the timeline's owner): the time the OS took from
    each class, residual and the graph rate, up to `times`. Cached under (`key`, class):
    one key per rate array."""
    k = np.searchsorted(tl.bounds, times, side="right")
    hl = []
    for c in [*range(n_cls + 1), None]:
        own = tl.graph_rate if c is None else (tl.owner == c).astype(np.float64)
        hl.append(tl.weighted((key, c), w * own, times, k))
    return np.column_stack([h for h, _ in hl]), np.column_stack([lo for _, lo in hl])


def decode_net_ms(log: RawLog, seg_causes: np.ndarray) -> np.ndarray:
    """Per step, GC-free decode ms: each decode segment minus its overlap with the GC union.
    A step with device decode windows is measured by them alone (device time; a host GC
    pause does not stretch it)."""
    sg, gcp = log.segments, log.gc_pauses
    net = np.zeros(len(log.steps))
    dec = (seg_causes == "decode") & (sg.step >= 0)
    if not dec.any():
        return net
    dev = dec & (sg.is_device == 1)
    if dev.any():
        np.add.at(net, sg.step[dev], (sg.t_end_s[dev] - sg.t_start_s[dev]) * 1e3)
        has_dev = np.zeros(len(log.steps), dtype=bool)
        has_dev[sg.step[dev]] = True
        dec &= ~has_dev[np.maximum(sg.step, 0)]
        if not dec.any():
            return net
    a, b = sg.t_start_s[dec], sg.t_end_s[dec]
    if len(gcp):
        bounds = np.unique(np.concatenate([gcp.t_start_s, gcp.t_end_s, a, b]))
        m = len(bounds)
        cov = coverage(bounds, gcp.t_start_s, gcp.t_end_s, m) > 0
        tl = Timeline(bounds, np.concatenate([[0], cov.astype(np.int64), [0]]), np.zeros(m + 1))
        h1, l1 = tl.integrals(1, b)
        h0, l0 = tl.integrals(1, a)
        gc_in = (h1 - h0) + (l1 - l0)
    else:
        gc_in = 0.0
    seg_ms = ((b - a) - gc_in) * 1e3
    # bincount adds in row order like np.add.at (the same sums), without its per-row cost;
    # net is 0.0 on every step this touches (steps with device windows were excluded)
    net += np.bincount(sg.step[dec], weights=seg_ms, minlength=len(net))
    return net


def device_windows(log: RawLog, causes: np.ndarray):
    """Device windows made disjoint across the whole run (sorted by start, the earlier start
    owns an overlap; a window left empty is dropped), so starts and ends both increase:
    (step, start, end, cause), plus each step's last device end (of its windows as
    recorded; -inf for a step without device windows)."""
    sg = log.segments
    dev = np.flatnonzero((sg.is_device == 1) & (sg.step >= 0))
    last_end = np.full(len(log.steps), -np.inf)
    np.maximum.at(last_end, sg.step[dev], sg.t_end_s[dev])
    o = dev[np.lexsort((sg.t_end_s[dev], sg.step[dev], sg.t_start_s[dev]))]
    step, a, b, c = sg.step[o], sg.t_start_s[o].copy(), sg.t_end_s[o], causes[o]
    if len(a) > 1 and np.any(a[1:] < np.maximum.accumulate(b)[:-1]):
        run_end = np.concatenate([[-np.inf], np.maximum.accumulate(b)[:-1]])
        a = np.minimum(np.maximum(a, run_end), b)
    keep = b > a
    return step[keep], a[keep], b[keep], c[keep], last_end


def prefix_sums(m: np.ndarray) -> np.ndarray:
    """Row prefix sums of `m` (a leading zero row), compensated column by column."""
    out = np.empty((len(m) + 1, m.shape[1]))
    for j in range(m.shape[1]):
        hi, lo = compensated_cumsum(m[:, j])
        out[:, j] = hi + lo
    return out


def segment_classes(log: RawLog, classes: list[tuple[str, bool]]) -> np.ndarray:
    """Timeline class of each segment (through its label: few labels, many segments);
    -1 for device windows and causes without a class."""
    index = {c: i for i, c in enumerate(classes)}
    label_cls = np.array(
        [index.get((segment_cause(lb, log.cause_map), False), -1) for lb in log.labels] + [-1],
        dtype=np.int64,
    )
    return np.where(log.segments.is_device == 1, -1, label_cls[log.segments.label])


# -- the graph baseline (design.md rule 4) and drift correction ----------------------------


@dataclass(frozen=True)
class GraphBaseline:
    """The captured-step decode line: ``decode_ms = slope_ms_per_row * rows + intercept_ms``.

    `eager_excess_frac[i]` is step i's fraction of GC-free decode time charged to `graph`
    (0 for steps that ran on a captured size or have no decode)."""

    slope_ms_per_row: float
    intercept_ms: float
    num_fit_steps: int
    eager_excess_frac: np.ndarray
    decode_net_ms: np.ndarray  # per step: GC-free decode ms (sum over its decode segments)


#: The graph baseline's fit, design.md's rule: every step that ran on a captured size,
#: including one whose whole decode lay inside a GC pause (a point at 0 ms).
FIT_ALL_CAPTURED = "all-captured"
#: The alternative: only captured steps with GC-free decode time left to measure. A captured
#: step whose decode fell entirely inside a GC pause measured nothing (its 0 ms is not a
#: decode time), yet as a point at 0 ms it pulls the line down and invents `graph` excess on
#: every eager step. docs/partition.md explains when the two differ.
FIT_MEASURED_CAPTURED = "measured-captured"
BASELINE_FITS = (FIT_ALL_CAPTURED, FIT_MEASURED_CAPTURED)


def drift_corrected(log: RawLog) -> RawLog:
    """The log with its device windows moved by the clock drift the device timer measured.

    The device timer places windows by chaining elapsed times from a calibration point;
    each chain ends at a fresh calibration (after an idle stretch, and at stop) that shows
    how far the chain had drifted by then (`meta["device_calibration"]["chains"]`). With
    a steady drift the error grows linearly along the chain, so a point at time t of a
    chain [start, end] that ended ``m`` ms off is moved back by ``m * (t - start) /
    (end - start)``.

    A window is moved as a whole by one chain: the chain its start lies in, the last that
    started at or before it, provided the start is no later than that chain's end as the
    chain placed it (``end + max(m, 0)``). Its end takes the same chain's correction even
    where the chain placed it past the chain's observed end (the last window before stop
    or before a re-anchor, with a clock running fast) or past the next chain's start. A
    window starting before the first chain or after a chain's placed end is left where it
    is (no chain placed it: the meta keeps the last 1,000 chains). A log without chains
    (or without device windows) is returned as is."""
    cal = log.meta.get("device_calibration")
    chains = cal.get("chains") if isinstance(cal, dict) else None
    sg = log.segments
    dev = sg.is_device == 1
    if not isinstance(chains, list) or not chains or not dev.any():
        return log
    try:
        c0 = np.array([float(c["start_host_s"]) for c in chains])
        c1 = np.array([float(c["end_host_s"]) for c in chains])
        m_s = np.array([float(c["predicted_minus_observed_ms"]) for c in chains]) * 1e-3
    except (KeyError, TypeError, ValueError):
        return log  # not written by tracekit's timer: leave the windows where they are
    ok = np.isfinite(c0) & np.isfinite(c1) & np.isfinite(m_s) & (c1 > c0)
    if not ok.any():
        return log
    c0, c1, m_s = c0[ok], c1[ok], m_s[ok]
    o = np.argsort(c0, kind="stable")
    c0, c1, m_s = c0[o], c1[o], m_s[o]

    a, b = sg.t_start_s.copy(), sg.t_end_s.copy()
    wa, wb = a[dev], b[dev]
    k = np.searchsorted(c0, wa, side="right") - 1  # the chain that started last before wa
    kk = np.maximum(k, 0)
    placed_end = c1[kk] + np.maximum(m_s[kk], 0.0)  # the chain's end where it placed it
    inside = (k >= 0) & (wa <= placed_end)
    span = c1[kk] - c0[kk]
    # the same chain for both ends; fractions past 1 (an end placed past the chain's
    # observed end) extrapolate the same steady drift
    frac_a = (wa - c0[kk]) / span
    frac_b = np.maximum((wb - c0[kk]) / span, frac_a)
    a[dev] = np.where(inside, wa - m_s[kk] * frac_a, wa)
    b[dev] = np.where(inside, wb - m_s[kk] * frac_b, wb)
    b[dev] = np.maximum(b[dev], a[dev])
    return replace(log, segments=replace(sg, t_start_s=a, t_end_s=b))


def fit_baseline(
    log: RawLog, decode_net_ms: np.ndarray, fit: str = FIT_ALL_CAPTURED
) -> GraphBaseline:
    """The captured-step line and every eager step's excess fraction (design.md rule 4).

    `fit`: which captured steps the line is fitted over, `FIT_ALL_CAPTURED` (design.md, the
    default) or `FIT_MEASURED_CAPTURED`."""
    st = log.steps
    return fit_baseline_steps(st.graph_size, st.num_decode, decode_net_ms, fit)


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The least-squares line of `y` on `x` (slope, intercept), from the centred sums: the
    line `np.polyfit(x, y, 1)` fits, in two temporaries the length of `x` (polyfit's
    least squares held ~6: ~220 MB over a day's 4.5 M steps)."""
    mx, my = float(x.mean()), float(y.mean())
    xc = x - mx
    slope = float(xc @ (y - my)) / float(xc @ xc)
    return slope, my - slope * mx


def fit_baseline_steps(
    graph_size: np.ndarray,
    num_decode: np.ndarray,
    decode_net_ms: np.ndarray,
    fit: str = FIT_ALL_CAPTURED,
) -> GraphBaseline:
    """`fit_baseline` from the steps' columns it reads (a run read in slices has those of
    every step, not its whole log)."""
    if fit not in BASELINE_FITS:
        raise ValueError(f"baseline fit {fit!r}: expected one of {', '.join(BASELINE_FITS)}")
    has_decode = decode_net_ms > 0
    # design.md: "over the steps that ran on a captured size" (graph_size > 0), whatever
    # their GC-free decode time
    captured = graph_size > 0
    if fit == FIT_MEASURED_CAPTURED:
        captured &= has_decode
    x = graph_size[captured].astype(np.float64)
    y = decode_net_ms[captured]
    if len(x) and x.min() != x.max():  # two captured sizes or more: least squares
        slope, icpt = _line(x, y)
    elif len(x) >= 1:  # one captured size: a flat line at its mean
        slope, icpt = 0.0, float(np.mean(y))
    else:
        slope, icpt = float("nan"), float("nan")
    frac = np.zeros(len(graph_size))
    eager = (graph_size == GRAPH_EAGER) & has_decode
    if np.isfinite(slope) and eager.any():
        net = decode_net_ms[eager]
        pred = slope * num_decode[eager] + icpt
        # at most all of it: a line extrapolated below zero cannot charge more than net
        frac[eager] = np.minimum(1.0, np.maximum(0.0, net - pred) / net)
    return GraphBaseline(
        slope_ms_per_row=float(slope),
        intercept_ms=float(icpt),
        num_fit_steps=int(captured.sum()),
        eager_excess_frac=frac,
        decode_net_ms=decode_net_ms,
    )


# -- one run, prepared once for every partition --------------------------------------------


class PreparedRun:
    """What the partitions of one run derive from its log, derived once: each segment's
    cause and timeline class, the host classes by precedence, the loop thread's and the
    other threads' OS intervals, each step's GC-free decode time, the graph baseline per
    fit, the host timeline per fit (cut at every OS interval's end) with its OS shares, the
    device windows made disjoint, and each loop thread's own work on the timeline.

    The ITL partition (`tracekit.attribution.itl.partition`), the TTFT partition
    (`tracekit.attribution.ttft.ttft_partition`) and the client-boundary partition
    (`tracekit.attribution.client.client_partition`, whose engine part is an ITL partition
    of a log with other emissions) take one as ``run=``, so analysing a run derives each
    of these once; each builds its own when not given one. It reads only the log's
    segments, GC pauses, steps, OS samples, labels, cause map and meta (`matches`: whether
    a log shares them); a partition's emissions, requests and evictions come from the log
    it is given. The ITL partition uses `corrected` (device windows moved by the measured
    clock drift); the TTFT partition this one, as recorded."""

    def __init__(self, log: RawLog) -> None:
        self.log = log
        self.causes = segment_causes(log)
        self.is_device = log.segments.is_device == 1
        self.classes = host_classes(self.causes, self.is_device)
        self.seg_cls = segment_classes(log, self.classes)
        self.os_thread = os_loop_thread(log)
        self.os_loop = os_intervals(log)
        self.os_side = side_os_intervals(log)
        self.has_os = len(self.os_loop) > 0 or bool(self.os_side)
        self.os_bounds = os_bounds(log, self.os_loop, self.os_side)
        self._net_ms: np.ndarray | None = None
        self._baselines: dict[str, GraphBaseline] = {}
        self._timelines: dict[str, Timeline] = {}
        # keyed by id() of a timeline this run built (kept alive in the value)
        self._shares: dict[int, tuple[Timeline, np.ndarray, np.ndarray]] = {}
        self._free: dict[tuple[int, int], tuple[Timeline, np.ndarray, Timeline]] = {}
        self._device: tuple | None = None
        # None: not asked yet; False: nothing to move (itself, held by no reference: a run
        # that refers to itself is a cycle that only the cyclic collector frees, and a
        # long run's slices piled up in it, GBs of slice logs between two collections)
        self._corrected: PreparedRun | bool | None = None

    def matches(self, log: RawLog) -> bool:
        """Whether `log` has the tables this run was prepared from (identity, not equality:
        a log made by `dataclasses.replace` of other tables shares them)."""
        mine = self.log
        return all(
            getattr(log, name) is getattr(mine, name)
            for name in ("segments", "gc_pauses", "steps", "os_samples", "labels",
                         "cause_map", "meta")
        )  # fmt: skip

    def corrected(self) -> PreparedRun:
        """The run with its device windows moved by the measured clock drift
        (`drift_corrected`); itself where there is nothing to move."""
        if self._corrected is None:
            log = drift_corrected(self.log)
            self._corrected = False if log is self.log else PreparedRun(log)
        return self._corrected if isinstance(self._corrected, PreparedRun) else self

    @property
    def decode_net_ms(self) -> np.ndarray:
        """Per step, GC-free decode ms (`decode_net_ms`)."""
        if self._net_ms is None:
            self._net_ms = decode_net_ms(self.log, self.causes)
        return self._net_ms

    def use_baseline(self, fit: str, base: GraphBaseline) -> None:
        """Take `base` as this run's baseline for `fit` (a slice of a run read in slices
        takes the whole run's, its rows cut to the slice's steps), before any timeline."""
        self._baselines[fit] = base
        self._timelines.pop(fit, None)

    def baseline(self, fit: str = FIT_ALL_CAPTURED) -> GraphBaseline:
        """The graph baseline fitted by `fit` (`fit_baseline`)."""
        base = self._baselines.get(fit)
        if base is None:
            base = self._baselines[fit] = fit_baseline(self.log, self.decode_net_ms, fit)
        return base

    def timeline(self, fit: str = FIT_ALL_CAPTURED, excess_frac: np.ndarray | None = None):
        """The host timeline, decode's graph rate from the baseline fitted by `fit`, or from
        each step's `excess_frac` where given (then built anew: not kept)."""
        if excess_frac is not None:
            return self._build(excess_frac)
        tl = self._timelines.get(fit)
        if tl is None:
            tl = self._timelines[fit] = self._build(self.baseline(fit).eager_excess_frac)
        return tl

    def _build(self, frac: np.ndarray) -> Timeline:
        return build_timeline(self.log, self.classes, self.seg_cls, frac, self.os_bounds)

    def os_shares(self, tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
        """`os_shares` of this run on `tl` (kept for a timeline `timeline` keeps)."""
        hit = self._shares.get(id(tl))
        if hit is not None and hit[0] is tl:
            return hit[1], hit[2]
        run, blk = os_shares(self.log, tl, self.classes, self.seg_cls, self)
        if any(t is tl for t in self._timelines.values()):
            self._shares[id(tl)] = (tl, run, blk)
        return run, blk

    def device_windows(self):
        """`device_windows` of this run."""
        if self._device is None:
            self._device = device_windows(self.log, self.causes)
        return self._device

    def without_own_work(self, tl: Timeline, thread: int) -> tuple[np.ndarray, Timeline]:
        """(`thread_busy` of `thread` on `tl`, and `tl` with that work taken out: its
        intervals owned by no class, at graph rate 0). Kept for a timeline `timeline`
        keeps, with the sums the second one caches."""
        hit = self._free.get((id(tl), thread))
        if hit is not None and hit[0] is tl:
            return hit[1], hit[2]
        busy = thread_busy(self.log, tl.bounds, thread)
        free = Timeline(tl.bounds, np.where(busy, -2, tl.owner), np.where(busy, 0.0, tl.graph_rate))
        if any(t is tl for t in self._timelines.values()):
            self._free[(id(tl), thread)] = (tl, busy, free)
        return busy, free


def prepared(log: RawLog, run: PreparedRun | None) -> PreparedRun:
    """`run` if it was prepared from `log`'s tables (`PreparedRun.matches`), else a new one."""
    return run if run is not None and run.matches(log) else PreparedRun(log)
