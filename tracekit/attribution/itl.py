"""The exclusive partition of every inter-token gap by cause (design.md, "The partition").

A *gap* is ``[t0, t1]`` between two consecutive emissions of one request. Every
millisecond of it goes to exactly one label:

1. while the request is evicted (eviction to readmission; a missing readmission runs to
   ``t1``), all of it is ``preempt``; what the engine ran meanwhile is *context*, never added
   (context is partitioned like live time, uncovered time as ``residual``, so it sums to
   the evicted time);
2. in the live windows, GC pauses (their union) own whatever they overlap: ``gc``;
3. each segment's GC-free overlap goes to its cause (``swap`` -> ``preempt``); where
   segments overlap each other, `tracekit.labels.precedence` decides, in one place. A
   ``recompute`` segment (a re-prefill after a recompute eviction) is ``preempt`` in the
   gaps of the request re-prefilling there and ``prefill`` in everyone else's
   (`tracekit.attribution.reprefill`; applied after rules 6 and 7, to what they left it);
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
   behind it is not. The *loop thread* made the emission (the thread that recorded the
   emission's step, `tracekit.attribution.timeline.loop_threads`); its *own work* is its host
   segments other than `wait`/`sync`. If its own work does not cover the instant just before
   the read step's device work ended (the loop thread waited for the device), the gap is
   *device-bound* and those windows own their time ahead of every host window and GC
   pause; what they hid (launches, the CPU preparing the next step, a GC pause or another
   thread's work during the wait) is charged nothing, and time after the finish goes by the
   host rules. Otherwise the gap is *host-bound*: wherever the loop thread's own work
   covers the windows, the host rules hold; the rest of the windows' time is the device's
   (the loop thread waited for the device there; a GC pause or another thread's work there
   is hidden as well). The two readings differ only in the loop thread's own work inside
   the windows, so moving the windows by ``e`` moves at most ``4e`` per window plus twice
   that work, decode time counted as one label with the graph baseline held (docs/gpu.md).
   A gap that contains an eviction of its request uses the host rules only (its evicted
   time is `preempt` either way);
7. where the log has the loop thread's OS samples (docs/partition.md, "OS evidence"), each
   OS interval's run-queue wait (``os_runqueue``) and its off-CPU time beyond its explicit
   waits (``os_blocked``) are spread evenly over it, taken from whatever owns each live
   instant; evicted time stays ``preempt``, and a gap whose parts rule 6 changed takes no
   OS share.

Multi-token emissions (speculative decoding): a gap is between consecutive *emission
rows* of a request, i.e. consecutive steps that emitted for it; the tokens one step
emits together arrive at one time and add no gap of their own (as an engine's streaming
client sees them). `Emissions.num_tokens` still counts every token for throughput.

`partition` is the vectorised implementation: on the timeline of elementary intervals
(`tracekit.attribution.timeline`: every segment and pause boundary, each interval owned by
precedence) it answers "how much of label L lies in [a, b]" for all gaps at once from
compensated cumulative sums (so a gap's parts carry float rounding of the gap's size, not
of the run's length). `tracekit.attribution.reference.partition_reference` computes the
same thing with plain loops, gap by gap; the tests check that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from tracekit.attribution.reprefill import cuts_of, own_shares, reprefills
from tracekit.attribution.timeline import (
    BASELINE_FITS as BASELINE_FITS,
)
from tracekit.attribution.timeline import (
    FIT_ALL_CAPTURED,
    GraphBaseline,
    PreparedRun,
    Timeline,
    loop_threads,
    os_class_integrals,
    prefix_sums,
    prepared,
)
from tracekit.attribution.timeline import (
    FIT_MEASURED_CAPTURED as FIT_MEASURED_CAPTURED,
)
from tracekit.attribution.timeline import (
    drift_corrected as drift_corrected,
)
from tracekit.attribution.timeline import (
    fit_baseline as fit_baseline,
)
from tracekit.attribution.timeline import (
    segment_causes as segment_causes,
)
from tracekit.errors import ReconcileError
from tracekit.labels import (
    NON_CAUSES,
    OS_BLOCKED,
    OS_LABELS,
    OS_RUNQUEUE,
    RECOMPUTE_CLASS,
    partition_labels,
)
from tracekit.log.rawlog import GRAPH_EAGER, Emissions, RawLog

#: A gap whose parts miss its length by more than this is a bug (float rounding is ~1e-12).
RECONCILE_TOL_MS = 1e-6
#: Primary cause thresholds (design.md): the largest cause, if >= 1 ms and >= 25% of the gap.
PRIMARY_MIN_MS = 1.0
PRIMARY_MIN_SHARE = 0.25
#: A part within this of a threshold reaches it. Parts carry float rounding (~1e-12 ms) that
#: differs between implementations and summation orders; without a tolerance a part that is
#: exactly 1 ms by the rules (a 1.000 ms gap wholly covered by one cause) could be clean in
#: one and a cause in the other. Every primary decision (`primary_of`, both partitions,
#: TTFT and the client boundary) uses it.
PRIMARY_TOL_MS = 1e-9
CLEAN = -1


#: `Partition`'s per-gap columns: what `Partition.take` selects rows of
_GAP_COLUMNS = ("request", "t0_s", "t1_s", "step0", "step1", "gap_ms", "parts_ms",
                "context_ms", "reprefill_own_ms", "reprefill_other_ms", "num_evictions",
                "primary")  # fmt: skip


def _rows_of(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """`a[idx]`, a 2-D column-major table kept column-major: one gather a column (a row
    selection of it would stride across every column for each row, ~10x slower)."""
    if a.ndim != 2 or not a.flags.f_contiguous:
        return a[idx]
    out = np.empty((len(idx), a.shape[1]), dtype=a.dtype, order="F")
    for j in range(a.shape[1]):
        np.take(a[:, j], idx, out=out[:, j])
    return out


def _reconcile_err(gap_ms: np.ndarray, parts_ms: np.ndarray) -> np.ndarray:
    """|gap - sum of parts| per row, the parts added in label order."""
    total = np.zeros(len(gap_ms))
    for j in range(parts_ms.shape[1]):  # column by column: contiguous in F order
        total += parts_ms[:, j]
    return np.abs(gap_ms - total)


@dataclass(frozen=True)
class IntervalView:
    """A partition's gaps seen as the intervals between consecutive distinct emission times
    (in a batched engine most gaps are exactly one such interval, tens of gaps each): what
    lets a figure count intervals instead of gaps (`tracekit.analysis.interval_figures`).

    Bit for bit: a gap with ``interval >= 0`` has its interval's length as `gap_ms`; one
    that `keeps` it also has its interval's `primary` and `forward` part (no rule that
    moves time between labels changed it)."""

    width_ms: np.ndarray  # each interval's length, ms (a zero row last, as the parts')
    parts_ms: np.ndarray  # each interval's parts (intervals, labels)
    primary: np.ndarray  # each interval's primary cause (an index into the causes, or CLEAN)
    interval: np.ndarray  # per gap: the one interval it spans, or -1 (several, or none)
    #: per gap: its primary and parts are its interval's (each part equal in value; a -0.0
    #: may have become a 0.0 where a rule added nothing, so `forward` is also bit for bit)
    keeps: np.ndarray

    @cached_property
    def keep_counts(self) -> np.ndarray:
        """Per interval: the gaps that keep it."""
        return np.bincount(self.interval[self.keeps], minlength=len(self.width_ms))

    @cached_property
    def others(self) -> np.ndarray:
        """The gaps that do not keep an interval (rows)."""
        return np.flatnonzero(~self.keeps)


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
    # re-prefill time (docs/partition.md, "The re-prefill in the partition"): the request's
    # own, inside its `preempt` part, and others', inside its `prefill` part
    reprefill_own_ms: np.ndarray
    reprefill_other_ms: np.ndarray
    num_evictions: np.ndarray  # evictions of the request overlapping each gap
    primary: np.ndarray  # index into `causes`, or CLEAN (-1)
    causes: tuple[str, ...]  # the labels that can be a primary cause
    baseline: GraphBaseline
    warnings: tuple[str, ...] = field(default=())
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    #: the gaps as intervals (the vectorised partitioner's; None for a selection of gaps)
    intervals: IntervalView | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.gap_ms)

    def take(self, rows: np.ndarray) -> Partition:
        """The gaps at `rows` (indices or a boolean mask), each partitioned as here: a
        selection of this partition, never a new one (docs/reports.md, "Windows")."""
        rows = np.asarray(rows)
        if rows.dtype == np.bool_:
            if rows.shape != (len(self),):
                raise IndexError(f"take: a mask of {rows.shape} rows for {len(self)} gaps")
            rows = np.flatnonzero(rows)
        cut: dict[str, Any] = {f: _rows_of(getattr(self, f), rows) for f in _GAP_COLUMNS}
        return replace(self, **cut, _cache={}, intervals=None)

    @property
    def reconcile_err_ms(self) -> np.ndarray:
        """|gap - sum of parts| per gap (computed once, then kept)."""
        err = self._cache.get("err")
        if err is None:
            err = self._cache["err"] = _reconcile_err(self.gap_ms, self.parts_ms)
        return err

    @property
    def reconcile_max_err_ms(self) -> float:
        return self.reconcile_bounds()[0] if len(self) else 0.0

    def reconcile_bounds(self) -> tuple[float, float]:
        """(max over gaps of |gap - sum of parts|, the most negative part), once: counted
        over the intervals the gaps keep (`intervals`) and the other gaps one by one, the
        same values as over every gap."""
        got = self._cache.get("bounds")
        if got is None:
            v = self.intervals
            if v is None or "err" in self._cache:
                got = (float(self.reconcile_err_ms.max()), float(self.parts_ms.min()))
            else:
                kept = v.keep_counts > 0
                rows = v.others
                err_u = _reconcile_err(v.width_ms[kept], v.parts_ms[kept])
                err_g = _reconcile_err(self.gap_ms[rows], self.parts_ms[rows])
                got = (
                    float(max(err_u.max(initial=0.0), err_g.max(initial=0.0))),
                    float(min(v.parts_ms[kept].min(initial=np.inf),
                              self.parts_ms[rows].min(initial=np.inf))),
                )  # fmt: skip
            self._cache["bounds"] = got
        return got

    def column(self, label: str) -> np.ndarray:
        return self.parts_ms[:, self.labels.index(label)]

    def primary_names(self) -> np.ndarray:
        names = np.array(list(self.causes) + ["clean"], dtype=object)
        return names[self.primary]  # CLEAN (-1) indexes "clean"


# -- shared pieces (used by both implementations) ----------------------------------------


def emission_order(log: RawLog) -> np.ndarray:
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
    order = emission_order(log)
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
    if len(gap_ms) == 0 or not cause_cols:
        return np.full(len(gap_ms), CLEAN, dtype=np.int64), causes
    c = parts_ms[:, cause_cols]
    # the largest, ties (to within PRIMARY_TOL_MS) to the first in label order
    top = c.max(axis=1) if c.shape[1] else np.zeros(len(c))
    best = np.argmax(c >= (top - PRIMARY_TOL_MS)[:, None], axis=1)
    val = c[np.arange(len(c)), best]
    return np.where(reaches_primary(val, gap_ms), best, CLEAN).astype(np.int64), causes


def reaches_primary(val_ms: np.ndarray, gap_ms: np.ndarray) -> np.ndarray:
    """Whether a largest cause of `val_ms` is primary in a window of `gap_ms`: >= 1 ms and
    >= 25% of the window, each to within `PRIMARY_TOL_MS`."""
    return (val_ms >= PRIMARY_MIN_MS - PRIMARY_TOL_MS) & (
        val_ms >= PRIMARY_MIN_SHARE * gap_ms - PRIMARY_TOL_MS
    )


def check_reconciled(p: Partition, path: str = "") -> Partition:
    """Raise `ReconcileError` if any gap's parts do not sum to it (prints both numbers)."""
    if len(p) == 0:
        return p
    worst, neg = p.reconcile_bounds()
    if worst > RECONCILE_TOL_MS or neg < -RECONCILE_TOL_MS:
        err = p.reconcile_err_ms  # the gap to name: every gap's error
        i = int(np.argmax(err))
        neg = p.parts_ms.min()
        raise ReconcileError(
            f"{path}: gap {i} (request {int(p.request[i])}, t0={p.t0_s[i]!r}) is "
            f"{p.gap_ms[i]!r} ms but its parts sum to {p.parts_ms[i].sum()!r} ms "
            f"(parts {dict(zip(p.labels, p.parts_ms[i].round(6).tolist(), strict=True))}; "
            f"most negative part {neg!r} ms)"
        )
    return p


# -- the vectorised partitioner ----------------------------------------------------------


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


def _device_charges(
    k, frac, g_dstep, g_thread, g_t0, g_t1, g_rank0, g_rank1, e_gap,
):  # fmt: skip
    """What device windows take from the host labels and own (rule 6): rows of changes to
    add to parts (each row sums to 0), one per distinct (t0, t1, read step, loop thread);
    the gaps they touch; and for each of those gaps, its row.

    Memory is linear in windows + gaps: a gap's eligible windows are one run of the sorted
    disjoint windows (from the first ending after t0 to the last ending by the read step's
    end), so per-window changes are summed with prefix sums, and only the two windows a gap
    cuts are computed on their own."""
    run, tl, classes, to_labels, col = k.run, k.tl, k.run.classes, k.to_labels, k.col
    n = len(g_t0)
    n_lab = to_labels.shape[1]
    step, a, b, c, last_end = run.device_windows()
    if len(step) == 0 or n == 0:
        z = np.zeros(0, dtype=np.int64)
        return np.zeros((0, n_lab)), z, z
    n_steps = len(run.log.steps)
    ok = (g_dstep >= 0) & (g_dstep < n_steps)
    read_end = np.where(ok, last_end[np.where(ok, g_dstep, 0)], -np.inf)
    e_end = np.minimum(read_end, g_t1)  # where the read step's device work ended (in the gap)
    active = np.isfinite(read_end) & (e_end > g_t0)
    active[e_gap] = False  # a gap with an eviction uses the host rules only
    # eligible windows of gap g: indices [lo, hi)
    lo = np.searchsorted(b, g_t0, side="right")  # first window ending after t0
    hi = np.minimum(
        np.searchsorted(b, read_end, side="right"),  # ... up to the read step's end
        np.searchsorted(a, g_t1, side="left"),  # ... starting before t1
    )
    active &= hi > lo
    n_cls = len(classes)
    # the interval just before the read step's device work ended (owner index)
    k_end = np.searchsorted(tl.bounds, e_end, side="left")

    # the label each window's time goes to: its cause; decode splits forward/graph
    lab = np.zeros((len(step), n_lab))
    is_dec = c == "decode"
    fr = frac[step]
    rows = np.arange(len(step))
    names, inv = np.unique(c[~is_dec].astype(str), return_inverse=True)  # few causes
    lab[rows[~is_dec], np.array([col[x] for x in names.tolist()], dtype=np.int64)[inv]] = 1.0
    lab[rows[is_dec], col["forward"]] = 1.0 - fr[is_dec]
    lab[rows[is_dec], col["graph"]] += fr[is_dec]

    def device_bound(x0, x1, w):
        """Changes for window w's piece [x0, x1] in a device-bound gap: it owns all of it."""
        h0, l0 = tl.class_integrals(n_cls, x0)
        h1, l1 = tl.class_integrals(n_cls, x1)
        full = (((h1 - h0) + (l1 - l0)) * 1e3) @ to_labels
        return (x1 - x0)[:, None] * 1e3 * lab[w] - full

    def host_bound(free, x0, x1, w):
        """... in a host-bound gap: it owns the piece's time outside the loop thread's own
        work (`free`: the timeline with that work taken out)."""
        h0, l0 = free.class_integrals(n_cls, x0)
        h1, l1 = free.class_integrals(n_cls, x1)
        v = ((h1 - h0) + (l1 - l0)) * 1e3
        return v[:, : n_cls + 1].sum(axis=1)[:, None] * lab[w] - v @ to_labels

    pd = prefix_sums(device_bound(a, b, rows))
    g = np.flatnonzero(active)
    # gaps with the same (t0, t1, read step, loop thread) get the same changes: a batch's
    # requests share their emissions, so this computes one row per distinct gap, not per
    # request (key: the ranks of t0 and t1 among the emission times, the read step, the
    # thread)
    first, inv = _groups(g_rank0[g], g_rank1[g], g_dstep[g], g_thread[g])
    u = g[first]  # one representative gap per distinct key
    ulo, uhi, ut0, ut1 = lo[u], hi[u], g_t0[u], g_t1[u]
    out = np.zeros((len(u), n_lab))
    # one pass over the timeline and the windows per loop thread: one in a usual engine, a
    # pool's size where steps run on a thread pool
    for thread in np.unique(g_thread[u]).tolist():
        mine = np.flatnonzero(g_thread[u] == thread)
        busy, free = run.without_own_work(tl, thread)
        # device-bound: the loop thread's own work did not cover the finish
        dev = ~busy[k_end[u[mine]]]
        ph = prefix_sums(host_bound(free, a, b, rows))
        lo_m, hi_m = ulo[mine], uhi[mine]
        rows_m = np.where(dev[:, None], pd[hi_m] - pd[lo_m], ph[hi_m] - ph[lo_m])
        # the windows a gap cuts: take back the parts outside [t0, t1]
        for sel, x0, x1, w in (
            (a[lo_m] < ut0[mine], a[lo_m], ut0[mine], lo_m),
            (b[hi_m - 1] > ut1[mine], ut1[mine], b[hi_m - 1], hi_m - 1),
        ):
            if sel.any():
                d_cut = device_bound(x0[sel], x1[sel], w[sel])
                h_cut = host_bound(free, x0[sel], x1[sel], w[sel])
                rows_m[sel] -= np.where(dev[sel][:, None], d_cut, h_cut)
        out[mine] = rows_m
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


def itl_labels(run: PreparedRun) -> tuple[str, ...]:
    """The ITL partition's labels of a run: its host classes, its device windows' causes and,
    with OS evidence, `OS_LABELS`, in `partition_labels` order."""
    os_causes = set(OS_LABELS) if run.has_os else set()
    causes = {c for c, _ in run.classes} | set(run.causes[run.is_device].tolist()) | os_causes
    return tuple(partition_labels(causes - {RECOMPUTE_CLASS}))


def has_reprefill(run: PreparedRun) -> bool:
    """Whether the run has re-prefill segments (`RECOMPUTE_CLASS`), host or device."""
    return bool((run.causes == RECOMPUTE_CLASS).any()) if len(run.causes) else False


@dataclass(frozen=True)
class _Kernel:
    """One partition's view of the timeline: "how much of each label lies in [x, y]".

    Class integrals come as columns: every class, residual, then the graph-rate integral;
    `to_labels` maps them linearly onto the partition's labels (decode -> forward,
    graph-rate -> +graph -forward), so all arithmetic is on small matrices."""

    run: PreparedRun
    tl: Timeline
    labels: tuple[str, ...]
    col: dict[str, int]
    to_labels: np.ndarray

    @classmethod
    def of(cls, run: PreparedRun, tl: Timeline, labels: tuple[str, ...]) -> _Kernel:
        col = {lb: i for i, lb in enumerate(labels)}
        n_cls = len(run.classes)
        to_labels = np.zeros((n_cls + 2, len(labels)))
        for c, (name, _) in enumerate(run.classes):
            to_labels[c, col["forward" if name == "decode" else name]] = 1.0
        to_labels[n_cls, col["residual"]] = 1.0
        to_labels[n_cls + 1, col["graph"]] += 1.0
        to_labels[n_cls + 1, col["forward"]] -= 1.0
        return cls(run, tl, labels, col, to_labels)

    @property
    def n_cls(self) -> int:
        return len(self.run.classes)

    def between(self, h0, l0, h1, l1) -> np.ndarray:
        """Label ms between two rows of class integrals, each as (hi, lo)."""
        return (((h1 - h0) + (l1 - l0)) @ self.to_labels) * 1e3

    def over(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Label ms of the host rules (2-5) in each [x, y]."""
        h0, l0 = self.tl.class_integrals(self.n_cls, x)
        h1, l1 = self.tl.class_integrals(self.n_cls, y)
        return self.between(h0, l0, h1, l1)


@dataclass(frozen=True)
class _Gaps:
    """Every gap (rows sorted by request, then time), with each end's rank among the
    distinct emission times `uniq_t` (most gaps join two consecutive ones)."""

    request: np.ndarray
    t0_s: np.ndarray
    t1_s: np.ndarray
    step0: np.ndarray
    step1: np.ndarray
    rank0: np.ndarray
    rank1: np.ndarray
    uniq_t: np.ndarray
    order: np.ndarray  # the log's emission rows by request, then time
    pair: np.ndarray  # gap k joins rows order[pair[k]] and order[pair[k] + 1]
    emissions: Emissions

    def __len__(self) -> int:
        return len(self.request)

    @cached_property
    def device_step(self) -> np.ndarray:
        """The step whose device work the closing emission read (only rule 6 asks)."""
        return self.emissions.device_step[self.order[self.pair + 1]]

    @classmethod
    def of(cls, log: RawLog) -> _Gaps:
        em = log.emissions
        order = emission_order(log)
        r = em.request[order]
        pair = np.flatnonzero(r[1:] == r[:-1])  # gap k joins sorted rows pair[k], pair[k] + 1
        uniq_t, rank = _time_ranks(em.t_s)
        rank_o, step_o = rank[order], em.step[order]  # one gather per column, then slices
        nxt = pair + 1
        a_idx, b_idx = rank_o[pair], rank_o[nxt]
        return cls(
            request=r[nxt],
            t0_s=uniq_t[a_idx],
            t1_s=uniq_t[b_idx],
            step0=step_o[pair],
            step1=step_o[nxt],
            rank0=a_idx,
            rank1=b_idx,
            uniq_t=uniq_t,
            order=order,
            pair=pair,
            emissions=em,
        )


def partition(
    log: RawLog,
    *,
    check: bool = True,
    baseline_fit: str = FIT_ALL_CAPTURED,
    excess_frac: np.ndarray | None = None,
    run: PreparedRun | None = None,
) -> Partition:
    """Partition every gap of `log` (vectorised). Raises `ReconcileError` if parts do not sum.

    `baseline_fit`: the graph baseline's fit (`BASELINE_FITS`; design.md's by default).
    `excess_frac`: each step's graph fraction to use instead of the fitted baseline's (a
    caller that settles `graph`/`forward` itself, as `tracekit.live` does; the parts are
    linear in it).
    `run`: the log's `PreparedRun`, if the caller partitions it more than once (one
    prepared from other tables is not used).
    Device windows are first corrected for the measured clock drift (`drift_corrected`)."""
    run = prepared(log, run).corrected()
    base = run.baseline(baseline_fit)
    if excess_frac is not None:
        base = replace(base, eager_excess_frac=np.asarray(excess_frac, dtype=np.float64))
    tl = run.timeline(baseline_fit, None if excess_frac is None else base.eager_excess_frac)
    labels = itl_labels(run)
    # re-prefill time is one more column, last, until its gaps' own and others' shares are
    # known (`_reprefill_rule`)
    k = _Kernel.of(run, tl, labels + ((RECOMPUTE_CLASS,) if has_reprefill(run) else ()))
    g = _Gaps.of(log)
    n = len(g)

    # rules 2-5: the host rules over each gap's live time
    per_interval, parts = _host_parts(k, g)
    # rule 1: evicted windows are preempt; what ran meanwhile moves to the context
    e_gap, w0, w1 = _evictions_per_gap(g.request, g.t0_s, g.t1_s, *evicted_windows(log))
    context = _evicted_rule(k, parts, e_gap, w0, w1)
    # rule 6: device windows on the gap's critical path
    dev = _device_rule(k, base, g, parts, e_gap)
    # rule 7: what the OS took of each live instant
    os_gap = _os_rule(k, g, parts, e_gap, w0, w1, dev) if run.has_os and n else None
    # the re-prefill: the gap's own request's is preempt, others' is prefill
    rp = _reprefill_rule(log, k, g, parts, context, (e_gap, w0, w1))
    if len(k.labels) > len(labels):
        parts, context = parts[:, : len(labels)], context[:, : len(labels)]
        per_interval = per_interval[:, : len(labels)]

    gap_ms = (g.t1_s - g.t0_s) * 1e3
    primary, prim_causes, view = _primaries(
        labels, g, per_interval, parts, gap_ms, e_gap, dev, (os_gap, rp[2])
    )
    p = Partition(
        labels=labels,
        request=g.request,
        t0_s=g.t0_s,
        t1_s=g.t1_s,
        step0=g.step0,
        step1=g.step1,
        gap_ms=gap_ms,
        parts_ms=parts,
        context_ms=context,
        reprefill_own_ms=rp[0],
        reprefill_other_ms=rp[1],
        num_evictions=np.bincount(e_gap, minlength=n)[:n],
        primary=primary,
        causes=prim_causes,
        baseline=base,
        warnings=_baseline_warnings(log, base),
        intervals=view,
    )
    return check_reconciled(p, log.path) if check else p


def _host_parts(k: _Kernel, g: _Gaps) -> tuple[np.ndarray, np.ndarray]:
    """Rules 2-5 over every gap: (the parts of each interval between consecutive distinct
    emission times, a zero row last; each gap's parts, column-major)."""
    uniq_t = g.uniq_t
    hi_u, lo_u = k.tl.class_integrals(k.n_cls, uniq_t)
    # between consecutive distinct emission times (most gaps are exactly one such interval)
    per_interval = k.between(hi_u[:-1], lo_u[:-1], hi_u[1:], lo_u[1:])
    # a zero row after the last interval, for zero-length gaps at the last emission time
    per_interval = np.vstack([per_interval, np.zeros((1, len(k.labels)))])
    one = g.rank1 == g.rank0 + 1
    # column-major: per-gap sums over labels (the reconcile check) add contiguous columns
    parts = np.empty((len(g), len(k.labels)), order="F")
    pick = g.rank0
    for j in range(len(k.labels)):
        # mode="clip": `pick` is in range by construction, and "raise" buffers `out`
        np.take(per_interval[:, j], pick, out=parts[:, j], mode="clip")
    many = np.flatnonzero(~one)
    if len(many):
        a, b = g.rank0[many], g.rank1[many]
        parts[many] = k.between(hi_u[a], lo_u[a], hi_u[b], lo_u[b])
    return per_interval, parts


def _evicted_rule(k: _Kernel, parts: np.ndarray, e_gap, w0, w1) -> np.ndarray:
    """Rule 1: each gap's evicted windows [w0, w1] (gap `e_gap`) are `preempt`; what the
    engine ran meanwhile leaves the parts for the context (returned)."""
    context = np.zeros(parts.shape, order="F")
    if len(e_gap):
        ran = k.over(w0, w1)
        np.subtract.at(parts, e_gap, ran)
        # all of it is context, `residual` included (time no engine activity covered while
        # the request was evicted), so a gap's context sums to its evicted time
        np.add.at(context, e_gap, ran)
        np.add.at(parts[:, k.col["preempt"]], e_gap, (w1 - w0) * 1e3)
    return context


@dataclass(frozen=True)
class _DeviceChange:
    """What rule 6 changed: one row of changes per distinct gap (`change`), the gaps whose
    parts it moved (`gap`), each one's row (`row`), and each row's primary cause."""

    change: np.ndarray
    gap: np.ndarray
    row: np.ndarray
    primary: np.ndarray


def _device_rule(
    k: _Kernel, base: GraphBaseline, g: _Gaps, parts: np.ndarray, e_gap: np.ndarray
) -> _DeviceChange | None:
    """Rule 6: the device windows on each gap's critical path take their time from the host
    labels (added to `parts`); None where no gap changed."""
    if not k.run.is_device.any():
        return None
    g_thread = loop_threads(k.run.log, g.step1)
    u_change, d_gap, inv = _device_charges(
        k, base.eager_excess_frac, g.device_step, g_thread, g.t0_s, g.t1_s, g.rank0, g.rank1,
        e_gap,
    )  # fmt: skip
    moved = np.any(u_change != 0.0, axis=1)[inv]  # host-bound gaps often keep all
    d_gap, inv = d_gap[moved], inv[moved]
    if not len(d_gap):
        return None
    parts[d_gap] += u_change[inv]
    # gaps that share (t0, t1, read step) and no eviction have equal parts: one primary
    # cause per distinct gap
    rep = np.full(len(u_change), -1, dtype=np.int64)
    rep[inv] = d_gap
    has = rep >= 0
    prim_dev = np.full(len(u_change), CLEAN, dtype=np.int64)
    prim_dev[has] = primary_of(parts[rep[has]], (g.t1_s - g.t0_s)[rep[has]] * 1e3, k.labels)[0]
    return _DeviceChange(u_change, d_gap, inv, prim_dev)


def _os_rule(
    k: _Kernel, g: _Gaps, parts: np.ndarray, e_gap, w0, w1, dev: _DeviceChange | None
) -> np.ndarray:
    """Rule 7: each live instant's OS shares move from its owner to `os_runqueue` and
    `os_blocked` (in `parts`); evicted time and gaps whose parts rule 6 changed give none.
    Returns the gaps whose parts it changed."""
    tl, col = k.tl, k.col
    run_rate, blk_rate = k.run.os_shares(tl)

    def os_loss(t_a: np.ndarray, t_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row, what the OS shares take from each label in [t_a, t_b]."""
        out = []
        for name, w in (("run", run_rate), ("blk", blk_rate)):
            h0, l0 = os_class_integrals(tl, k.n_cls, name, w, t_a)
            h1, l1 = os_class_integrals(tl, k.n_cls, name, w, t_b)
            out.append(k.between(h0, l0, h1, l1))
        return out[0], out[1]

    loss_run, loss_blk = os_loss(g.t0_s, g.t1_s)
    if len(e_gap):  # evicted time is all preempt: the OS takes no share of it
        ev_run, ev_blk = os_loss(w0, w1)
        np.subtract.at(loss_run, e_gap, ev_run)
        np.subtract.at(loss_blk, e_gap, ev_blk)
    # the device's critical path changed these gaps' parts (by more than float
    # rounding, which the device rule's exact-zero test also sees): the host's OS
    # takes no share of them
    if dev is not None:
        dev_changed = dev.gap[np.any(np.abs(dev.change[dev.row]) > PRIMARY_TOL_MS, axis=1)]
        loss_run[dev_changed] = 0.0
        loss_blk[dev_changed] = 0.0
    os_gap = np.flatnonzero(np.any(loss_run != 0.0, axis=1) | np.any(loss_blk != 0.0, axis=1))
    parts -= loss_run + loss_blk
    parts[:, col[OS_RUNQUEUE]] += loss_run.sum(axis=1)
    parts[:, col[OS_BLOCKED]] += loss_blk.sum(axis=1)
    return os_gap


def _reprefill_rule(
    log: RawLog, k: _Kernel, g: _Gaps, parts: np.ndarray, context: np.ndarray, evicted
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The re-prefill column (last in `k.labels`, if any) of each gap: the share that is
    its own request's re-prefill goes to `preempt`, the rest to `prefill`; in the context
    (the request was evicted meanwhile) all of it is others' prefill. Returns each gap's
    own and others' re-prefill ms and the gaps that had some."""
    n = len(g)
    own, other = np.zeros(n), np.zeros(n)
    if k.labels[-1] != RECOMPUTE_CLASS:
        return own, other, np.zeros(0, dtype=np.int64)
    h = parts[:, -1]
    rows = np.flatnonzero(h != 0.0)
    # the segments as this partition reads them (device windows drift-corrected)
    rp = reprefills(replace(log, segments=k.run.log.segments))
    f = own_shares(rp, g.request, g.t0_s, g.t1_s, rows, cuts_of(*evicted))
    own[rows], other[rows] = h[rows] * f, h[rows] * (1.0 - f)
    parts[:, k.col["preempt"]] += own
    parts[:, k.col["prefill"]] += other
    context[:, k.col["prefill"]] += context[:, -1]
    return own, other, rows


def _primaries(
    labels: tuple[str, ...],
    g: _Gaps,
    per_interval: np.ndarray,
    parts: np.ndarray,
    gap_ms: np.ndarray,
    e_gap: np.ndarray,
    dev: _DeviceChange | None,
    changed: tuple[np.ndarray | None, np.ndarray],
) -> tuple[np.ndarray, tuple[str, ...], IntervalView]:
    """Each gap's primary cause: a one-interval gap that no rule changed takes its
    interval's; the others are computed from their parts. `changed`: the gaps whose parts
    the OS rule (None: it did not run) and the re-prefill rule changed. Also the gaps as
    intervals (`IntervalView`)."""
    os_gap, rp_gap = changed
    uniq_t = g.uniq_t
    widths_ms = np.append((uniq_t[1:] - uniq_t[:-1]) * 1e3, 0.0)
    prim_u, prim_causes = primary_of(per_interval, widths_ms, labels)
    primary = np.take(prim_u, g.rank0) if len(g) else prim_u[:0]
    one = g.rank1 == g.rank0 + 1
    redo_mask = ~one
    redo_mask[e_gap] = True
    keeps = None
    if dev is not None:
        primary[dev.gap] = dev.primary[dev.row]
        redo_mask[dev.gap] = False
        keeps = ~redo_mask
        keeps[dev.gap] = False  # the device's critical path moved their parts
    if os_gap is not None:
        redo_mask[os_gap] = True  # after the device rule's: its primary predates the OS shares
    redo_mask[rp_gap] = True  # ... and the re-prefill's split
    redo = np.flatnonzero(redo_mask)
    if len(redo):
        primary[redo] = primary_of(parts[redo], gap_ms[redo], labels)[0]
    if keeps is None:
        keeps = ~redo_mask
    else:
        keeps &= ~redo_mask
    fwd_u = per_interval[:, labels.index("forward")]
    if os_gap is not None and (neg := np.signbit(fwd_u) & (fwd_u == 0.0)).any():
        keeps &= ~neg[g.rank0]  # the OS rule's `x - 0.0` made their -0.0 a 0.0
    view = IntervalView(
        width_ms=widths_ms,
        parts_ms=per_interval,
        primary=prim_u,
        interval=np.where(one, g.rank0, -1),
        keeps=keeps,
    )
    return primary, prim_causes, view


def _baseline_warnings(log: RawLog, base: GraphBaseline) -> tuple[str, ...]:
    eager = (log.steps.graph_size == GRAPH_EAGER).any()
    if eager and base.num_fit_steps == 0:
        return ("eager steps but no captured steps to fit a baseline: graph excess not measured",)
    return ()
