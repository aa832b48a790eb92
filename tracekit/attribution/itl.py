"""The exclusive partition of every inter-token gap by cause (design.md, "The partition").

A *gap* is ``[t0, t1]`` between two consecutive emissions of one request. Every
millisecond of it goes to exactly one label:

1. while the request is evicted (eviction to readmission; a missing readmission runs to
   ``t1``), all of it is ``preempt``; what the engine ran meanwhile is *context*, never added
   (context is partitioned like live time, uncovered time as ``residual``, so it sums to
   the evicted time);
2. in the live windows, GC pauses (their union) own whatever they overlap: ``gc``;
3. each segment's GC-free overlap goes to its cause (``swap`` -> ``preempt``); where
   segments overlap each other, `tracekit.labels.precedence` decides, in one place;
4. ``decode`` time is split into ``graph`` (excess over a captured step) and ``forward``:
   a least-squares line of GC-free decode ms against the padded batch size, over the steps
   that ran on a captured size (all of them, a decode wholly inside a GC pause included,
   unless `FIT_MEASURED_CAPTURED` is asked for), predicts an eager step's decode time at
   its decode row count; the step's excess fraction ``max(0, net - pred) / net`` of its
   GC-free decode time ``net`` is charged to ``graph``, proportionally to the part inside
   the window;
5. whatever no segment or pause covers is ``residual``;
6. device work (segments recorded with ``is_device=1``: execution windows from CUDA events,
   mapped onto the host clock) is charged by the critical path. Device windows are made
   disjoint over the run (the earlier start owns an overlap). The emission that closes the
   gap read the results of one step (`Emissions.device_step`: the emitting step in a
   synchronous engine, the previous one under async scheduling). The device windows on the
   gap's path are those that ended no later than that step's device work (one in-order
   stream: that step's and every step queued before it, such as another request's
   prefill-only step in an engine that runs prefill and decode batches apart); work queued
   behind it is not. If the host was idle just before the read step's device work ended
   (no host window other than a `wait`/`sync` and no GC pause covers that instant: the
   host waited for the device), the gap is *device-bound* and those windows own their time
   ahead of every host window and GC pause; the host work they hid (launches, the CPU
   preparing the next step) is charged nothing. Otherwise the gap is *host-bound*: the
   host's windows keep their time, and the device windows own only the host-idle time
   inside them (the host waited for the device there; that time is not `residual`). The
   two readings differ only in the host-busy time inside the windows, so moving the windows
   by ``e`` moves at most ``4e`` per window plus twice that busy time (docs/gpu.md). A gap
   that contains an eviction of its request uses the host rules only (its evicted time is
   `preempt` either way).

Multi-token emissions (speculative decoding): a gap is between consecutive *emission
rows* of a request, i.e. consecutive steps that emitted for it; the tokens one step
emits together arrive at one time and add no gap of their own (as an engine's streaming
client sees them). `Emissions.num_tokens` still counts every token for throughput.

`partition` is the vectorised implementation: it builds one timeline of elementary
intervals between every segment and pause boundary, assigns each an owner by precedence,
and answers "how much of label L lies in [a, b]" for all gaps at once from compensated
cumulative sums (so a gap's parts carry float rounding of the gap's size, not of the run's
length). `partition_reference` computes the same thing with plain loops, gap by gap; the
tests check that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tracekit.errors import ReconcileError
from tracekit.labels import (
    NON_CAUSES,
    OS_BLOCKED,
    OS_LABELS,
    OS_RUNQUEUE,
    cause_of,
    partition_labels,
    precedence,
)
from tracekit.log.rawlog import GRAPH_EAGER, OS_STEP_END, OS_STEP_START, RawLog

#: A gap whose parts miss its length by more than this is a bug (float rounding is ~1e-12).
RECONCILE_TOL_MS = 1e-6
#: Primary cause thresholds (design.md): the largest cause, if >= 1 ms and >= 25% of the gap.
PRIMARY_MIN_MS = 1.0
PRIMARY_MIN_SHARE = 0.25
CLEAN = -1


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


@dataclass(frozen=True)
class Partition:
    """Every gap of a run, partitioned. Rows are gaps, sorted by request then time."""

    labels: tuple[str, ...]  # columns of parts_ms / context_ms
    request: np.ndarray  # request index (into RawLog.requests)
    t0_s: np.ndarray  # the earlier emission, engine clock seconds
    t1_s: np.ndarray  # the later emission
    step0: np.ndarray  # step index of each emission
    step1: np.ndarray
    gap_ms: np.ndarray  # (t1_s - t0_s) * 1e3
    parts_ms: np.ndarray  # (gaps, labels): exclusive, sums to gap_ms
    context_ms: np.ndarray  # (gaps, labels): engine activity while the request was evicted
    num_evictions: np.ndarray  # evictions of the request overlapping each gap
    primary: np.ndarray  # index into `causes`, or CLEAN (-1)
    causes: tuple[str, ...]  # the labels that can be a primary cause
    baseline: GraphBaseline
    warnings: tuple[str, ...] = field(default=())
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.gap_ms)

    @property
    def reconcile_err_ms(self) -> np.ndarray:
        """|gap - sum of parts| per gap (computed once, then kept)."""
        err = self._cache.get("err")
        if err is None:
            total = np.zeros(len(self.gap_ms))
            for j in range(self.parts_ms.shape[1]):  # column by column: contiguous in F order
                total += self.parts_ms[:, j]
            err = self._cache["err"] = np.abs(self.gap_ms - total)
        return err

    @property
    def reconcile_max_err_ms(self) -> float:
        return float(self.reconcile_err_ms.max()) if len(self) else 0.0

    def column(self, label: str) -> np.ndarray:
        return self.parts_ms[:, self.labels.index(label)]

    def primary_names(self) -> np.ndarray:
        names = np.array(list(self.causes) + ["clean"], dtype=object)
        return names[self.primary]  # CLEAN (-1) indexes "clean"


# -- shared pieces (used by both implementations) ----------------------------------------


def _emission_order(log: RawLog) -> np.ndarray:
    """Emission rows sorted by request, then time (then row order). Recorders append in
    time order, so the common case is one stable radix sort of the request column."""
    em = log.emissions
    t = em.t_s
    by_t = None if np.all(t[1:] >= t[:-1]) else np.argsort(t, kind="stable")
    req = em.request if by_t is None else em.request[by_t]
    if len(req) and 0 <= req.min() and req.max() < 65536:
        o = np.argsort(req.astype(np.uint16), kind="stable")  # radix sort
    else:
        o = np.argsort(req, kind="stable")
    return o if by_t is None else by_t[o]


def gaps_of(log: RawLog) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive emission pairs of each request: (request, t0, t1, step0, step1)."""
    em = log.emissions
    order = _emission_order(log)
    r, t, s = em.request[order], em.t_s[order], em.step[order]
    same = r[1:] == r[:-1]
    return r[1:][same], t[:-1][same], t[1:][same], s[:-1][same], s[1:][same]


def _time_ranks(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique sorted times, rank of each time among them)."""
    by_t = None if np.all(t[1:] >= t[:-1]) else np.argsort(t, kind="stable")
    ts = t if by_t is None else t[by_t]
    new = np.ones(len(ts), dtype=bool)
    new[1:] = ts[1:] > ts[:-1]
    rank = np.cumsum(new) - 1
    if by_t is not None:
        out = np.empty_like(rank)
        out[by_t] = rank
        rank = out
    return ts[new], rank


def segment_causes(log: RawLog) -> np.ndarray:
    """Cause name of each segment, as an object array."""
    names = np.array([cause_of(lb, log.cause_map) for lb in log.labels] or [""], dtype=object)
    return names[log.segments.label] if len(log.segments) else np.zeros(0, dtype=object)


def evicted_windows(log: RawLog) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each request's evictions as (request, start, end), overlapping ones merged.
    A missing readmission is +inf (it runs to the end of whatever gap it lies in)."""
    ev = log.evictions
    if len(ev) == 0:
        z = np.zeros(0)
        return z.astype(np.int64), z, z
    end = np.where(np.isnan(ev.t_readmit_s), np.inf, ev.t_readmit_s)
    order = np.lexsort((ev.t_evict_s, ev.request))
    r, a, b = ev.request[order], ev.t_evict_s[order], end[order]
    overlap = (r[1:] == r[:-1]) & (a[1:] <= b[:-1])
    if not overlap.any():
        return r, a, b
    rows: list[list[float]] = []
    for ri, ai, bi in zip(r.tolist(), a.tolist(), b.tolist(), strict=True):  # rare: odd logs only
        if rows and rows[-1][0] == ri and ai <= rows[-1][2]:
            rows[-1][2] = max(rows[-1][2], bi)
        else:
            rows.append([ri, ai, bi])
    m = np.array(rows, dtype=np.float64)
    return m[:, 0].astype(np.int64), m[:, 1], m[:, 2]


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
    a steady drift the error grows linearly along the chain, so a window at time t of a
    chain [start, end] that ended ``m`` ms off is moved back by ``m * (t - start) /
    (end - start)``. A log without chains (or without device windows) is returned as is."""
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

    def moved(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(c0, t, side="right") - 1  # the chain that started last before t
        kk = np.maximum(k, 0)
        inside = (k >= 0) & (t <= c1[kk])
        frac = np.clip((t - c0[kk]) / (c1[kk] - c0[kk]), 0.0, 1.0)
        return np.where(inside, t - m_s[kk] * frac, t)

    a, b = sg.t_start_s.copy(), sg.t_end_s.copy()
    a[dev], b[dev] = moved(a[dev]), moved(b[dev])
    b[dev] = np.maximum(b[dev], a[dev])
    return replace(log, segments=replace(sg, t_start_s=a, t_end_s=b))


def fit_baseline(
    log: RawLog, decode_net_ms: np.ndarray, fit: str = FIT_ALL_CAPTURED
) -> GraphBaseline:
    """The captured-step line and every eager step's excess fraction (design.md rule 4).

    `fit`: which captured steps the line is fitted over, `FIT_ALL_CAPTURED` (design.md, the
    default) or `FIT_MEASURED_CAPTURED`."""
    if fit not in BASELINE_FITS:
        raise ValueError(f"baseline fit {fit!r}: expected one of {', '.join(BASELINE_FITS)}")
    st = log.steps
    has_decode = decode_net_ms > 0
    # design.md: "over the steps that ran on a captured size" (graph_size > 0), whatever
    # their GC-free decode time
    captured = st.graph_size > 0
    if fit == FIT_MEASURED_CAPTURED:
        captured &= has_decode
    x = st.graph_size[captured].astype(np.float64)
    y = decode_net_ms[captured]
    if len(np.unique(x)) >= 2:
        slope, icpt = np.polyfit(x, y, 1)
    elif len(x) >= 1:  # one captured size: a flat line at its mean
        slope, icpt = 0.0, float(np.mean(y))
    else:
        slope, icpt = float("nan"), float("nan")
    frac = np.zeros(len(st))
    eager = (st.graph_size == GRAPH_EAGER) & has_decode
    if np.isfinite(slope) and eager.any():
        net = decode_net_ms[eager]
        pred = slope * st.num_decode[eager] + icpt
        # at most all of it: a line extrapolated below zero cannot charge more than net
        frac[eager] = np.minimum(1.0, np.maximum(0.0, net - pred) / net)
    return GraphBaseline(
        slope_ms_per_row=float(slope),
        intercept_ms=float(icpt),
        num_fit_steps=int(captured.sum()),
        eager_excess_frac=frac,
        decode_net_ms=decode_net_ms,
    )


def primary_of(
    parts_ms: np.ndarray,
    gap_ms: np.ndarray,
    labels: tuple[str, ...],
    non_causes: frozenset[str] | set[str] = NON_CAUSES,
):
    """Primary cause per gap (or per TTFT window): index into the returned causes, or
    CLEAN. `non_causes`: labels that are never a cause (`forward`, `residual`)."""
    cause_cols = [i for i, lb in enumerate(labels) if lb not in non_causes]
    causes = tuple(labels[i] for i in cause_cols)
    if len(gap_ms) == 0:
        return np.zeros(0, dtype=np.int64), causes
    c = parts_ms[:, cause_cols]
    best = np.argmax(c, axis=1)
    val = c[np.arange(len(c)), best]
    ok = (val >= PRIMARY_MIN_MS) & (val >= PRIMARY_MIN_SHARE * gap_ms)
    return np.where(ok, best, CLEAN).astype(np.int64), causes


def check_reconciled(p: Partition, path: str = "") -> Partition:
    """Raise `ReconcileError` if any gap's parts do not sum to it (prints both numbers)."""
    if len(p) == 0:
        return p
    err = p.reconcile_err_ms
    i = int(np.argmax(err))
    neg = p.parts_ms.min()
    if err[i] > RECONCILE_TOL_MS or neg < -RECONCILE_TOL_MS:
        raise ReconcileError(
            f"{path}: gap {i} (request {int(p.request[i])}, t0={p.t0_s[i]!r}) is "
            f"{p.gap_ms[i]!r} ms but its parts sum to {p.parts_ms[i].sum()!r} ms "
            f"(parts {dict(zip(p.labels, p.parts_ms[i].round(6).tolist(), strict=True))}; "
            f"most negative part {neg!r} ms)"
        )
    return p


# -- the vectorised partitioner ----------------------------------------------------------


def _cumsum2(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


class _Timeline:
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
            cached = self._cum[cls] = _cumsum2(self.width * rate[1:-1])  # sums at boundaries
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
            cached = self._cum[key] = _cumsum2(self.width * w[1:-1])
        hi, lo = cached
        j = np.maximum(k - 1, 0)
        hv = np.where(k > 0, hi[j], 0.0)
        lv = lo[j] * (k > 0) + (times - self.bounds[j]) * w[k]
        return hv, lv


def _coverage(bounds: np.ndarray, starts: np.ndarray, ends: np.ndarray, m: int) -> np.ndarray:
    """For each elementary interval (m - 1 of them), how many windows cover it."""
    d = np.bincount(np.searchsorted(bounds, starts), minlength=m + 1)[: m + 1].astype(np.int64)
    d -= np.bincount(np.searchsorted(bounds, ends), minlength=m + 1)[: m + 1]
    return np.cumsum(d)[: m - 1]


def _classes(causes: np.ndarray, is_device: np.ndarray) -> list[tuple[str, bool]]:
    """Host timeline classes, highest precedence first (host causes + gc). Device windows
    are not on the timeline: they own time only in device-bound gaps (rule 6)."""
    return [(c, False) for c in precedence(set(causes[~is_device].tolist()))]


#: Host labels that mean "waiting for the device": the host is idle, not busy, in them.
WAIT_LABELS = frozenset({"wait", "sync"})


@dataclass(frozen=True)
class OsIntervals:
    """What the OS did to the engine's loop thread between consecutive samples (step starts
    and ends): interval ``[t0_s, t1_s]`` held `runqueue_s` of run-queue wait and `offcpu_s`
    of other off-CPU time (blocked: I/O, locks, sleeps, page faults), both within it."""

    t0_s: np.ndarray
    t1_s: np.ndarray
    runqueue_s: np.ndarray
    offcpu_s: np.ndarray

    def __len__(self) -> int:
        return len(self.t0_s)


def os_intervals(log: RawLog) -> OsIntervals:
    """The loop thread's OS intervals (docs/partition.md, "OS evidence"): consecutive step
    samples of the thread that recorded them, in time order. An interval is used only
    where both samples have CPU time and run-queue wait (not -1) and the counters did not
    go back; its run-queue wait is at most its length, its off-CPU time is what is left
    after CPU time and run-queue wait (never negative)."""
    os_ = log.os_samples
    step_rows = (os_.kind == OS_STEP_START) | (os_.kind == OS_STEP_END)
    if not step_rows.any():
        z = np.zeros(0)
        return OsIntervals(z, z, z, z)
    threads, counts = np.unique(os_.thread[step_rows], return_counts=True)
    loop = threads[np.argmax(counts)]  # the thread that ran the steps
    sel = np.flatnonzero(step_rows & (os_.thread == loop))
    sel = sel[np.argsort(os_.t_s[sel], kind="stable")]
    t, cpu, runq = os_.t_s[sel], os_.cpu_ns[sel], os_.runqueue_ns[sel]
    t0, t1 = t[:-1], t[1:]
    d_cpu, d_runq = np.diff(cpu), np.diff(runq)
    ok = (cpu[:-1] >= 0) & (cpu[1:] >= 0) & (runq[:-1] >= 0) & (runq[1:] >= 0)
    ok &= (d_cpu >= 0) & (d_runq >= 0) & (t1 > t0)
    width = np.where(ok, t1 - t0, 0.0)
    rq = np.minimum(d_runq * 1e-9, width)
    off = np.maximum(width - d_cpu * 1e-9 - rq, 0.0)
    return OsIntervals(t0[ok], t1[ok], rq[ok], off[ok])


def _os_rates(tl: _Timeline, osi: OsIntervals, wait_cls: list[int]):
    """Per elementary interval of `tl` (indexed like its owner): the share of each instant
    that is `os_runqueue` and `os_blocked`. Off-CPU time first goes to the interval's
    explicit waits (`WAIT_LABELS`: their time is off-CPU by what they are); what is left is
    spread over the rest of the interval."""
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
    w_rate = is_wait.astype(np.float64)
    h0, l0 = tl.weighted("os_wait", w_rate, osi.t0_s, k0)
    h1, l1 = tl.weighted("os_wait", w_rate, osi.t1_s, k1)
    wait_s = np.clip((h1 - h0) + (l1 - l0), 0.0, width)
    rest = width - wait_s
    unexplained = np.maximum(osi.offcpu_s - wait_s, 0.0)
    b_rate = np.divide(unexplained, rest, out=np.zeros(len(rest)), where=rest > 0)
    r_rate = np.divide(osi.runqueue_s, width, out=np.zeros(len(width)), where=width > 0)
    b_rate = np.minimum(b_rate, 1.0 - r_rate)
    run[1:m] = np.where(inside, r_rate[jj], 0.0)
    blk[1:m] = np.where(inside & ~is_wait[1:m], b_rate[jj], 0.0)
    return run, blk


def _decode_classes(classes: list[tuple[str, bool]]) -> list[int]:
    return [i for i, (c, _) in enumerate(classes) if c == "decode"]


def _build_timeline(
    log: RawLog,
    classes: list,
    seg_cls: np.ndarray,
    frac: np.ndarray,
    extra_bounds: np.ndarray | None = None,
):
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
                inner[_coverage(bounds, starts[sel], ends[sel], m) > 0] = c
        # graph rate where decode owns: the mean excess fraction of the decode windows of
        # the owning kind (device or host) that cover the interval
        for ci in _decode_classes(classes):
            dec = seg_cls == ci
            if not dec.any():
                continue
            f = frac[np.maximum(sg.step[dec], 0)] * (sg.step[dec] >= 0)
            n = _coverage(bounds, sg.t_start_s[dec], sg.t_end_s[dec], m)
            ws = np.bincount(np.searchsorted(bounds, sg.t_start_s[dec]), f, m + 1)[: m + 1]
            ws -= np.bincount(np.searchsorted(bounds, sg.t_end_s[dec]), f, m + 1)[: m + 1]
            fsum = np.cumsum(ws)[: m - 1]
            own = (inner == ci) & (n > 0)
            rate[1:m][own] = np.clip(fsum[own] / n[own], 0.0, 1.0)
    return _Timeline(bounds, owner, rate)


def _decode_net_ms(log: RawLog, seg_causes: np.ndarray) -> np.ndarray:
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
        cov = _coverage(bounds, gcp.t_start_s, gcp.t_end_s, m) > 0
        tl = _Timeline(bounds, np.concatenate([[0], cov.astype(np.int64), [0]]), np.zeros(m + 1))
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


def _bisect_within(
    values: np.ndarray, lo: np.ndarray, hi: np.ndarray, x: np.ndarray, side: str
) -> np.ndarray:
    """Vectorised bisect of each x[i] in the sorted slice values[lo[i]:hi[i]] (global index)."""
    lo, hi = lo.copy(), hi.copy()
    while True:
        active = lo < hi
        if not active.any():
            return lo
        mid = (lo + hi) // 2
        v = values[np.minimum(mid, len(values) - 1)]
        go_right = (v <= x) if side == "right" else (v < x)
        go_right &= active
        lo = np.where(go_right, mid + 1, lo)
        hi = np.where(active & ~go_right, mid, hi)


def _evictions_per_gap(
    g_req: np.ndarray, g_t0: np.ndarray, g_t1: np.ndarray, e_req, e_a, e_b
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (gap index, window start, window end) of every eviction overlapping a gap,
    clipped to it. Gaps are sorted by (request, t0) and do not overlap within a request."""
    n_g, n_e = len(g_req), len(e_req)
    if n_g == 0 or n_e == 0:
        z = np.zeros(0)
        return z.astype(np.int64), z, z

    # each request's gaps are a contiguous run [lo, hi) of the (request, time)-sorted gaps
    lo = np.searchsorted(g_req, e_req, side="left")
    hi = np.searchsorted(g_req, e_req, side="right")
    # first gap with t1 > a (a gap ending exactly at the eviction does not overlap it)
    first = _bisect_within(g_t1, lo, hi, e_a, side="right")
    # last gap with t0 < b
    last = _bisect_within(g_t0, lo, hi, e_b, side="left") - 1
    n = np.maximum(last - first + 1, 0)
    gi = np.repeat(first, n) + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
    ei = np.repeat(np.arange(n_e), n)
    keep = g_req[gi] == e_req[ei]
    gi, ei = gi[keep], ei[keep]
    w0 = np.maximum(e_a[ei], g_t0[gi])
    w1 = np.minimum(e_b[ei], g_t1[gi])
    keep = w1 > w0
    return gi[keep], w0[keep], w1[keep]


def _device_windows(log: RawLog, causes: np.ndarray):
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


def _device_charges(
    log, causes, frac, tl, classes, to_labels, col, g_dstep, g_t0, g_t1, g_rank0, g_rank1, e_gap
):
    """What device windows take from the host labels and own (rule 6): rows of changes to
    add to parts (each row sums to 0), one per distinct (t0, t1, read step end); the gaps
    they touch; and for each of those gaps, its row.

    Memory is linear in windows + gaps: a gap's eligible windows are one run of the sorted
    disjoint windows (from the first ending after t0 to the last ending by the read step's
    end), so per-window changes are summed with prefix sums, and only the two windows a gap
    cuts are computed on their own."""
    n = len(g_t0)
    n_lab = to_labels.shape[1]
    step, a, b, c, last_end = _device_windows(log, causes)
    if len(step) == 0 or n == 0:
        z = np.zeros(0, dtype=np.int64)
        return np.zeros((0, n_lab)), z, z
    n_steps = len(log.steps)
    ok = (g_dstep >= 0) & (g_dstep < n_steps)
    read_end = np.where(ok, last_end[np.where(ok, g_dstep, 0)], -np.inf)
    e_end = np.minimum(read_end, g_t1)  # where the read step's device work ended (in the gap)
    active = np.isfinite(read_end) & (e_end > g_t0)
    active[e_gap] = False  # a gap with an eviction uses the host rules only
    # device-bound: the host was idle just before the read step's device work ended
    n_cls = len(classes)
    idle_cls = [i for i, (x, _) in enumerate(classes) if x in WAIT_LABELS] + [n_cls]
    k = np.searchsorted(tl.bounds, e_end, side="left")
    owner = tl.owner[np.clip(k, 0, len(tl.owner) - 1)]
    bound = np.isin(owner, idle_cls)
    # eligible windows of gap g: indices [lo, hi)
    lo = np.searchsorted(b, g_t0, side="right")  # first window ending after t0
    hi = np.minimum(
        np.searchsorted(b, read_end, side="right"),  # ... up to the read step's end
        np.searchsorted(a, g_t1, side="left"),  # ... starting before t1
    )
    active &= hi > lo

    # the label each window's time goes to: its cause; decode splits forward/graph
    lab = np.zeros((len(step), n_lab))
    is_dec = c == "decode"
    fr = frac[step]
    rows = np.arange(len(step))
    names, inv = np.unique(c[~is_dec].astype(str), return_inverse=True)  # few causes
    lab[rows[~is_dec], np.array([col[x] for x in names.tolist()], dtype=np.int64)[inv]] = 1.0
    lab[rows[is_dec], col["forward"]] = 1.0 - fr[is_dec]
    lab[rows[is_dec], col["graph"]] += fr[is_dec]
    idle_mask = np.zeros(n_cls + 2)
    idle_mask[idle_cls] = 1.0
    to_idle = to_labels * idle_mask[:, None]

    def charges(x0, x1, w):
        """Changes for window w's piece [x0, x1]: device-bound, the piece owns all of it;
        host-bound, only its host-idle time."""
        h0, l0 = _cumulative(tl, n_cls, x0)
        h1, l1 = _cumulative(tl, n_cls, x1)
        v = ((h1 - h0) + (l1 - l0)) * 1e3  # class integrals over the piece, ms
        full = v @ to_labels
        full_len = (x1 - x0) * 1e3
        idle = v @ idle_mask
        dev_bound = full_len[:, None] * lab[w] - full
        host_bound = idle[:, None] * lab[w] - v @ to_idle
        return dev_bound, host_bound

    d_all, h_all = charges(a, b, rows)
    pd, ph = _prefix(d_all), _prefix(h_all)
    g = np.flatnonzero(active)
    # gaps with the same (t0, t1, read step end) get the same changes: a batch's requests
    # share their emissions, so this computes one row per distinct gap, not per request
    # (key: the ranks of t0 and t1 among the emission times, and the read step)
    first, inv = _groups(g_rank0[g], g_rank1[g], g_dstep[g])
    u = g[first]  # one representative gap per distinct key
    ulo, uhi, ub, ut0, ut1 = lo[u], hi[u], bound[u], g_t0[u], g_t1[u]
    out = np.where(ub[:, None], pd[uhi] - pd[ulo], ph[uhi] - ph[ulo])
    # the windows a gap cuts: take back the parts outside [t0, t1]
    for sel, x0, x1, w in (
        (a[ulo] < ut0, a[ulo], ut0, ulo),
        (b[uhi - 1] > ut1, ut1, b[uhi - 1], uhi - 1),
    ):
        if sel.any():
            d_cut, h_cut = charges(x0[sel], x1[sel], w[sel])
            out[sel] -= np.where(ub[sel][:, None], d_cut, h_cut)
    return out, g, inv


def _groups(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows with equal non-negative integer columns: (first row of each group, group of
    each row). One packed int64 key when it fits, else a lexicographic sort."""
    n = len(cols[0])
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z
    cols = tuple(np.asarray(c, dtype=np.int64) + 1 for c in cols)  # -1 (none) becomes 0
    spans = [int(c.max()) + 1 for c in cols]
    if np.prod([float(x) for x in spans]) < 2.0**62:
        key = np.zeros(n, dtype=np.int64)
        for c, span in zip(cols, spans, strict=True):
            key = key * span + c
        _, first, inv = np.unique(key, return_index=True, return_inverse=True)
        return first, inv.reshape(-1)
    o = np.lexsort(cols[::-1])
    new = np.ones(n, dtype=bool)
    new[1:] = np.any([c[o][1:] != c[o][:-1] for c in cols], axis=0)
    inv = np.empty(n, dtype=np.int64)
    inv[o] = np.cumsum(new) - 1
    return o[new], inv


def _cumulative(tl: _Timeline, n_cls: int, times: np.ndarray):
    """Class integrals (every class, residual, graph rate) up to `times`, as (hi, lo)."""
    k = np.searchsorted(tl.bounds, times, side="right")
    hl = [tl.integrals(cl, times, k) for cl in [*range(n_cls + 1), None]]
    return np.column_stack([h for h, _ in hl]), np.column_stack([lo for _, lo in hl])


def _prefix(m: np.ndarray) -> np.ndarray:
    """Row prefix sums of `m` (a leading zero row), compensated column by column."""
    out = np.empty((len(m) + 1, m.shape[1]))
    for j in range(m.shape[1]):
        hi, lo = _cumsum2(m[:, j])
        out[:, j] = hi + lo
    return out


def partition(
    log: RawLog,
    *,
    check: bool = True,
    baseline_fit: str = FIT_ALL_CAPTURED,
    excess_frac: np.ndarray | None = None,
) -> Partition:
    """Partition every gap of `log` (vectorised). Raises `ReconcileError` if parts do not sum.

    `baseline_fit`: the graph baseline's fit (`BASELINE_FITS`; design.md's by default).
    `excess_frac`: each step's graph fraction to use instead of the fitted baseline's (a
    caller that settles `graph`/`forward` itself, as `tracekit.live` does; the parts are
    linear in it).
    Device windows are first corrected for the measured clock drift (`drift_corrected`)."""
    log = drift_corrected(log)
    causes = segment_causes(log)
    is_dev = log.segments.is_device == 1
    classes = _classes(causes, is_dev)
    cls_index = {c: i for i, c in enumerate(classes)}
    # class of each segment through its label (few labels, many segments); device: -1
    label_cls = np.array(
        [cls_index.get((cause_of(lb, log.cause_map), False), -1) for lb in log.labels] + [-1],
        dtype=np.int64,
    )
    seg_cls = np.where(is_dev, -1, label_cls[log.segments.label])
    osi = os_intervals(log)
    os_causes = set(OS_LABELS) if len(osi) else set()
    labels = tuple(
        partition_labels({c for c, _ in classes} | set(causes[is_dev].tolist()) | os_causes)
    )
    col = {lb: i for i, lb in enumerate(labels)}

    net = _decode_net_ms(log, causes)
    base = fit_baseline(log, net, baseline_fit)
    if excess_frac is not None:
        base = replace(base, eager_excess_frac=np.asarray(excess_frac, dtype=np.float64))
    os_bounds = np.concatenate([osi.t0_s, osi.t1_s]) if len(osi) else None
    tl = _build_timeline(log, classes, seg_cls, base.eager_excess_frac, os_bounds)

    # gaps, and each end's rank among the distinct emission times
    em = log.emissions
    order = _emission_order(log)
    r = em.request[order]
    pair = np.flatnonzero(r[1:] == r[:-1])  # gap k joins sorted rows pair[k], pair[k] + 1
    uniq_t, rank = _time_ranks(em.t_s)
    rank_o, step_o = rank[order], em.step[order]  # one gather per column, then slices
    a_idx, b_idx = rank_o[pair], rank_o[pair + 1]
    g_req = r[pair + 1]
    g_t0, g_t1 = uniq_t[a_idx], uniq_t[b_idx]
    g_s0, g_s1 = step_o[pair], step_o[pair + 1]
    n = len(g_req)

    # Class integrals as columns: every class, residual, then the graph-rate integral; the
    # matrix `to_labels` maps them linearly onto the partition's labels (decode -> forward,
    # graph-rate -> +graph -forward), so all arithmetic below is on small matrices.
    n_cls = len(classes)
    to_labels = np.zeros((n_cls + 2, len(labels)))
    for c, (name, _) in enumerate(classes):
        to_labels[c, col["forward" if name == "decode" else name]] = 1.0
    to_labels[n_cls, col["residual"]] = 1.0
    to_labels[n_cls + 1, col["graph"]] += 1.0
    to_labels[n_cls + 1, col["forward"]] -= 1.0

    def cumulative(times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = np.searchsorted(tl.bounds, times, side="right")
        hl = [tl.integrals(c, times, k) for c in [*range(n_cls + 1), None]]
        return np.column_stack([h for h, _ in hl]), np.column_stack([lo for _, lo in hl])

    def between(h0, l0, h1, l1) -> np.ndarray:
        return (((h1 - h0) + (l1 - l0)) @ to_labels) * 1e3

    hi_u, lo_u = cumulative(uniq_t)
    # between consecutive distinct emission times (most gaps are exactly one such interval)
    per_interval = between(hi_u[:-1], lo_u[:-1], hi_u[1:], lo_u[1:])
    # a zero row after the last interval, for zero-length gaps at the last emission time
    per_interval = np.vstack([per_interval, np.zeros((1, len(labels)))])
    one = b_idx == a_idx + 1
    # column-major: per-gap sums over labels (the reconcile check) add contiguous columns
    parts = np.empty((n, len(labels)), order="F")
    pick = a_idx
    for j in range(len(labels)):
        np.take(per_interval[:, j], pick, out=parts[:, j])
    many = np.flatnonzero(~one)
    if len(many):
        a, b = a_idx[many], b_idx[many]
        parts[many] = between(hi_u[a], lo_u[a], hi_u[b], lo_u[b])

    # evicted windows: preempt, and what ran meanwhile moves from the parts to the context
    e_req, e_a, e_b = evicted_windows(log)
    e_gap, w0, w1 = _evictions_per_gap(g_req, g_t0, g_t1, e_req, e_a, e_b)
    context = np.zeros((n, len(labels)), order="F")
    if len(e_gap):
        h0, l0 = cumulative(w0)
        h1, l1 = cumulative(w1)
        ran = between(h0, l0, h1, l1)
        np.subtract.at(parts, e_gap, ran)
        # all of it is context, `residual` included (time no engine activity covered while
        # the request was evicted), so a gap's context sums to its evicted time
        np.add.at(context, e_gap, ran)
        np.add.at(parts[:, col["preempt"]], e_gap, (w1 - w0) * 1e3)

    # device windows on the gap's critical path (rule 6)
    if is_dev.any():
        g_dstep = em.device_step[order][pair + 1]
        u_change, d_gap, inv = _device_charges(
            log, causes, base.eager_excess_frac, tl, classes, to_labels, col,
            g_dstep, g_t0, g_t1, a_idx, b_idx, e_gap,
        )  # fmt: skip
        moved = np.any(u_change != 0.0, axis=1)[inv]  # host-bound gaps often keep all
        d_gap, inv = d_gap[moved], inv[moved]
    else:
        d_gap = inv = np.zeros(0, dtype=np.int64)
    if len(d_gap):
        parts[d_gap] += u_change[inv]
        # gaps that share (t0, t1, read step) and no eviction have equal parts: one primary
        # cause per distinct gap
        rep = np.full(len(u_change), -1, dtype=np.int64)
        rep[inv] = d_gap
        has = rep >= 0
        prim_dev = np.full(len(u_change), CLEAN, dtype=np.int64)
        prim_dev[has] = primary_of(parts[rep[has]], (g_t1 - g_t0)[rep[has]] * 1e3, labels)[0]

    os_gap = np.zeros(0, dtype=np.int64)
    if len(osi) and n:
        wait_cls = [i for i, (x, _) in enumerate(classes) if x in WAIT_LABELS]
        run_rate, blk_rate = _os_rates(tl, osi, wait_cls)

        def os_loss(t_a: np.ndarray, t_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Per row, what the OS shares take from each label in [t_a, t_b]."""
            ka = np.searchsorted(tl.bounds, t_a, side="right")
            kb = np.searchsorted(tl.bounds, t_b, side="right")
            out = []
            for name, w in (("run", run_rate), ("blk", blk_rate)):
                cols = []
                for c in [*range(n_cls + 1), None]:
                    own = tl.graph_rate if c is None else (tl.owner == c).astype(np.float64)
                    h0, l0 = tl.weighted((name, c), w * own, t_a, ka)
                    h1, l1 = tl.weighted((name, c), w * own, t_b, kb)
                    cols.append((h1 - h0) + (l1 - l0))
                out.append((np.column_stack(cols) @ to_labels) * 1e3)
            return out[0], out[1]

        loss_run, loss_blk = os_loss(g_t0, g_t1)
        if len(e_gap):  # evicted time is all preempt: the OS takes no share of it
            ev_run, ev_blk = os_loss(w0, w1)
            np.subtract.at(loss_run, e_gap, ev_run)
            np.subtract.at(loss_blk, e_gap, ev_blk)
        if len(d_gap):  # the device's critical path charged these: the host's OS does not
            loss_run[d_gap] = 0.0
            loss_blk[d_gap] = 0.0
        os_gap = np.flatnonzero(np.any(loss_run != 0.0, axis=1) | np.any(loss_blk != 0.0, axis=1))
        parts -= loss_run + loss_blk
        parts[:, col[OS_RUNQUEUE]] += loss_run.sum(axis=1)
        parts[:, col[OS_BLOCKED]] += loss_blk.sum(axis=1)

    gap_ms = (g_t1 - g_t0) * 1e3
    # the primary cause of a one-interval gap with no eviction is its interval's
    widths_ms = np.append((uniq_t[1:] - uniq_t[:-1]) * 1e3, 0.0)
    prim_u, prim_causes = primary_of(per_interval, widths_ms, labels)
    primary = np.take(prim_u, a_idx) if n else prim_u[:0]
    redo_mask = ~one
    redo_mask[e_gap] = True
    redo_mask[os_gap] = True
    if len(d_gap):
        primary[d_gap] = prim_dev[inv]
        redo_mask[d_gap] = False
    redo = np.flatnonzero(redo_mask)
    if len(redo):
        primary[redo] = primary_of(parts[redo], gap_ms[redo], labels)[0]
    p = Partition(
        labels=labels,
        request=g_req,
        t0_s=g_t0,
        t1_s=g_t1,
        step0=g_s0,
        step1=g_s1,
        gap_ms=gap_ms,
        parts_ms=parts,
        context_ms=context,
        num_evictions=np.bincount(e_gap, minlength=n)[:n],
        primary=primary,
        causes=prim_causes,
        baseline=base,
        warnings=_baseline_warnings(log, base),
    )
    return check_reconciled(p, log.path) if check else p


def _baseline_warnings(log: RawLog, base: GraphBaseline) -> tuple[str, ...]:
    eager = (log.steps.graph_size == GRAPH_EAGER).any()
    if eager and base.num_fit_steps == 0:
        return ("eager steps but no captured steps to fit a baseline: graph excess not measured",)
    return ()


# -- the reference partitioner (slow, obvious; for tests) --------------------------------


def partition_reference(log: RawLog, *, baseline_fit: str = FIT_ALL_CAPTURED) -> Partition:
    """The same partition with plain Python loops, one gap and one slice at a time."""
    log = drift_corrected(log)
    causes_arr = segment_causes(log)
    causes = causes_arr.tolist()
    sg, gcp, st = log.segments, log.gc_pauses, log.steps
    is_dev = (sg.is_device == 1).tolist()
    classes = _classes(causes_arr, sg.is_device == 1)
    rank = {c: i for i, c in enumerate(classes)}
    dev_causes = set(causes_arr[sg.is_device == 1].tolist())
    osi = os_intervals(log)
    os_causes = set(OS_LABELS) if len(osi) else set()
    labels = tuple(partition_labels({c for c, _ in classes} | dev_causes | os_causes))
    segs = [
        (float(sg.t_start_s[i]), float(sg.t_end_s[i]), causes[i], int(sg.step[i]), is_dev[i])
        for i in range(len(sg))
    ]
    pauses = [(float(a), float(b)) for a, b in zip(gcp.t_start_s, gcp.t_end_s, strict=True)]

    def gc_overlap(a: float, b: float) -> float:
        # length of [a, b] inside the union of pauses: walk the merged pauses
        total = 0.0
        merged: list[list[float]] = []
        for pa, pb in sorted(pauses):
            if merged and pa <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], pb)
            else:
                merged.append([pa, pb])
        for pa, pb in merged:
            total += max(0.0, min(b, pb) - max(a, pa))
        return total

    net = np.zeros(len(st))
    steps_on_device = {s for a, b, c, s, d in segs if c == "decode" and d and s >= 0}
    for a, b, c, s, d in segs:
        if c != "decode" or s < 0:
            continue
        if s in steps_on_device:
            if d:
                net[s] += (b - a) * 1e3
        else:
            net[s] += ((b - a) - gc_overlap(a, b)) * 1e3
    base = fit_baseline(log, net, baseline_fit)

    host = [x for x in segs if not x[4]]
    points = sorted({p for a, b, *_ in host for p in (a, b)} | {p for ab in pauses for p in ab})
    os_list = [
        (float(a), float(b), float(rq), float(off))
        for a, b, rq, off in zip(osi.t0_s, osi.t1_s, osi.runqueue_s, osi.offcpu_s, strict=True)
    ]
    os_points = sorted({p for a, b, _, _ in os_list for p in (a, b)})

    def host_owner(t: float) -> tuple[str, float]:
        """Who owns the instant just after t on the host, and the graph rate there."""
        if any(pa <= t < pb for pa, pb in pauses):
            return "gc", 0.0
        live = [(rank[(c, False)], c, s) for a, b, c, s, d in host if a <= t < b]
        if not live:
            return "residual", 0.0
        best = min(live)[1]
        if best != "decode":
            return best, 0.0
        fr = [base.eager_excess_frac[s] if s >= 0 else 0.0 for r, c, s in live if c == "decode"]
        return "decode", min(1.0, max(0.0, sum(fr) / len(fr)))

    def os_shares(x: float, who: str) -> tuple[float, float]:
        """The run-queue and blocked shares of the instant just after x, owned by `who`."""
        for a, b, rq, off in os_list:
            if a <= x < b:
                cuts = sorted({a, b} | {p for p in points if a < p < b})
                wait = sum(
                    y - z
                    for z, y in zip(cuts[:-1], cuts[1:], strict=True)
                    if host_owner(z)[0] in WAIT_LABELS
                )
                r_share = rq / (b - a)
                if who in WAIT_LABELS or b - a - wait <= 0:
                    return r_share, 0.0
                return r_share, min(max(off - wait, 0.0) / (b - a - wait), 1.0 - r_share)
        return 0.0, 0.0

    def host_idle_before(x: float) -> bool:
        before = [p for p in points if p < x]
        if not before:
            return True
        who, _ = host_owner(max(before))
        return who == "residual" or who in WAIT_LABELS

    # device windows, disjoint over the run: the earlier start owns an overlap; each step's
    # device work ends where its last window (as recorded) ends
    device_segs = sorted((x for x in segs if x[4] and x[3] >= 0), key=lambda x: (x[0], x[3], x[1]))
    dev_windows: list[tuple[float, float, str, int]] = []
    busy_until = -np.inf
    last_end: dict[int, float] = {}
    for a, b, c, s, _ in device_segs:
        last_end[s] = max(last_end.get(s, -np.inf), b)
        if b > max(a, busy_until):
            dev_windows.append((max(a, busy_until), b, c, s))
        busy_until = max(busy_until, b)

    def tally(a: float, b: float, pieces=(), idle_only=False, use_os=False) -> dict[str, float]:
        out = dict.fromkeys(labels, 0.0)
        cuts = sorted({a, b} | {p for pa, pb, _, _ in pieces for p in (pa, pb) if a < p < b}
                      | {p for p in points if a < p < b}
                      | {p for p in os_points if a < p < b})  # fmt: skip
        for x, y in zip(cuts[:-1], cuts[1:], strict=True):
            ms = (y - x) * 1e3
            dev = [(c, fr) for pa, pb, c, fr in pieces if pa <= x < pb]
            who, rate = host_owner(x)
            # device-bound: a device window owns its time; host-bound: only host-idle time
            if dev and (not idle_only or who == "residual" or who in WAIT_LABELS):
                who, rate = dev[0][0], dev[0][1]
                out["<device>"] = 1.0  # this gap's parts come from the device's path
            if use_os and os_list:
                r_share, b_share = os_shares(x, who)
                out[OS_RUNQUEUE] += ms * r_share
                out[OS_BLOCKED] += ms * b_share
                ms *= 1.0 - r_share - b_share
            if who == "decode":
                out["graph"] += ms * rate
                out["forward"] += ms * (1 - rate)
            else:
                out[who] += ms
        return out

    order = _emission_order(log)
    em = log.emissions
    r_sorted = em.request[order]
    closing = np.flatnonzero(r_sorted[1:] == r_sorted[:-1]) + 1
    g_dstep = em.device_step[order][closing]

    g_req, g_t0, g_t1, g_s0, g_s1 = gaps_of(log)
    e_req, e_a, e_b = evicted_windows(log)
    parts = np.zeros((len(g_req), len(labels)))
    context = np.zeros_like(parts)
    n_ev = np.zeros(len(g_req), dtype=np.int64)
    for i in range(len(g_req)):
        t0, t1, r = float(g_t0[i]), float(g_t1[i]), int(g_req[i])
        windows = [
            (max(a, t0), min(b, t1))
            for rr, a, b in zip(e_req, e_a, e_b, strict=True)
            if rr == r and min(b, t1) > max(a, t0)
        ]
        n_ev[i] = len(windows)
        live, cur = [], t0
        for a, b in sorted(windows):
            if a > cur:
                live.append((cur, a))
            cur = max(cur, b)
        if cur < t1:
            live.append((cur, t1))
        pieces = []
        idle_only = False
        ds = int(g_dstep[i])
        if not windows and ds in last_end and min(last_end[ds], t1) > t0:
            # rule 6: the windows that ended by the read step's device work, in the gap
            idle_only = not host_idle_before(min(last_end[ds], t1))  # host-bound
            pieces = [
                (
                    max(a, t0),
                    min(b, t1),
                    c,
                    float(base.eager_excess_frac[s]) if c == "decode" else 0.0,
                )
                for a, b, c, s in dev_windows
                if b <= last_end[ds] and min(b, t1) > max(a, t0)
            ]
        tallies = [tally(a, b, pieces, idle_only, use_os=True) for a, b in live]
        if any("<device>" in t for t in tallies):  # the device's path: no OS share
            tallies = [tally(a, b, pieces, idle_only) for a, b in live]
        for tl_ in tallies:
            for lb, v in tl_.items():
                if lb != "<device>":
                    parts[i, labels.index(lb)] += v
        for a, b in windows:
            parts[i, labels.index("preempt")] += (b - a) * 1e3
            for lb, v in tally(a, b).items():
                context[i, labels.index(lb)] += v
    gap_ms = (g_t1 - g_t0) * 1e3
    primary, prim_causes = primary_of(parts, gap_ms, labels)
    return Partition(
        labels=labels,
        request=g_req,
        t0_s=g_t0,
        t1_s=g_t1,
        step0=g_s0,
        step1=g_s1,
        gap_ms=gap_ms,
        parts_ms=parts,
        context_ms=context,
        num_evictions=n_ev,
        primary=primary,
        causes=prim_causes,
        baseline=base,
    )
