"""The tensor-parallel rule: a step's wait at a collective is charged to its slowest rank.

A merged server run (`tracekit.log.merge`) keeps each worker's windows; where the engine
core's workers are tensor-parallel ranks that recorded their collectives, `tp_waits` finds
what each step waited on its last rank for, and `carve_tp_waits` carves those waits out of
the step's forward windows as segments ``rankR:CAUSE`` (`tp_label`). `charge_tp_waits`
applies the rule to a merge.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.log.clocks import ClockFit
from tracekit.log.merge import ServerMerge
from tracekit.log.osintervals import thread_os_intervals
from tracekit.log.processes import ProcessLog, tp_rank, windows
from tracekit.log.rawlog import RawLog, Segments
from tracekit.log.serve_contract import WORKER
from tracekit.log.validate import validate_log

#: What a tensor-parallel rank did while the others waited for it at a collective, first
#: match wins: its GC, a stall injected by a test, its own segments (by recorded label),
#: and ``other`` where it recorded nothing.
RANK_PRECEDENCE = ("gc", "injected", "prefill", "prepare", "forward", "sample", "draft")


def tp_waits(
    core: ProcessLog, others: list[ProcessLog], fits: list[ClockFit]
) -> list[tuple[int, float, float, str]]:
    """A tensor-parallel step's wait on its slowest rank, as (rank, start, end, cause) on
    the run's clock. At each collective (the n-th ``collective`` window of every rank is
    one call) the ranks that entered first wait from the first entry until the last rank
    enters: the last rank was late by that much. Its lateness goes first to the stalls it
    had since it last left a collective within the same forward call (`STALLS`: its GC
    pauses, a test's injected stall; at most their length, in that order), the rest to
    what it was doing during the wait (its recorded segments by `RANK_PRECEDENCE`, else
    ``other``), less the shares of it the rank's own OS counters give to ``os_runqueue``
    and ``os_blocked`` (`_RankOs`). The pieces are laid out in that order from the first
    entry. Past the last entry stamp, a rank's run-queue wait inside its own collective
    window is its ``os_runqueue`` (`_held_entries`). Ranks that recorded no collective (one
    worker, no tensor parallelism): nothing."""
    ranks: dict[int, tuple[ProcessLog, ClockFit]] = {}
    for p, fit in zip(others, fits, strict=True):
        r = tp_rank(p)
        if p.role == WORKER and r is not None and r not in ranks:
            ranks[r] = (p, fit)
    if len(ranks) < 2:
        return []
    calls: dict[int, np.ndarray] = {}
    for r, (p, fit) in ranks.items():
        w = windows(p.log, ("collective",), steps_only=False)
        w = np.column_stack([fit.apply(w[:, 0]), fit.apply(w[:, 1])]) if len(w) else w
        calls[r] = w[np.argsort(w[:, 0], kind="stable")] if len(w) else np.zeros((0, 2))
    os_shares = {r: _RankOs.of(p, fit, calls[r]) for r, (p, fit) in ranks.items()}
    n = min(len(c) for c in calls.values())
    if n == 0:
        return []
    order = sorted(ranks)
    mat = np.stack([calls[r][:n, 0] for r in order])  # (ranks, collectives): entries
    first, last_i, last = mat.min(axis=0), mat.argmax(axis=0), mat.max(axis=0)
    out: list[tuple[int, float, float, str]] = []
    timelines = {r: _rank_timeline(*ranks[r]) for r in order}
    starts = {r: [w[0] for w in tl] for r, tl in timelines.items()}
    longest = {r: max((w[1] - w[0] for w in tl), default=0.0) for r, tl in timelines.items()}
    calls_started = {r: [w[0] for w in tl if w[3] == "prepare" or w[3] == "forward"]
                     for r, tl in timelines.items()}  # fmt: skip
    for c in np.flatnonzero(last > first).tolist():
        r = order[int(last_i[c])]
        lo, hi = float(first[c]), float(last[c])
        # since the rank last left a collective, within the forward call it is in
        prev = float(calls[r][c - 1, 1]) if c > 0 else -np.inf
        k = bisect.bisect_right(calls_started[r], hi) - 1
        since = max(prev, calls_started[r][k] if k >= 0 else -np.inf)
        since = min(since, lo)

        def near(a: float, b: float, r: int = r) -> list[tuple[float, float, int, str]]:
            # only the windows that can overlap [a, b]: linear in the run's collectives
            i0 = bisect.bisect_left(starts[r], a - longest[r])
            i1 = bisect.bisect_left(starts[r], b)
            return timelines[r][i0:i1]

        stall: dict[str, float] = {}
        for a, b, cause in _owned(near(since, hi), since, hi):
            if cause in STALLS:
                stall[cause] = stall.get(cause, 0.0) + (b - a)
        left, t = hi - lo, lo
        for cause in STALLS:
            take = min(stall.get(cause, 0.0), left)
            if take > 0:
                out.append((r, t, t + take, cause))
                t, left = t + take, left - take
        if left > 0:  # the rest: what it was doing meanwhile, in proportion
            rest = [x for x in _owned(near(lo, hi), lo, hi) if x[2] not in STALLS]
            rest = rest or [(lo, hi, "other")]
            # what the OS took of each piece, from the rank's own counters
            pieces = [x for a, b, cause in rest for x in os_shares[r].split(a, b, cause)]
            total = sum(d for d, _ in pieces)
            for d, cause in pieces if total > 0 else [(1.0, "other")]:
                d = left * d / total if total > 0 else left
                out.append((r, t, t + d, cause))
                t += d
    return out + _held_entries(order, calls, os_shares, n)


#: Times of one tick read by two samplers, on the run's clock, within float rounding
_SAME_S = 1e-9


def _held_entries(
    order: list[int], calls: dict[int, np.ndarray], os_shares: dict[int, _RankOs], n: int
) -> list[tuple[int, float, float, str]]:
    """The wait past the last entry stamp of each of the first `n` collectives: from the
    last rank's entry stamp until the first rank left, no rank was waiting on a stamp any
    more, but one may not have reached the call yet (held by the OS after its stamp). Each
    rank's run-queue wait within its own window of that collective (`_RankOs`), spread
    evenly over the window (the kernel says how much, not when), gives its share of that
    span; the rank with the largest share is charged it as ``os_runqueue``, from the last
    entry stamp on. The rest of the span is the collective's own work (not charged)."""
    out: list[tuple[int, float, float, str]] = []
    entries = np.stack([calls[r][:n, 0] for r in order])
    exits = np.stack([calls[r][:n, 1] for r in order])
    last, first_exit = entries.max(axis=0), exits.min(axis=0)
    for c in np.flatnonzero(first_exit > last).tolist():
        span = float(first_exit[c] - last[c])
        best, rank = 0.0, -1
        for i, r in enumerate(order):
            a, b = float(entries[i, c]), float(exits[i, c])
            if b > a:
                share = span * min(os_shares[r].runqueue_within(a, b) / (b - a), 1.0)
                if share > best:
                    best, rank = share, r
        if rank >= 0:
            out.append((rank, float(last[c]), float(last[c]) + best, "os_runqueue"))
    return out


@dataclass(frozen=True)
class _RankOs:
    """A tensor-parallel rank's OS intervals on the run's clock (the samples of the thread
    that entered its collectives) and, per interval, the shares of its time outside its
    waits that the OS took: run-queue wait and other off-CPU time (docs/partition.md, OS
    rules 1-2, with the rank's collectives and stalls as its explicit waits)."""

    t0: np.ndarray
    t1: np.ndarray
    runqueue: np.ndarray  # fraction of each interval's time outside its waits
    blocked: np.ndarray
    runqueue_s: np.ndarray  # each interval's run-queue wait, seconds

    @classmethod
    def of(cls, p: ProcessLog, fit: ClockFit, calls: np.ndarray) -> _RankOs:
        lg = p.log
        col = lg.labels.index("collective") if "collective" in lg.labels else -1
        threads = lg.segments.thread[lg.segments.label == col]
        z = np.zeros(0)
        if not len(threads) or not len(lg.os_samples):
            return cls(z, z, z, z, z)
        osi = thread_os_intervals(lg, int(np.bincount(threads).argmax()))
        if not len(osi):
            return cls(z, z, z, z, z)
        t0, t1 = fit.apply(osi.t0_s), fit.apply(osi.t1_s)
        # the rank's waits: its collectives and its stalls (GC, an injected stall)
        gc = lg.gc_pauses
        waits = [calls, np.column_stack([fit.apply(gc.t_start_s), fit.apply(gc.t_end_s)])]
        for name in (x for x in STALLS if x != "gc"):  # recorded as segments
            w = windows(lg, (name,), steps_only=False)
            if len(w):
                waits.append(np.column_stack([fit.apply(w[:, 0]), fit.apply(w[:, 1])]))
        w_in = _covered(np.concatenate(waits), t0, t1)
        free = t1 - t0 - w_in
        with np.errstate(divide="ignore", invalid="ignore"):
            rq = np.where(free > 0, np.minimum(osi.runqueue_s, free) / free, 0.0)
            bl = np.where(free > 0, np.maximum(osi.offcpu_s - w_in, 0.0) / free, 0.0)
        return cls(t0, t1, rq, np.minimum(bl, 1.0 - rq), np.asarray(osi.runqueue_s))

    def runqueue_within(self, a: float, b: float) -> float:
        """The run-queue wait of the intervals that lie within [a, b] (a collective's own
        interval, where the rank sampled at its entry and exit), seconds."""
        i0 = int(np.searchsorted(self.t0, a - _SAME_S, side="left"))
        i1 = int(np.searchsorted(self.t0, b + _SAME_S, side="right"))
        inside = self.t1[i0:i1] <= b + _SAME_S
        return float(self.runqueue_s[i0:i1][inside].sum())

    def split(self, a: float, b: float, cause: str) -> list[tuple[float, str]]:
        """[a, b], owned by `cause`, as (length, cause) pieces: what each OS interval over
        it says the OS took (``os_runqueue``, ``os_blocked``), the rest `cause`'s."""
        own, rq, bl = b - a, 0.0, 0.0
        i0 = int(np.searchsorted(self.t1, a, side="right"))
        for i in range(i0, len(self.t0)):
            if self.t0[i] >= b:
                break
            d = min(b, float(self.t1[i])) - max(a, float(self.t0[i]))
            if d > 0:
                rq += d * float(self.runqueue[i])
                bl += d * float(self.blocked[i])
        own -= rq + bl
        return [(x, c) for x, c in ((own, cause), (rq, "os_runqueue"), (bl, "os_blocked"))
                if x > 0]  # fmt: skip


def _covered(windows: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Per interval [t0, t1], the time the union of `windows` (rows [start, end]) covers."""
    if not len(windows):
        return np.zeros(len(t0))
    w = windows[np.argsort(windows[:, 0], kind="stable")]
    # their union, as disjoint sorted spans
    starts, ends = [float(w[0, 0])], [float(w[0, 1])]
    for a, b in w[1:].tolist():
        if a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    s, e = np.array(starts), np.array(ends)
    cum = np.concatenate([[0.0], np.cumsum(e - s)])  # covered time before each span

    def before(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(s, t, side="right")  # spans starting at or before t
        j = np.maximum(k - 1, 0)  # the last of them
        return np.where(k > 0, cum[j] + np.clip(t - s[j], 0.0, e[j] - s[j]), 0.0)

    return before(t1) - before(t0)


#: A rank's stalls: what a rank had that the others did not (its lateness goes to them
#: first).
STALLS = ("gc", "injected")


def _rank_timeline(p: ProcessLog, fit: ClockFit) -> list[tuple[float, float, int, str]]:
    """One rank's windows on the run's clock as (start, end, precedence index), the
    precedence of `RANK_PRECEDENCE` (GC pauses first); labels not named there after them."""
    lg = p.log
    rows: list[tuple[float, float, int, str]] = []
    gc = lg.gc_pauses
    for a, b in zip(fit.apply(gc.t_start_s).tolist(), fit.apply(gc.t_end_s).tolist(), strict=True):
        rows.append((a, b, 0, "gc"))
    sg = lg.segments
    names = list(lg.labels)
    for lab, a, b in zip(sg.label.tolist(), fit.apply(sg.t_start_s).tolist(),
                         fit.apply(sg.t_end_s).tolist(), strict=True):  # fmt: skip
        name = names[lab] if 0 <= lab < len(names) else "?"
        if name == "collective":
            continue  # waiting itself is not what it was doing
        rank = RANK_PRECEDENCE.index(name) if name in RANK_PRECEDENCE else len(RANK_PRECEDENCE)
        rows.append((a, b, rank, name))
    rows.sort()
    return rows


def _owned(timeline: list[tuple[float, float, int, str]], lo: float, hi: float):
    """[lo, hi] cut where the timeline's windows start and end, each piece named by the
    first window (by precedence) covering it, else ``other``; adjacent equal pieces
    joined."""
    inside = [w for w in timeline if w[0] < hi and w[1] > lo]
    cuts = sorted({lo, hi, *(t for a, b, _, _ in inside for t in (a, b) if lo < t < hi)})
    pieces: list[tuple[float, float, str]] = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=False):
        mid = (a + b) / 2
        owners = [(k, name) for s, e, k, name in inside if s <= mid < e]
        name = min(owners)[1] if owners else "other"
        if pieces and pieces[-1][2] == name and pieces[-1][1] == a:
            pieces[-1] = (pieces[-1][0], b, name)
        else:
            pieces.append((a, b, name))
    return pieces


#: Engine-core windows that a wait on a tensor-parallel rank is carved out of (the
#: engine core waited there for the workers' forward pass).
FORWARD_LABELS = ("prefill", "decode", "verify")


def tp_label(rank: int, cause: str) -> str:
    """The partition label of time a step waited on tensor-parallel rank `rank`'s `cause`."""
    return f"rank{rank}:{cause}"


def carve_tp_waits(log: RawLog, waits, label_id) -> tuple[Any, dict[str, Any]]:
    """The engine core's segments with each wait on a rank (`tp_waits`) carved out of the
    step's forward windows it lies in and recorded as its own segment ``rankR:CAUSE`` of
    that step: exclusive (the forward windows are split around it), and only where the
    engine core waited (outside a forward window, a wait did not hold the step)."""
    sg = log.segments
    fwd_ids = {log.labels.index(x) for x in FORWARD_LABELS if x in log.labels}
    cols = {k: v.tolist() for k, v in sg.columns().items()}
    fwd = [i for i, lab in enumerate(cols["label"]) if lab in fwd_ids and cols["step"][i] >= 0]
    fwd.sort(key=lambda i: cols["t_start_s"][i])
    starts = np.array([cols["t_start_s"][i] for i in fwd])
    # per forward window, the wait pieces inside it
    cut: dict[int, list[tuple[float, float, str]]] = {}
    per_rank: dict[str, float] = {}
    for r, a, b, cause in waits:
        j = int(np.searchsorted(starts, a, side="right")) - 1
        # a piece may span adjacent forward windows (prefill then decode of one step)
        while 0 <= j < len(fwd):
            i = fwd[j]
            s0, s1 = cols["t_start_s"][i], cols["t_end_s"][i]
            if s0 >= b:
                break
            lo, hi = max(a, s0), min(b, s1)
            if hi > lo:
                cut.setdefault(i, []).append((lo, hi, tp_label(r, cause)))
                per_rank[tp_label(r, cause)] = per_rank.get(tp_label(r, cause), 0.0) + hi - lo
            j += 1
    out: dict[str, list[Any]] = {k: [] for k in cols}
    for i in range(len(sg)):
        pieces = cut.get(i)
        if not pieces:
            for col in cols:
                out[col].append(cols[col][i])
            continue
        pieces.sort()
        cur = cols["t_start_s"][i]
        for lo, hi, name in pieces:
            lo = max(lo, cur)
            if hi <= lo:
                continue
            if lo > cur:
                _append(out, cols, i, cur, lo, cols["label"][i])
            _append(out, cols, i, lo, hi, label_id(name))
            cur = hi
        if cols["t_end_s"][i] > cur:
            _append(out, cols, i, cur, cols["t_end_s"][i], cols["label"][i])
    report = {
        "ranks": sorted({int(r) for r, *_ in waits}),
        "waits": len(waits),
        "charged_s": dict(sorted(per_rank.items())),
    }
    return Segments.from_columns(**out), report


def _append(out: dict[str, list[Any]], cols: dict[str, list[Any]], i: int, a: float,
            b: float, label: int) -> None:  # fmt: skip
    for col in cols:
        out[col].append(cols[col][i])
    out["label"][-1], out["t_start_s"][-1], out["t_end_s"][-1] = label, a, b


def charge_tp_waits(merge: ServerMerge) -> RawLog:
    """The merged run with the tensor-parallel rule applied (each step's wait on its slowest
    rank carved out of its forward windows, ``meta["tensor_parallel"]`` saying what was
    charged), validated. A run without two ranks that recorded collectives: as merged."""
    log = merge.log
    waits = tp_waits(merge.core, merge.others, merge.fits)
    if waits:
        labels = list(log.labels)
        label_pos = {x: i for i, x in enumerate(labels)}

        def label_id(name: str) -> int:
            if name not in label_pos:
                label_pos[name] = len(labels)
                labels.append(name)
            return label_pos[name]

        segments, report = carve_tp_waits(log, waits, label_id)
        # the report goes after the engine core's own meta, before what the merge added
        meta = {k: v for k, v in log.meta.items() if k in merge.core.log.meta}
        meta["tensor_parallel"] = report
        meta.update((k, v) for k, v in log.meta.items() if k not in meta)
        log = replace(log, segments=segments, labels=tuple(labels), meta=meta)
    return validate_log(log)
