"""The slow, obvious reference implementations of the three partitions, for tests.

Each computes what its vectorised counterpart computes, with plain Python loops over one
gap (or request) and one elementary interval at a time, straight from the written rules:

- `partition_reference`: the ITL partition (`tracekit.attribution.itl.partition`,
  design.md "The partition", docs/gpu.md for device windows);
- `ttft_partition_reference`: the TTFT partition (`tracekit.attribution.ttft`,
  docs/ttft.md);
- `client_partition_reference`: the client-boundary partition
  (`tracekit.attribution.client`), with `partition_reference` for the engine part.
- `client_ttft_reference`: the client-boundary TTFT (`tracekit.attribution.client_ttft`),
  with `ttft_partition_reference` up to the first token.

The tests check that each agrees with its vectorised counterpart. They share with it only
the inputs both read the same way (segment causes, evicted windows, the graph baseline's
fit, drift correction, gap and window extraction), never the timeline arithmetic.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tracekit.attribution.client import (
    FRONTEND_LABELS,
    FRONTEND_OS_LABELS,
    FRONTEND_PRECEDENCE,
    UNRECORDED_LABELS,
    ClientPartition,
    client_gaps,
    engine_part_log,
    frontend_windows,
)
from tracekit.attribution.client_ttft import ClientTtft
from tracekit.attribution.itl import (
    FIT_ALL_CAPTURED,
    PRIMARY_TOL_MS,
    Partition,
    drift_corrected,
    emission_order,
    evicted_windows,
    fit_baseline,
    gaps_of,
    primary_of,
)
from tracekit.attribution.reprefill_reference import ReprefillReference
from tracekit.attribution.timeline import (
    DEVICE_WAIT_LABELS,
    decode_net_ms,
    has_os_evidence,
    host_classes,
    is_os_wait,
    os_intervals,
    os_loop_thread,
    segment_causes,
    side_os_intervals,
)
from tracekit.attribution.ttft import (
    PHASES,
    WAIT_REASON_LABELS,
    TtftPartition,
    pre_engine_windows,
    prefill_shares,
    ttft_labels,
    ttft_notes,
    ttft_windows,
    wait_windows,
)
from tracekit.attribution.ttft import primary_of as ttft_primary_of
from tracekit.labels import (
    OS_BLOCKED,
    OS_LABELS,
    OS_RUNQUEUE,
    RECOMPUTE_CLASS,
    partition_labels,
    precedence,
)
from tracekit.log.rawlog import RawLog

# -- OS evidence, shared by the ITL and TTFT partitions -------------------------------------


def _os_evidence(log: RawLog, points: list[float], owner_name, host_segs):
    """(whether the log has OS evidence, every OS interval end, and `shares(x, who)`: the
    run-queue and blocked shares of the instant just after x, owned by `who`
    (docs/partition.md, "OS evidence"): an interval's run-queue wait, and its off-CPU time
    beyond its explicit waits, spread evenly over its time outside those waits; the loop
    thread's intervals, except at an instant another thread's segment owns (rule 7), where
    that thread's interval there (the lowest such thread's) gives them. `points`: every
    host boundary; `owner_name(t)`: who owns the instant after t; `host_segs`: the host
    segments as (start, end, cause, thread)."""

    def as_list(osi):
        return [
            (float(a), float(b), float(rq), float(off))
            for a, b, rq, off in zip(osi.t0_s, osi.t1_s, osi.runqueue_s, osi.offcpu_s, strict=True)
        ]

    loop = os_loop_thread(log)
    lists = {loop: as_list(os_intervals(log))}
    side = {th: as_list(o) for th, o in side_os_intervals(log).items()}
    os_points = sorted({p for lst in [*lists.values(), *side.values()] for a, b, *_ in lst
                        for p in (a, b)})  # fmt: skip

    def side_thread(x: float, who: str) -> int | None:
        """The lowest other thread whose segment of cause `who` covers x, where no loop
        segment of that cause does and that thread has an interval covering x."""
        if who in ("gc", "residual"):
            return None
        covering = {th for a, b, c, th in host_segs if a <= x < b and c == who}
        if loop in covering:
            return None
        for th in sorted(covering):
            if any(a <= x < b for a, b, _, _ in side.get(th, [])):
                return th
        return None

    def shares(x: float, who: str) -> tuple[float, float]:
        th = side_thread(x, who)
        lst = lists[loop] if th is None else side[th]
        for a, b, rq, off in lst:
            if a <= x < b:
                cuts = sorted({a, b} | {p for p in points if a < p < b})
                wait = sum(
                    y - z
                    for z, y in zip(cuts[:-1], cuts[1:], strict=True)
                    if is_os_wait(owner_name(z))
                    and (th is None or side_thread(z, owner_name(z)) == th)
                )
                rest = b - a - wait  # a thread in an explicit wait is not runnable
                if is_os_wait(who) or rest <= 0:
                    return 0.0, 0.0
                r_share = min(rq, rest) / rest
                return r_share, min(max(off - wait, 0.0) / rest, 1.0 - r_share)
        return 0.0, 0.0

    has = bool(lists[loop]) or bool(side)
    return has, os_points, shares


# -- the ITL partition ---------------------------------------------------------------------


def _itl_labels(log: RawLog) -> tuple[str, ...]:
    """The ITL partition's labels: the host classes, the device windows' causes and, with OS
    evidence, the OS labels, in `partition_labels` order; then, where the run has
    re-prefill segments, their class (folded away by `_fold_reprefill`)."""
    causes_arr = segment_causes(log)
    is_dev = log.segments.is_device == 1
    classes = host_classes(causes_arr, is_dev)
    causes = {c for c, _ in classes} | set(causes_arr[is_dev].tolist())
    os_causes = set(OS_LABELS) if has_os_evidence(log) else set()
    labels = tuple(partition_labels((causes | os_causes) - {RECOMPUTE_CLASS}))
    return labels + ((RECOMPUTE_CLASS,) if RECOMPUTE_CLASS in causes else ())


def _fold_reprefill(labels, parts, context, share: float, other: str) -> tuple[float, float]:
    """One window's re-prefill column (last in `labels`): `share` of it to `preempt`, the
    rest to `other` (others' prefill); in the context all of it to `other`. Returns (own,
    others') ms."""
    h = float(parts[-1])
    parts[labels.index("preempt")] += h * share
    parts[labels.index(other)] += h * (1.0 - share)
    context[labels.index(other)] += context[-1]
    return h * share, h * (1.0 - share)


class _ItlRules:
    """One run as plain lists (drift-corrected), and the ITL rules over one instant, one
    piece of a gap or one gap at a time."""

    def __init__(self, log: RawLog, baseline_fit: str) -> None:
        self.log = log
        causes_arr = segment_causes(log)
        causes = causes_arr.tolist()
        sg, gcp = log.segments, log.gc_pauses
        is_dev = (sg.is_device == 1).tolist()
        classes = host_classes(causes_arr, sg.is_device == 1)
        self.rank = {c: i for i, c in enumerate(classes)}
        self.labels = _itl_labels(log)
        # (start, end, cause, step, is_device) and the thread of each segment
        self.segs = [
            (float(sg.t_start_s[i]), float(sg.t_end_s[i]), causes[i], int(sg.step[i]), is_dev[i])
            for i in range(len(sg))
        ]
        self.threads = sg.thread.tolist()
        self.pauses = [
            (float(a), float(b)) for a, b in zip(gcp.t_start_s, gcp.t_end_s, strict=True)
        ]
        self.base = fit_baseline(log, self.decode_net_ms(), baseline_fit)
        self.host = [x for x in self.segs if not x[4]]
        self.points = sorted({p for a, b, *_ in self.host for p in (a, b)}
                             | {p for ab in self.pauses for p in ab})  # fmt: skip
        host_segs = [
            (a, b, c, th)
            for (a, b, c, _, d), th in zip(self.segs, self.threads, strict=True)
            if not d
        ]
        self.os_list, self.os_points, self.os_shares = _os_evidence(
            log, self.points, lambda t: self.host_owner(t)[0], host_segs
        )
        self.step_threads, self.run_thread = self.loop_threads()
        self.dev_windows, self.last_end = self.device_windows()

    def gc_overlap(self, a: float, b: float) -> float:
        """Length of [a, b] inside the union of pauses: walk the merged pauses."""
        total = 0.0
        merged: list[list[float]] = []
        for pa, pb in sorted(self.pauses):
            if merged and pa <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], pb)
            else:
                merged.append([pa, pb])
        for pa, pb in merged:
            total += max(0.0, min(b, pb) - max(a, pa))
        return total

    def decode_net_ms(self) -> np.ndarray:
        """Rule 4's input: each step's decode time less its GC pauses; a step with device
        decode windows is measured by them alone."""
        net = np.zeros(len(self.log.steps))
        steps_on_device = {s for a, b, c, s, d in self.segs if c == "decode" and d and s >= 0}
        for a, b, c, s, d in self.segs:
            if c != "decode" or s < 0:
                continue
            if s in steps_on_device:
                if d:
                    net[s] += (b - a) * 1e3
            else:
                net[s] += ((b - a) - self.gc_overlap(a, b)) * 1e3
        return net

    def host_owner(self, t: float) -> tuple[str, float]:
        """Rules 2-5: who owns the instant just after t on the host, and the graph rate
        there."""
        if any(pa <= t < pb for pa, pb in self.pauses):
            return "gc", 0.0
        live = [(self.rank[(c, False)], c, s) for a, b, c, s, d in self.host if a <= t < b]
        if not live:
            return "residual", 0.0
        best = min(live)[1]
        if best != "decode":
            return best, 0.0
        frac = self.base.eager_excess_frac
        fr = [frac[s] if s >= 0 else 0.0 for r, c, s in live if c == "decode"]
        return "decode", min(1.0, max(0.0, sum(fr) / len(fr)))

    def loop_threads(self) -> tuple[dict[int, list[int]], int]:
        """The threads whose segments carry each step, and the thread most step segments
        belong to (lowest on a tie)."""
        step_threads: dict[int, list[int]] = {}
        for (_, _, _, s, _), th in zip(self.segs, self.threads, strict=True):
            if s >= 0:
                step_threads.setdefault(s, []).append(th)
        counts = [th for ths in step_threads.values() for th in ths]
        run_thread = min(set(counts), key=lambda th: (-counts.count(th), th)) if counts else 0
        return step_threads, run_thread

    def loop_thread(self, step: int) -> int:
        """The loop thread of an emission of `step`: the thread whose segments carry its step
        (the lowest if several); else the run's loop thread."""
        return min(self.step_threads[step]) if step in self.step_threads else self.run_thread

    def loop_busy(self, x: float, thread: int) -> bool:
        """Whether the loop thread's own work (a host segment of it other than a wait)
        covers the instant just after x."""
        return any(
            a <= x < b and th == thread and c not in DEVICE_WAIT_LABELS
            for (a, b, c, _, d), th in zip(self.segs, self.threads, strict=True)
            if not d
        )

    def loop_busy_before(self, x: float, thread: int) -> bool:
        before = [p for p in self.points if p < x]
        return bool(before) and self.loop_busy(max(before), thread)

    def device_windows(self) -> tuple[list[tuple[float, float, str, int]], dict[int, float]]:
        """Device windows, disjoint over the run (the earlier start owns an overlap), and
        where each step's device work ends (its last window as recorded)."""
        device_segs = sorted(
            (x for x in self.segs if x[4] and x[3] >= 0), key=lambda x: (x[0], x[3], x[1])
        )
        dev_windows: list[tuple[float, float, str, int]] = []
        busy_until = -np.inf
        last_end: dict[int, float] = {}
        for a, b, c, s, _ in device_segs:
            last_end[s] = max(last_end.get(s, -np.inf), b)
            if b > max(a, busy_until):
                dev_windows.append((max(a, busy_until), b, c, s))
            busy_until = max(busy_until, b)
        return dev_windows, last_end

    def tally(self, a: float, b: float, pieces=(), thread=None, use_os=False) -> dict[str, float]:
        """Each instant's owner by the host rules, except where a device piece covers it:
        there the piece owns it, unless `thread` (host-bound: the loop thread) is given and
        its own work covers the instant. With `use_os`, the OS shares of each instant are
        taken from its owner. ``"<device>"``: the time whose owner a device piece changed."""
        out = dict.fromkeys(self.labels, 0.0)
        cuts = sorted({a, b} | {p for pa, pb, _, _ in pieces for p in (pa, pb) if a < p < b}
                      | {p for p in self.points if a < p < b}
                      | {p for p in self.os_points if a < p < b})  # fmt: skip
        for x, y in zip(cuts[:-1], cuts[1:], strict=True):
            ms = (y - x) * 1e3
            dev = [(c, fr) for pa, pb, c, fr in pieces if pa <= x < pb]
            who, rate = self.host_owner(x)
            # device-bound: a device window owns its time; host-bound: only the time
            # outside the loop thread's own work (a GC pause or another thread's work
            # there interrupted a wait for the device)
            if dev and (thread is None or not self.loop_busy(x, thread)):
                if (who, rate) != (dev[0][0], dev[0][1]):  # the time the device path moved
                    out["<device>"] = out.get("<device>", 0.0) + ms
                who, rate = dev[0][0], dev[0][1]
            if use_os and self.os_list:
                r_share, b_share = self.os_shares(x, who)
                out[OS_RUNQUEUE] += ms * r_share
                out[OS_BLOCKED] += ms * b_share
                ms *= 1.0 - r_share - b_share
            if who == "decode":
                out["graph"] += ms * rate
                out["forward"] += ms * (1 - rate)
            else:
                out[who] += ms
        return out

    def device_pieces(self, t0: float, t1: float, ds: int, step1: int):
        """Rule 6: the device windows on the gap's path (those that ended by the read step
        `ds`'s device work, in the gap) as (start, end, cause, graph fraction), and the loop
        thread if the gap is host-bound (its own work covers the instant before the finish)
        else None."""
        if not (ds in self.last_end and min(self.last_end[ds], t1) > t0):
            return [], None
        th = self.loop_thread(step1)
        bound_by = th if self.loop_busy_before(min(self.last_end[ds], t1), th) else None
        frac = self.base.eager_excess_frac
        pieces = [
            (max(a, t0), min(b, t1), c, float(frac[s]) if c == "decode" else 0.0)
            for a, b, c, s in self.dev_windows
            if b <= self.last_end[ds] and min(b, t1) > max(a, t0)
        ]
        return pieces, bound_by

    def gap(self, t0: float, t1: float, windows, ds: int, step1: int):
        """One gap's (parts, context) by label, its evicted `windows` given (clipped)."""
        labels = self.labels
        parts = np.zeros(len(labels))
        context = np.zeros(len(labels))
        # rule 1: the live time is the gap less its evicted windows
        live, cur = [], t0
        for a, b in sorted(windows):
            if a > cur:
                live.append((cur, a))
            cur = max(cur, b)
        if cur < t1:
            live.append((cur, t1))
        # rule 6 (a gap with an eviction uses the host rules only)
        pieces, bound_by = self.device_pieces(t0, t1, ds, step1) if not windows else ([], None)
        tallies = [self.tally(a, b, pieces, bound_by, use_os=True) for a, b in live]
        # rule 7, unless the device's path changed the parts (beyond float rounding)
        if sum(t.get("<device>", 0.0) for t in tallies) > PRIMARY_TOL_MS:
            tallies = [self.tally(a, b, pieces, bound_by) for a, b in live]
        for t in tallies:
            for lb, v in t.items():
                if lb != "<device>":
                    parts[labels.index(lb)] += v
        for a, b in windows:
            parts[labels.index("preempt")] += (b - a) * 1e3
            for lb, v in self.tally(a, b).items():
                context[labels.index(lb)] += v
        return parts, context


def partition_reference(log: RawLog, *, baseline_fit: str = FIT_ALL_CAPTURED) -> Partition:
    """The same partition with plain Python loops, one gap and one slice at a time."""
    rules = _ItlRules(drift_corrected(log), baseline_fit)
    log, labels = rules.log, rules.labels
    order = emission_order(log)
    em = log.emissions
    r_sorted = em.request[order]
    closing = np.flatnonzero(r_sorted[1:] == r_sorted[:-1]) + 1
    g_dstep = em.device_step[order][closing]

    g_req, g_t0, g_t1, g_s0, g_s1 = gaps_of(log)
    e_req, e_a, e_b = evicted_windows(log)
    parts = np.zeros((len(g_req), len(labels)))
    context = np.zeros_like(parts)
    n_ev = np.zeros(len(g_req), dtype=np.int64)
    rc = labels[-1] == RECOMPUTE_CLASS
    re_pf = ReprefillReference(log) if rc else None
    split = np.zeros((len(g_req), 2))
    for i in range(len(g_req)):
        t0, t1, r = float(g_t0[i]), float(g_t1[i]), int(g_req[i])
        windows = [
            (max(a, t0), min(b, t1))
            for rr, a, b in zip(e_req, e_a, e_b, strict=True)
            if rr == r and min(b, t1) > max(a, t0)
        ]
        n_ev[i] = len(windows)
        parts[i], context[i] = rules.gap(t0, t1, windows, int(g_dstep[i]), int(g_s1[i]))
        if re_pf is not None:
            share = re_pf.own_share(r, t0, t1, windows) if parts[i, -1] != 0.0 else 0.0
            split[i] = _fold_reprefill(labels, parts[i], context[i], share, "prefill")
    if rc:
        labels, parts, context = labels[:-1], parts[:, :-1], context[:, :-1]
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
        reprefill_own_ms=split[:, 0],
        reprefill_other_ms=split[:, 1],
        num_evictions=n_ev,
        primary=primary,
        causes=prim_causes,
        baseline=rules.base,
    )


# -- the TTFT partition ------------------------------------------------------------------


def os_taken_reference(log: RawLog, xs: list[float], labels: frozenset[str]) -> list[float]:
    """The time the OS took from the engine's threads, of the OS `labels` (`os_runqueue`,
    `os_blocked`), from the run's start to each x, seconds: each instant's shares by the ITL
    rules (docs/partition.md, "OS evidence", rules 1, 2, 5 and 7), summed over the run with
    a walk between every boundary, one x at a time."""
    rules = _ItlRules(drift_corrected(log), FIT_ALL_CAPTURED)
    cuts = sorted(set(rules.points) | set(rules.os_points))
    out = []
    for x in xs:
        total = 0.0
        for z, y in zip(cuts[:-1], cuts[1:], strict=True):
            if z >= x:
                break
            r_share, b_share = rules.os_shares(z, rules.host_owner(z)[0])
            share = (r_share if OS_RUNQUEUE in labels else 0.0) + (
                b_share if OS_BLOCKED in labels else 0.0
            )
            total += (min(y, x) - z) * share
        out.append(total)
    return out


def _add_host(into: dict[str, float], who: str, ms: float, rate: float) -> None:
    """Context: what the host ran, by label (prefill that ran while held was others'; time
    nothing covered is `residual`)."""
    if who == "decode":
        into["graph"] += ms * rate
        into["decode_other"] += ms * (1 - rate)
    elif who in ("prefill", RECOMPUTE_CLASS):  # a re-prefill while held: others' too
        into["prefill_other"] += ms
    else:
        into[who] += ms


class _TtftRules:
    """One run as plain lists, and the TTFT rules (docs/ttft.md) over one instant or one
    request at a time."""

    def __init__(self, log: RawLog) -> None:
        self.log = log
        self.labels = ttft_labels(log)
        causes_arr = segment_causes(log)
        sg = log.segments
        # host segments as (start, end, cause, step)
        self.host = [
            (float(sg.t_start_s[i]), float(sg.t_end_s[i]), str(causes_arr[i]), int(sg.step[i]))
            for i in range(len(sg))
            if sg.is_device[i] != 1
        ]
        order = precedence({c for _, _, c, _ in self.host})
        self.rank = {c: i for i, c in enumerate(order)}
        self.base = fit_baseline(log, decode_net_ms(log, causes_arr))
        self.pauses = list(
            zip(log.gc_pauses.t_start_s.tolist(), log.gc_pauses.t_end_s.tolist(), strict=True)
        )
        self.share = prefill_shares(log)
        self.waits = wait_windows(log)
        self.evictions = evicted_windows(log)
        self.points = sorted({p for s0, s1, _, _ in self.host for p in (s0, s1)}
                             | {p for ab in self.pauses for p in ab})  # fmt: skip
        host_segs = [
            (float(sg.t_start_s[i]), float(sg.t_end_s[i]), str(causes_arr[i]), int(sg.thread[i]))
            for i in range(len(sg))
            if sg.is_device[i] != 1
        ]
        self.os_list, self.os_points, self.os_shares = _os_evidence(
            log, self.points, lambda t: self.owner(t)[0], host_segs
        )
        self.reprefill = ReprefillReference(log)

    def owner(self, x: float) -> tuple[str, float, list[int]]:
        """Rules 2, 4, 5: who owns the instant just after x on the host: (cause, graph rate,
        the steps of the prefill segments covering it)."""
        if any(pa <= x < pb for pa, pb in self.pauses):
            return "gc", 0.0, []
        live = [(self.rank[c], c, s) for s0, s1, c, s in self.host if s0 <= x < s1]
        if not live:
            return "residual", 0.0, []
        best = min(live)[1]
        if best == "decode":
            frac = self.base.eager_excess_frac
            fr = [frac[s] if s >= 0 else 0.0 for _, c, s in live if c == "decode"]
            return "decode", min(1.0, max(0.0, sum(fr) / len(fr))), []
        if best == "prefill":
            return "prefill", 0.0, [s for _, c, s in live if c == "prefill" and s >= 0]
        return best, 0.0, []

    def of_request(self, r: int):
        """Request r's evicted windows, wait windows (start, end, label) and share of each
        step's prefill tokens."""
        e_req, e_a, e_b = self.evictions
        evicted = [
            (float(x), float(y)) for rr, x, y in zip(e_req, e_a, e_b, strict=True) if rr == r
        ]
        q_req, q0, q1, q_reason = self.waits
        waits = [
            (float(x), float(y), WAIT_REASON_LABELS[int(k)])
            for rr, x, y, k in zip(q_req, q0, q1, q_reason, strict=True)
            if rr == r
        ]
        pf = self.log.prefill_chunks
        my_share = {
            int(s): float(self.share[j])
            for j, (s, rr) in enumerate(zip(pf.step, pf.request, strict=True))
            if rr == r
        }
        return evicted, waits, my_share

    def pre_engine(self, row: dict[str, float], r: int, a: float, h: float, e: float) -> None:
        """Rule 0: arrival to the handler is http, then frontend to the engine core's add,
        less what the OS took of the API server's event loop meanwhile."""
        if "http" in row:
            row["http"] += (h - a) * 1e3
            row["frontend"] += (e - h) * 1e3
        if FRONTEND_OS_LABELS[0] not in row:
            return
        # the event loop of the API server that wrote the request's first chunk: each of
        # its OS intervals' shares of the overlap (off-CPU time: inside a segment only)
        ce = self.log.client_emissions
        mine = [j for j in range(len(ce)) if int(ce.request[j]) == r]
        proc = int(ce.process[min(mine, key=lambda j: ce.t_s[j])]) if mine else -1
        po = self.log.proc_os
        for j in range(len(po)):
            if int(po.process[j]) != proc:
                continue
            s0, s1 = float(po.t_start_s[j]), float(po.t_end_s[j])
            for lb, lo, hi in (("http", a, h), ("frontend", h, e)):
                d = max(0.0, min(hi, s1) - max(lo, s0))
                if d <= 0:
                    continue
                rq = d * float(po.runqueue_s[j]) / (s1 - s0)
                bl = d * float(po.offcpu_s[j]) / (s1 - s0) if po.in_segment[j] == 1 else 0.0
                row[lb] -= (rq + bl) * 1e3
                row[FRONTEND_OS_LABELS[0]] += rq * 1e3
                row[FRONTEND_OS_LABELS[1]] += bl * 1e3

    def request(self, r: int, a: float, adm: float, f: float, h: float, e: float):
        """One request's (parts, context, phases): arrival `a`, admission `adm` (NaN:
        unsplit), first token `f`, handler start `h`, engine core's add `e`."""
        labels = self.labels
        is_split = adm == adm  # not NaN
        evicted, waits, my_share = self.of_request(r)
        row = dict.fromkeys(labels, 0.0)
        phases = np.zeros(len(PHASES))
        self.pre_engine(row, r, a, h, e)
        phases[PHASES.index("queued" if is_split else "unsplit")] += (e - a) * 1e3
        a = e  # the rules below apply from the engine core's add on
        cuts = {a, f} | ({adm} if is_split else set())
        cuts |= {p for s0, s1, _, _ in self.host for p in (s0, s1)}
        cuts |= {p for pa, pb in self.pauses for p in (pa, pb)}
        cuts |= {p for x, y in evicted for p in (x, y)}
        cuts |= {p for x, y, _ in waits for p in (x, y)}
        cuts |= set(self.os_points)
        pts = sorted(p for p in cuts if a <= p <= f and np.isfinite(p))
        own_raw = prefill_live = prefill_all = reprefill = 0.0
        ctx = dict.fromkeys(labels, 0.0)
        for x, y in zip(pts[:-1], pts[1:], strict=True):
            ms = (y - x) * 1e3
            who, rate, psteps = self.owner(x)

            phase = "unsplit" if not is_split else ("queued" if x < adm else "prefilling")
            if any(ex <= x < ey for ex, ey in evicted):  # rule 1
                row["preempt"] += ms
                phases[PHASES.index("evicted")] += ms
                _add_host(ctx, who, ms, rate)
                continue
            phases[PHASES.index(phase)] += ms
            held = [lb for wx, wy, lb in waits if wx <= x < wy] if phase == "queued" else []
            if held and who != "gc":  # rule 3
                row[held[0]] += ms
                _add_host(ctx, who, ms, rate)
                continue
            if self.os_list:  # rule 6: the OS shares of live time the rules below own
                r_share, b_share = self.os_shares(x, who)
                row[OS_RUNQUEUE] += ms * r_share
                row[OS_BLOCKED] += ms * b_share
                ms *= 1.0 - r_share - b_share
            if who == "decode":  # rule 4
                row["graph"] += ms * rate
                row["decode_other"] += ms * (1 - rate)
            elif who == RECOMPUTE_CLASS:
                reprefill += ms
            elif who == "prefill":
                prefill_all += ms
                if phase == "prefilling":
                    prefill_live += ms
                    own_raw += ms * sum(my_share.get(s, 0.0) for s in psteps)
            else:
                row[who] += ms
        if is_split:
            own = min(own_raw, prefill_live)
            row["prefill_own"] += own
            row["prefill_other"] += prefill_all - own
        else:
            row["prefill"] += prefill_all
        # a re-prefill: the request's own (over its live time) is preempt, others' prefill
        held = [(max(x, a), min(y, adm)) for x, y, _ in waits] if is_split else []
        share = self.reprefill.own_share(r, a, f, evicted + held) if reprefill else 0.0
        row["preempt"] += reprefill * share
        row["prefill_other" if is_split else "prefill"] += reprefill * (1.0 - share)
        split = (reprefill * share, reprefill * (1.0 - share))
        return [row[lb] for lb in labels], [ctx[lb] for lb in labels], phases, split


def ttft_partition_reference(log: RawLog) -> TtftPartition:
    """The same partition with plain loops, one request and one elementary interval at a time."""
    rules = _TtftRules(log)
    labels = rules.labels
    req, a_all, adm_all, f_all = ttft_windows(log)
    h_all, e_all = pre_engine_windows(log, req, a_all, f_all)
    n = len(req)
    parts = np.zeros((n, len(labels)))
    context = np.zeros_like(parts)
    phases = np.zeros((n, len(PHASES)))
    split = np.zeros((n, 2))
    for i in range(n):
        parts[i], context[i], phases[i], split[i] = rules.request(
            int(req[i]), float(a_all[i]), float(adm_all[i]), float(f_all[i]),
            float(h_all[i]), float(e_all[i]),
        )  # fmt: skip
    ttft_ms = (f_all - a_all) * 1e3
    primary, prim_causes = ttft_primary_of(parts, ttft_ms, labels)
    return TtftPartition(
        labels=labels,
        request=req,
        arrival_s=a_all,
        admit_s=adm_all,
        first_token_s=f_all,
        ttft_ms=ttft_ms,
        parts_ms=parts,
        context_ms=context,
        phases_ms=phases,
        reprefill_own_ms=split[:, 0],
        reprefill_other_ms=split[:, 1],
        primary=primary,
        causes=prim_causes,
        notes=ttft_notes(log, np.isfinite(adm_all)),
    )


# -- the client-boundary partition --------------------------------------------------------


def _engine_extent(g, i: int) -> tuple[float, bool, float, float]:
    """Gap i's point x from which the token existed (or its existence is unrecorded),
    whether the core's span ends in the gap before the token was recorded, and the engine
    part [a, x] where the core recorded (one interval; [a, a] for none)."""
    a, b, core_end = float(g.a[i]), float(g.b[i]), float(g.core_hi[i])
    unknown = bool(np.isnan(g.e[i]))
    cut = unknown and b > core_end
    if cut:
        x = min(max(core_end, a), b)
    elif unknown:
        x = a
    else:
        x = min(max(float(g.e[i]), a), b)
    lo, hi = max(a, float(g.core_lo[i])), min(x, core_end)
    return x, cut, (lo if hi > lo else a), (hi if hi > lo else a)


def _api_server(log: RawLog, proc: int):
    """An API server's windows (start, end, precedence rank) and OS intervals (start, end,
    run-queue wait, off-CPU time: only inside a segment, as the loop may idle between)."""
    po = log.proc_os
    osi = [
        (float(po.t_start_s[j]), float(po.t_end_s[j]), float(po.runqueue_s[j]),
         float(po.offcpu_s[j]) if po.in_segment[j] == 1 else 0.0)
        for j in range(len(po)) if int(po.process[j]) == proc
    ]  # fmt: skip
    return frontend_windows(log, proc), osi


def _client_gap(g, i: int, x: float, cut: bool, wins, osi, row: list[float], ne: int):
    """Gap i's frontend columns (added to `row`, after the `ne` engine ones) and its
    unrecorded time (engine core, API server), ms: each piece between consecutive marks
    named by the written rule."""
    nf = len(FRONTEND_PRECEDENCE)
    u_core = u_api = 0.0
    a, b = float(g.a[i]), float(g.b[i])
    c_lo, c_hi = float(g.core_lo[i]), float(g.core_hi[i])
    f_lo, f_hi = float(g.fe_lo[i]), float(g.fe_hi[i])
    e = float(g.e[i]) if not np.isnan(g.e[i]) else b
    recv = float(g.recv[i]) if not np.isnan(g.recv[i]) else e
    marks = (c_lo, c_hi, f_lo, f_hi, x, e, recv, *(t for s, en, _ in wins for t in (s, en)),
             *(t for s, en, _, _ in osi for t in (s, en)))  # fmt: skip
    cuts = sorted({a, b, *(t for t in marks if a < t < b)})
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=False):
        mid, d = (lo + hi) / 2, (hi - lo) * 1e3
        if mid < x:  # the engine part
            if not c_lo <= mid < c_hi:
                u_core += d  # (its recorded time is partition_reference's)
            continue
        if cut:
            u_core += d
            continue
        if not f_lo <= mid < f_hi:
            u_api += d
            continue
        owners = [c for s, en, c in wins if s <= mid < en]
        if owners:
            col = ne + min(owners)
        elif e <= mid < recv:
            col = ne + nf
        else:
            col = ne + nf + 1
        # inside an OS interval of the API server: its shares of the piece are the OS's
        over = [(rq / (en - s), bl / (en - s)) for s, en, rq, bl in osi if s <= mid < en]
        rq_f, bl_f = over[0] if over else (0.0, 0.0)
        row[col] += d * (1.0 - rq_f - bl_f)
        if over:
            row[ne + nf + 2] += d * rq_f
            row[ne + nf + 3] += d * bl_f
    return u_core, u_api


def client_partition_reference(log: RawLog) -> ClientPartition:
    """`client_partition` with plain loops: each gap cut at every coverage edge and window
    boundary inside it, each piece named by the written rule (docs/partition.md,
    "Unrecorded windows", then the frontend precedence): where the engine core recorded
    nothing, ``unrecorded:engine_core``; in the frontend part where the API server that wrote
    the chunk recorded nothing, ``unrecorded:api_server``; else the first window (by
    precedence) covering it, less, inside one of that API server's OS intervals
    (``proc_os``), the interval's run-queue share of the piece (``frontend_os_runqueue``)
    and, for an interval inside a segment, its off-CPU share (``frontend_os_blocked``)."""
    g = client_gaps(log)
    n = len(g.a)
    extents = [_engine_extent(g, i) for i in range(n)]
    xs = [x for x, _, _, _ in extents]
    lo_a = np.array([lo for _, _, lo, _ in extents], dtype=np.float64)
    hi_a = np.array([hi for _, _, _, hi in extents], dtype=np.float64)
    live = [i for i in range(n) if hi_a[i] > lo_a[i]]
    if live:
        eng = partition_reference(engine_part_log(log, g, lo_a, hi_a))
        eng_labels, eng_rows = eng.labels, {live[int(q)]: eng.parts_ms[j]
                                            for j, q in enumerate(eng.request)}  # fmt: skip
    else:
        eng_labels = tuple(x for x in _itl_labels(drift_corrected(log)) if x != RECOMPUTE_CLASS)
        eng_rows = {}
    with_os = len(log.proc_os) > 0
    os_labels = FRONTEND_OS_LABELS if with_os else ()
    ne = len(eng_labels)
    nfl = len(FRONTEND_LABELS) + len(os_labels)
    servers: dict[int, tuple] = {}
    rows, unrec = [], []
    for i, (x, cut, _, _) in enumerate(extents):
        proc = int(g.process[i])
        if proc not in servers:  # only the API server that wrote the chunk
            servers[proc] = _api_server(log, proc)
        wins, osi = servers[proc]
        row = [0.0] * (ne + nfl)
        if i in eng_rows:
            row[:ne] = eng_rows[i].tolist()
        unrec.append(_client_gap(g, i, x, cut, wins, osi, row, ne))
        rows.append(row)
    u = np.array(unrec, dtype=np.float64).reshape(n, 2)
    present = [j for j in range(2) if (u[:, j] > 0).any()]
    labels = (*eng_labels, *FRONTEND_LABELS, *os_labels, *(UNRECORDED_LABELS[j] for j in present))
    parts = np.array(rows, dtype=np.float64).reshape(n, ne + nfl)
    parts = np.concatenate([parts, u[:, present]], axis=1)
    return ClientPartition(
        labels=labels,
        request=g.request,
        t0_s=g.a,
        t1_s=g.b,
        engine_s=np.array(xs, dtype=np.float64),
        num_tokens=g.num_tokens,
        gap_ms=(g.b - g.a) * 1e3,
        parts_ms=parts,
    )


# -- the client-boundary TTFT ---------------------------------------------------------------


def _first_of(rows: list[tuple[float, int, int]]) -> tuple[float, int] | None:
    """(t, value) of the earliest (t, row, value), the first row among equal times."""
    if not rows:
        return None
    t, _, value = min(rows)
    return t, value


def client_ttft_reference(log: RawLog) -> ClientTtft:
    """`client_ttft_partition` with plain loops: the engine boundary's TTFT parts
    (`ttft_partition_reference`) up to the first token, then the first chunk's window [first
    token, write] cut at every window, OS interval and span edge inside it, each piece named
    by the client gap's frontend rules (`_client_gap`, as for a gap's frontend part)."""
    eng = ttft_partition_reference(log)
    ce, em, dl, cov = log.client_emissions, log.emissions, log.deliveries, log.coverage
    notes: list[str] = []
    rows, front_rows, unrec = [], [], []
    none = early = 0
    for i in range(len(eng)):
        r, a, f = int(eng.request[i]), float(eng.arrival_s[i]), float(eng.first_token_s[i])
        chunk = _first_of([(float(ce.t_s[j]), j, int(ce.process[j]))
                           for j in range(len(ce)) if int(ce.request[j]) == r])  # fmt: skip
        if chunk is None:
            none += 1
            continue
        w, proc = chunk
        if w < f:
            early += 1
            continue
        first = _first_of([(float(em.t_s[j]), j, int(em.step[j]))
                           for j in range(len(em)) if int(em.request[j]) == r])  # fmt: skip
        step = first[1] if first is not None else -1
        recv = [float(dl.t_recv_s[j]) for j in range(len(dl))
                if int(dl.step[j]) == step and int(dl.process[j]) == proc]  # fmt: skip
        span = [(float(cov.t_start_s[j]), float(cov.t_end_s[j]))
                for j in range(len(cov)) if int(cov.process[j]) == proc]  # fmt: skip
        fe_lo, fe_hi = span[0] if span else (-np.inf, np.inf)
        # one pseudo gap [f, w]: the engine part is empty (x = a = f), the core's span all time
        g = SimpleNamespace(
            a=[f],
            b=[w],
            e=[f],
            recv=[recv[0] if recv else np.nan],
            core_lo=[-np.inf],
            core_hi=[np.inf],
            fe_lo=[fe_lo],
            fe_hi=[fe_hi],
        )
        row = [0.0] * (len(FRONTEND_LABELS) + len(FRONTEND_OS_LABELS))
        wins, osi = _api_server(log, proc)
        _, u_api = _client_gap(g, 0, f, False, wins, osi, row, 0)
        rows.append((i, r, a, f, w, proc))
        front_rows.append(row)
        unrec.append(u_api)
    if none:
        notes.append(f"{none} request(s) with a TTFT have no client-boundary TTFT: no chunk was "
                     "written for them")  # fmt: skip
    if early:
        notes.append(
            f"{early} request(s) left out of the client boundary: first chunk written "
            "before the engine core's first token (the processes' clocks disagree)"
        )
    labels = tuple(eng.labels) + FRONTEND_LABELS
    if len(log.proc_os):
        labels += tuple(lb for lb in FRONTEND_OS_LABELS if lb not in eng.labels)
    if any(u > 0 for u in unrec):
        labels += (UNRECORDED_LABELS[1],)
    parts = np.zeros((len(rows), len(labels)))
    for k, (i, *_rest) in enumerate(rows):
        named = dict(zip(eng.labels, eng.parts_ms[i].tolist(), strict=True))
        for lb, v in zip((*FRONTEND_LABELS, *FRONTEND_OS_LABELS), front_rows[k], strict=True):
            named[lb] = named.get(lb, 0.0) + v
        named[UNRECORDED_LABELS[1]] = unrec[k]
        parts[k] = [named.get(lb, 0.0) for lb in labels]
    col = np.array([[r, a, f, w, p] for _, r, a, f, w, p in rows], dtype=np.float64).reshape(-1, 5)
    return ClientTtft(
        labels=labels,
        request=col[:, 0].astype(np.int64),
        arrival_s=col[:, 1],
        first_token_s=col[:, 2],
        write_s=col[:, 3],
        process=col[:, 4].astype(np.int64),
        ttft_ms=(col[:, 3] - col[:, 1]) * 1e3,
        engine_ttft_ms=eng.ttft_ms[[i for i, *_ in rows]],
        parts_ms=parts,
        notes=tuple(notes),
    )


__all__ = [
    "client_partition_reference",
    "client_ttft_reference",
    "partition_reference",
    "ttft_partition_reference",
]
