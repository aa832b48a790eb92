"""Chrome trace-event JSON for Perfetto (ui.perfetto.dev) and chrome://tracing.

One run becomes these tracks (Chrome's JSON trace format, times in microseconds from
engine start; shifted by whole µs when something happened before it, such as an arrival
before the recorder started, so that no ``ts`` is negative: see `engine_start_us`):

- process ``engine`` (pid 1):
  - ``engine loop``: every step as a complete slice (``ph: X``, name ``step``) with the
    loop thread's segments (``prefill``, ``decode``, ``tok``, ...) nested inside; windows
    that overlap without nesting go to ``engine loop (overlap N)`` tracks, so every track
    stays well nested;
  - ``thread N`` / ``device N``: segments recorded on other threads or as device time;
  - ``gc``: every collection, args ``generation``;
  - counters (``ph: C``) for every sampled engine counter (``batch_size``,
    ``kv_free_blocks``, ...); Perfetto names the track ``NAME value``;
  - a tensor-parallel run (merged, with ``rankR:CAUSE`` waits): one track per rank,
    ``tp rank R``, with each step's wait on that rank (slices named ``rankR:CAUSE``) and,
    around them, a ``held slow step`` slice for every slow step the rank held
    (`tracekit.analysis.ranks`: the rank with the most wait in a step that closed a tail
    gap), args ``step``, ``wait_ms`` (by rank) and ``cause``;
- process ``requests`` (pid 2): one thread track per request, named ``req ID``:
  - ``ttft``: arrival to first token, with ``args.parts`` and ``args.phases`` (ms; each
    sums to ``args.ttft_ms``) and ``args.primary`` when the TTFT partition is given;
  - every gap as a slice named by its *primary cause* (``clean``, ``preempt``, ``gc``, ...),
    with ``args.parts`` (ms by label; they sum to the slice's duration), ``args.gap_ms``
    and the two emissions' steps;
  - ``evicted``: the time the request was evicted, nested inside the slice it falls in
    (it is the gap's ``preempt`` part), or on its own where no slice covers it;
- flow arrows (``ph: s`` / ``f``, name ``eviction``, category ``eviction``) from the step
  that decided an eviction (on ``engine loop``, at the eviction's time) to the victim's
  track, one per eviction with a recorded cause (docs/partition.md, "Who evicted whom");
  the arrow's start carries ``args`` ``victim``, ``evictors``, ``reason``, ``step`` and
  ``num_computed_tokens_lost``. Post-run only: the live trace draws none.

Slice names are the partition's labels, so one cause has one colour throughout Perfetto
(it colours slices by name; ``cname`` is ignored).

`chrome_trace_events` builds the events (plain dicts), `write_trace` serialises them once
(gzip when the name ends in ``.gz``, byte-identical for the same input), `validate_trace`
checks what Perfetto needs.

The track layout, track names and slice arguments are defined once, below ("the layout"),
and used by this post-run trace and by the trace written while a run records
(`tracekit.live.trace.ChromeTraceSink`): the two show one run the same way, except what
needs the whole run (a gap's cause and ``parts``, the TTFT partition, overlap lanes).
"""

from __future__ import annotations

import gzip
import heapq
import io
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tracekit.analysis.ranks import rank_labels, rank_view
from tracekit.attribution.itl import Partition, evicted_windows
from tracekit.attribution.ttft import PHASES as TTFT_PHASES
from tracekit.attribution.ttft import TtftPartition
from tracekit.errors import UsageError
from tracekit.fsio import atomic_write
from tracekit.labels import cause_of
from tracekit.log.rawlog import PREEMPT_REASONS, RawLog

PID_ENGINE = 1
PID_REQUESTS = 2
TID_LOOP = 1
TID_GC = 2
TID_THREADS = 100  # + recording thread number (host segments off the loop thread)
TID_DEVICE = 200  # + recording thread number (device-time segments)
TID_OVERLAP = 1000  # + lane: windows that overlap others without nesting
TID_GC_OVERLAP = 1500  # + lane: gc pauses that overlap each other
TID_RANKS = 5000  # + tensor-parallel rank: the steps' waits on that rank
#: + request index. Thread ids are kept distinct across the two processes: Perfetto keys
#: JSON threads by tid, so a request must never share one with an engine track.
TID_REQUESTS = 10_000
#: Tolerance of the validator, in microseconds: times are rounded to whole nanoseconds
#: and parts to 1e-6 ms, so a well-formed trace is off by a few ns at most.
TOL_US = 0.01
PARTS_DECIMALS = 6  # ms: whole nanoseconds


# -- the layout: tracks, their names, slice arguments (post-run and live traces alike) -----

#: A step slice's args, in order (``step`` is the step's index in the run).
STEP_ARGS = ("step", "num_decode", "num_prefill_tokens", "graph_size", "num_preempted",
             "num_swapped_in")  # fmt: skip
#: A gap slice's args, in order. The live trace has no ``parts`` (and names every gap
#: ``gap``): a gap's cause needs the whole run's partition.
GAP_ARGS = ("gap_ms", "parts", "step0", "step1")
#: The slice name of a gap in the live trace.
LIVE_GAP_NAME = "gap"


def request_tid(r: Any) -> Any:
    """The thread id of request `r`'s track (an index, or an array of them)."""
    return TID_REQUESTS + r


def request_track_name(request_id: str) -> str:
    return f"req {request_id}"


def thread_track(is_device: int, thread: int) -> tuple[int, str]:
    """The track (tid, name) of the segments recorded on `thread` (host or device time)."""
    if (is_device, thread) == (0, 0):
        return TID_LOOP, "engine loop"
    if is_device:
        return TID_DEVICE + thread, f"device {thread}"
    return TID_THREADS + thread, f"thread {thread}"


def header_events() -> list[dict[str, Any]]:
    """The processes and the engine's fixed tracks, named and ordered."""
    return [
        _meta(PID_ENGINE, None, "process_name", "engine"),
        _meta(PID_ENGINE, None, "process_sort_index", 0),
        _meta(PID_REQUESTS, None, "process_name", "requests"),
        _meta(PID_REQUESTS, None, "process_sort_index", 1),
        _meta(PID_ENGINE, TID_LOOP, "thread_name", "engine loop"),
        _meta(PID_ENGINE, TID_LOOP, "thread_sort_index", 0),
        _meta(PID_ENGINE, TID_GC, "thread_name", "gc"),
        _meta(PID_ENGINE, TID_GC, "thread_sort_index", 1),
    ]


def track_events(pid: int, tid: int, name: str, sort_index: int) -> list[dict[str, Any]]:
    """A track's name and place."""
    return [
        _meta(pid, tid, "thread_name", name),
        _meta(pid, tid, "thread_sort_index", sort_index),
    ]


def evicted_event(tid: int, a_ns: int, b_ns: int) -> dict[str, Any]:
    """An ``evicted`` slice on a request's track, from ns `a_ns` to `b_ns`."""
    return {
        "ph": "X",
        "pid": PID_REQUESTS,
        "tid": tid,
        "ts": _us(a_ns),
        "dur": _us(b_ns - a_ns),
        "name": "evicted",
        "args": {"evicted_ms": (b_ns - a_ns) / 1e6},
    }


def meta_event(pid: int, tid: int | None, name: str, value: Any) -> dict[str, Any]:
    """A metadata event (``process_name``, ``thread_sort_index``, ...)."""
    return _meta(pid, tid, name, value)


def _ns(t_s: np.ndarray) -> np.ndarray:
    """Seconds (engine clock) to integer nanoseconds: every boundary is rounded once, so
    nesting survives rounding (rounding is monotone)."""
    return np.round(np.asarray(t_s, dtype=np.float64) * 1e9).astype(np.int64)


def _us(ns: int) -> float:
    """Integer ns to µs; Perfetto reads ``ts * 1000`` back to the same nanosecond."""
    return ns / 1000


def _overlaps(a_s: np.ndarray, b_s: np.ndarray, window_s: tuple[float, float] | None):
    if window_s is None:
        return np.ones(len(a_s), dtype=bool)
    lo, hi = window_s  # [lo, hi), as every window is: what starts at hi is after it
    return (b_s >= lo) & (a_s < hi)


def _meta(pid: int, tid: int | None, name: str, value: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"ph": "M", "pid": pid, "name": name, "args": {}}
    if tid is not None:
        ev["tid"] = tid
    ev["args"] = {"sort_index": value} if name.endswith("sort_index") else {"name": value}
    return ev


def _lanes(starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Assign each interval (in the given order, sorted by start then longest first) to
    the first lane where it nests in or follows what is open there.

    The same answer as `_lanes_reference`, in O(n log n) however many lanes there are
    (20,000 windows that all overlap need 20,000 lanes): a lane's open slices nest, so
    their ends fall from the bottom of its stack to the top, and the lane takes an
    interval [a, b] exactly when, once the slices ending by `a` are closed, its top ends
    at or after `b` (or nothing is open). A heap closes slices in order of their end; a
    max segment tree over the lanes' top ends (+inf for an empty lane) finds the first
    lane whose top is >= b."""
    stacks: list[list[int]] = []  # per lane: ends of the open slices
    closing: list[tuple[int, int]] = []  # heap of (end, lane) of every open slice
    size = 1
    tree = [math.inf] * 2  # leaves size..2*size-1: lane top ends; inner nodes: max
    inf = math.inf

    def set_top(lane: int, value: float) -> None:
        i = lane + size
        tree[i] = value
        i >>= 1
        while i:
            m = max(tree[2 * i], tree[2 * i + 1])
            if tree[i] == m:
                break
            tree[i] = m
            i >>= 1

    out = []
    for a, b in zip(starts, ends, strict=True):
        while closing and closing[0][0] <= a:
            _, lane = heapq.heappop(closing)
            st = stacks[lane]
            st.pop()  # the top: the lane's smallest end
            set_top(lane, st[-1] if st else inf)
        if len(stacks) == size:  # every leaf is a lane: double the tree
            leaves = tree[size:] + [inf] * size
            size *= 2
            tree = [inf] * size + leaves
            for i in range(size - 1, 0, -1):
                tree[i] = max(tree[2 * i], tree[2 * i + 1])
        i = 1  # descend to the first leaf >= b (one exists: an unused lane is +inf)
        while i < size:
            i = 2 * i if tree[2 * i] >= b else 2 * i + 1
        lane = i - size
        if lane == len(stacks):
            stacks.append([])
        stacks[lane].append(b)
        set_top(lane, b)
        heapq.heappush(closing, (b, lane))
        out.append(lane)
    return out


def _lanes_reference(starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """The slow, obvious `_lanes`: try every lane in order (O(n * lanes)); for tests."""
    stacks: list[list[int]] = []  # per lane: ends of the open slices
    out = []
    for a, b in zip(starts, ends, strict=True):
        for lane, st in enumerate(stacks):
            while st and st[-1] <= a:
                st.pop()
            if not st or b <= st[-1]:
                st.append(b)
                out.append(lane)
                break
        else:
            stacks.append([b])
            out.append(len(stacks) - 1)
    return out


def parse_window(text: str) -> tuple[float, float]:
    """``T0:T1`` in seconds from engine start; either side may be empty (``:5``, ``10:``)."""
    if ":" not in text:
        raise UsageError(f"--window {text!r}: expected T0:T1 in seconds (e.g. 10:12.5)")
    a, b = text.split(":", 1)
    try:
        lo = float(a) if a.strip() else -math.inf
        hi = float(b) if b.strip() else math.inf
    except ValueError:
        raise UsageError(f"--window {text!r}: T0 and T1 must be numbers of seconds") from None
    if not lo < hi:
        raise UsageError(f"--window {text!r}: T0 must be before T1")
    return lo, hi


def chrome_trace_events(
    log: RawLog,
    part: Partition,
    *,
    requests: Iterable[str] | None = None,
    window_s: tuple[float, float] | None = None,
    ttft: TtftPartition | None = None,
    own_s: tuple[float, float] | None = None,
) -> list[dict[str, Any]]:
    """Every event of the trace of one run, in a deterministic order (see module doc).

    requests: only these request ids get a track (the engine tracks are always there).
    window_s: only slices and samples overlapping ``[t0, t1)`` (seconds, engine clock).
    own_s: the window asked for (default `window_s`; `window_s` is it stretched back to the
    start of its earliest gap: `trace_span_s`): of the gaps only those that end in it (one
    that ends later is not the window's: what it holds that overlaps the window, an
    eviction, is drawn on its own), of the TTFTs those that overlap it.
    ttft: the run's TTFT partition: each ``ttft`` slice gets its parts, phases and primary
    cause in ``args``.
    """
    ids = log.request_names()
    if requests is not None:
        wanted = list(dict.fromkeys(requests))
        index = {rid: i for i, rid in enumerate(ids)}
        missing = [r for r in wanted if r not in index]
        if missing:
            raise UsageError(
                f"{log.path}: no request with id {missing[0]!r} in this run "
                f"({len(ids)} requests, e.g. {', '.join(map(repr, ids[:3]))})"
            )
        keep_req = np.zeros(len(ids), dtype=bool)
        keep_req[[index[r] for r in wanted]] = True
    else:
        keep_req = np.ones(len(ids), dtype=bool)

    events = header_events()
    events += _engine_events(log, window_s)
    events += _rank_events(log, part, window_s)
    events += _counter_events(log, window_s)
    gaps, own = part, own_s or window_s
    if own is not None:  # the gaps that end in the window; an eviction in a gap that ends
        gaps = part.take(np.flatnonzero((part.t1_s >= own[0]) & (part.t1_s < own[1])))  # later:
    events += _request_events(log, gaps, ids, keep_req, own, _ttft_args(ttft))  # loose
    events += _eviction_flows(log, ids, keep_req, window_s)
    return _shift_to_zero(events)


def _eviction_flows(
    log: RawLog, ids: Sequence[str], keep_req: np.ndarray, window_s
) -> list[dict[str, Any]]:
    """One flow arrow per eviction with a recorded cause, from the deciding step on the
    engine loop to the victim's track, both at the eviction's time (see module doc)."""
    pe = log.preemptions
    keep = (pe.step >= 0) & keep_req[pe.request] if len(pe) else np.zeros(0, dtype=bool)
    keep &= _overlaps(pe.t_s, pe.t_s, window_s)
    t_ns = _ns(pe.t_s)
    by: dict[tuple[int, float], list[str]] = {}
    ev = log.evictors
    for r, t, e in zip(ev.request.tolist(), ev.t_s.tolist(), ev.evictor.tolist(), strict=True):
        by.setdefault((r, t), []).append(ids[e])
    out: list[dict[str, Any]] = []
    for k, i in enumerate(np.flatnonzero(keep).tolist()):
        r, reason = int(pe.request[i]), int(pe.reason[i])
        common = {"name": "eviction", "cat": "eviction", "id": k, "ts": _us(int(t_ns[i]))}
        args = {
            "victim": ids[r],
            "evictors": by.get((r, float(pe.t_s[i])), []),
            "reason": PREEMPT_REASONS[reason] if reason < len(PREEMPT_REASONS) else "other",
            "step": int(pe.step[i]),
            "num_computed_tokens_lost": int(pe.num_computed_tokens_lost[i]),
        }
        out.append({"ph": "s", "pid": PID_ENGINE, "tid": TID_LOOP, **common, "args": args})
        out.append({"ph": "f", "bp": "e", "pid": PID_REQUESTS, "tid": request_tid(r), **common})
    return out


def _ttft_args(ttft: TtftPartition | None) -> dict[int, dict[str, Any]]:
    """Per request index: the ``ttft`` slice's extra args (parts and phases in ms, each
    summing to ``ttft_ms``; primary cause; admission time when recorded)."""
    if ttft is None:
        return {}
    out: dict[int, dict[str, Any]] = {}
    prim = ttft.primary_names().tolist()
    parts = np.round(ttft.parts_ms, PARTS_DECIMALS).tolist()
    phases = np.round(ttft.phases_ms, PARTS_DECIMALS).tolist()
    for i, r in enumerate(ttft.request.tolist()):
        out[r] = {
            "primary": prim[i],
            "parts": {lb: v for lb, v in zip(ttft.labels, parts[i], strict=True) if v},
            "phases": {ph: v for ph, v in zip(TTFT_PHASES, phases[i], strict=True) if v},
        }
    return out


def engine_start_us(events: Sequence[Mapping[str, Any]]) -> float:
    """Where engine start (t = 0 in the log) lies on the trace's time axis, in µs: 0, unless
    something happened before it (a request that arrived before the recorder started)."""
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name" and ev.get("pid") == PID_ENGINE:
            return float(ev["args"].get("engine_start_us", 0.0))
    return 0.0


def _shift_to_zero(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shift every timestamp by whole µs so none is negative (Perfetto and chrome://tracing
    expect ts >= 0); the shift is kept in the engine's process_name args."""
    lo = min((e["ts"] for e in events if "ts" in e), default=0.0)
    if lo >= 0:
        return events
    off = float(math.ceil(-lo))
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] + off, 3)  # whole ns again: rounding keeps the order
        elif e["ph"] == "M" and e["name"] == "process_name" and e["pid"] == PID_ENGINE:
            e["args"]["engine_start_us"] = off
    return events


def _engine_events(log: RawLog, window_s) -> list[dict[str, Any]]:
    st, sg, gcp = log.steps, log.segments, log.gc_pauses
    out: list[dict[str, Any]] = []
    # one list of intervals per recording track: (start ns, end ns, kind, row)
    tracks: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    keep_st = _overlaps(st.t_start_s, st.t_end_s, window_s)
    s0, s1 = _ns(st.t_start_s), _ns(st.t_end_s)
    loop = tracks.setdefault((0, 0), [])
    for i in np.flatnonzero(keep_st).tolist():
        loop.append((int(s0[i]), int(s1[i]), 0, i))
    keep_sg = _overlaps(sg.t_start_s, sg.t_end_s, window_s)
    g0, g1 = _ns(sg.t_start_s), _ns(sg.t_end_s)
    thread, dev = sg.thread.tolist(), sg.is_device.tolist()
    for i in np.flatnonzero(keep_sg).tolist():
        tracks.setdefault((int(dev[i]), int(thread[i])), []).append((int(g0[i]), int(g1[i]), 1, i))
    labels = log.labels
    causes = [cause_of(lb, log.cause_map) for lb in labels]
    step_rows = np.column_stack(
        [st.num_decode, st.num_prefill_tokens, st.graph_size, st.num_preempted, st.num_swapped_in]
    ).tolist()
    seg_label, seg_step = sg.label.tolist(), sg.step.tolist()
    overlap_lanes = 0
    for (is_dev, th), items in sorted(tracks.items()):
        items.sort(key=lambda x: (x[0], -x[1], x[2], x[3]))
        lanes = _lanes([x[0] for x in items], [x[1] for x in items])
        base_tid, name = thread_track(is_dev, th)
        if base_tid != TID_LOOP:
            out += track_events(PID_ENGINE, base_tid, name, base_tid)
        lane_tid = {0: base_tid}
        for (a, b, kind, i), lane in zip(items, lanes, strict=True):
            tid = lane_tid.get(lane)
            if tid is None:
                overlap_lanes += 1
                tid = TID_OVERLAP + overlap_lanes
                lane_tid[lane] = tid
                out.append(_meta(PID_ENGINE, tid, "thread_name", f"{name} (overlap {lane})"))
                out.append(_meta(PID_ENGINE, tid, "thread_sort_index", tid))
            if kind == 0:
                args = dict(zip(STEP_ARGS, (i, *step_rows[i]), strict=True))
                ev_name = "step"
            else:
                li = seg_label[i]
                ev_name = (labels[li] if 0 <= li < len(labels) else "") or f"label {li}"
                args = {"step": seg_step[i]}
                if 0 <= li < len(labels) and causes[li] != ev_name:
                    args["cause"] = causes[li]
            out.append(
                {
                    "ph": "X",
                    "pid": PID_ENGINE,
                    "tid": tid,
                    "ts": _us(a),
                    "dur": _us(b - a),
                    "name": ev_name,
                    "args": args,
                }
            )
    keep_gc = _overlaps(gcp.t_start_s, gcp.t_end_s, window_s)
    c0, c1 = _ns(gcp.t_start_s), _ns(gcp.t_end_s)
    gen = gcp.generation.tolist()
    gc_items = sorted((int(c0[i]), int(c1[i]), i) for i in np.flatnonzero(keep_gc).tolist())
    gc_items.sort(key=lambda x: (x[0], -x[1], x[2]))
    gc_lanes = _lanes([x[0] for x in gc_items], [x[1] for x in gc_items])
    named_gc_lanes: set[int] = set()
    for (a, b, i), lane in zip(gc_items, gc_lanes, strict=True):
        tid = TID_GC if lane == 0 else TID_GC_OVERLAP + lane
        if lane and lane not in named_gc_lanes:
            named_gc_lanes.add(lane)
            out.append(_meta(PID_ENGINE, tid, "thread_name", f"gc (overlap {lane})"))
        out.append(
            {
                "ph": "X",
                "pid": PID_ENGINE,
                "tid": tid,
                "ts": _us(a),
                "dur": _us(b - a),
                "name": "gc",
                "args": {"generation": gen[i]},
            }
        )
    return out


def _rank_events(log: RawLog, part: Partition, window_s) -> list[dict[str, Any]]:
    """One track per tensor-parallel rank: its waits, and the slow steps it held."""
    view = rank_view(log, part)
    if view is None:
        return []
    which = rank_labels(log.labels)
    sg, st = log.segments, log.steps
    out: list[dict[str, Any]] = []
    keep = _overlaps(sg.t_start_s, sg.t_end_s, window_s)
    g0, g1 = _ns(sg.t_start_s), _ns(sg.t_end_s)
    by_rank: dict[int, list[tuple[int, int, int, str, dict[str, Any]]]] = {}
    for i in np.flatnonzero(keep & np.isin(sg.label, list(which))).tolist():
        lab = int(sg.label[i])
        by_rank.setdefault(which[lab][0], []).append(
            (int(g0[i]), int(g1[i]), 1, log.labels[lab], {"step": int(sg.step[i])})
        )
    s0, s1 = _ns(st.t_start_s), _ns(st.t_end_s)
    keep_st = _overlaps(st.t_start_s, st.t_end_s, window_s)
    for s in view.slow_steps:
        if s.holder is None or not keep_st[s.step]:
            continue
        args = {"step": s.step, "wait_ms": s.wait_ms, "cause": f"rank{s.holder}:{s.holder_cause}"}
        by_rank.setdefault(s.holder, []).append(
            (int(s0[s.step]), int(s1[s.step]), 0, "held slow step", args)
        )
    for row in view.ranks:
        tid = TID_RANKS + row.rank
        out += track_events(PID_ENGINE, tid, f"tp rank {row.rank}", tid)
        # a held step's slice before the waits inside it (same start: the longer first)
        for a, b, _, name, args in sorted(
            by_rank.get(row.rank, []), key=lambda x: (x[0], -x[1], x[2])
        ):
            out.append({"ph": "X", "pid": PID_ENGINE, "tid": tid, "ts": _us(a),
                        "dur": _us(b - a), "name": name, "args": args})  # fmt: skip
    return out


def _counter_events(log: RawLog, window_s) -> list[dict[str, Any]]:
    ct = log.counters
    if not len(ct):
        return []
    names = log.counter_names
    keep = _overlaps(ct.t_s, ct.t_s, window_s)
    ts = _ns(ct.t_s)
    order = np.lexsort((np.arange(len(ct)), ts, ct.name))
    out = []
    name_l, val_l = ct.name.tolist(), ct.value.tolist()
    for i in order[keep[order]].tolist():
        n = name_l[i]
        v = val_l[i]
        if not math.isfinite(v):
            continue
        out.append(
            {
                "ph": "C",
                "pid": PID_ENGINE,
                "ts": _us(int(ts[i])),
                "name": (names[n] if 0 <= n < len(names) else "") or f"counter {n}",
                "args": {"value": int(v) if v == int(v) else v},
            }
        )
    return out


def _evicted_pieces(
    log: RawLog,
    keep_req: np.ndarray,
    has_ttft: np.ndarray,
    bounds: np.ndarray,
    gap0: np.ndarray,
    gap1: np.ndarray,
    a_ns: np.ndarray,
    f_ns: np.ndarray,
    t_end_s: float,
) -> tuple[dict[tuple[int, int], list[tuple[int, int]]], list[tuple[int, int, int]]]:
    """The eviction windows of the kept requests, cut at the spans they fall in (a request's
    ttft and its gaps, ns): the pieces inside each span, by (request, span id: -1 is the
    ttft, else the gap row), and the pieces outside every span."""
    children: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (request, span) -> pieces
    loose: list[tuple[int, int, int]] = []  # (request, a, b) outside every span
    e_req, e_a, e_b = evicted_windows(log)
    e_b = np.where(np.isfinite(e_b), e_b, max(t_end_s, float(e_a.max()) if len(e_a) else 0.0))
    ea_ns, eb_ns = _ns(e_a), _ns(e_b)
    for k in range(len(e_req)):
        r = int(e_req[k])
        if not keep_req[r]:
            continue
        a, b = int(ea_ns[k]), int(eb_ns[k])
        spans = []  # (span id, start, end): -1 is ttft, else the gap row
        if has_ttft[r]:
            spans.append((-1, int(a_ns[r]), int(f_ns[r])))
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        if hi > lo:
            j0 = lo + max(int(np.searchsorted(gap1[lo:hi], a, side="right")), 0)
            j1 = lo + int(np.searchsorted(gap0[lo:hi], b, side="left"))
            spans += [(j, int(gap0[j]), int(gap1[j])) for j in range(j0, min(j1, hi))]
        if not spans:  # before the request arrived or after its last token
            loose.append((r, a, b))
            continue
        # the request's top-level slices (ttft, then its gaps) are contiguous: they cover
        # [first_cov, last_cov]; what of the eviction lies outside goes on its own
        first_cov = int(a_ns[r]) if has_ttft[r] else int(gap0[lo])
        last_cov = int(gap1[hi - 1]) if hi > lo else int(f_ns[r])
        if a < first_cov:
            loose.append((r, a, min(b, first_cov)))
        if b > last_cov:
            loose.append((r, max(a, last_cov), b))
        for sid, s0, s1 in spans:
            x0, x1 = max(a, s0), min(b, s1)
            if x1 > x0:
                children.setdefault((r, sid), []).append((x0, x1))
    return children, loose


def _request_events(
    log: RawLog, part: Partition, ids, keep_req, window_s, ttft_args=None
) -> list[dict]:
    """The requests' process: one track per kept request, its ttft then its gaps as
    contiguous top-level slices named by their primary cause, the eviction windows cut
    into the slices they fall in, and the pieces outside every slice on their own."""
    out: list[dict[str, Any]] = []
    rq = log.requests
    n_req = len(ids)
    t_end_s = max(
        float(log.wall_s) if math.isfinite(log.wall_s) else 0.0,
        float(part.t1_s.max()) if len(part) else 0.0,
    )
    # a track per kept request; with a window, only the requests with an event in it (a
    # window of a day-long run names the few hundred it shows, not every request)
    named: set[int] = set()

    def name(r: int) -> list[dict]:
        if r in named:
            return []
        named.add(r)
        return track_events(PID_REQUESTS, request_tid(r), request_track_name(ids[r]), r)

    if window_s is None:
        for r in np.flatnonzero(keep_req).tolist():
            out += name(r)

    # the top-level spans of each request: ttft, then its gaps (contiguous)
    arr, first = rq.arrival_s, rq.first_token_s
    has_ttft = (
        np.isfinite(arr) & np.isfinite(first) & (first >= arr) if n_req else np.zeros(0, bool)
    )
    g_req = part.request
    bounds = np.searchsorted(g_req, np.arange(n_req + 1))  # gaps sorted by request
    gap0, gap1 = _ns(part.t0_s), _ns(part.t1_s)
    keep_gap = keep_req[g_req] & _overlaps(part.t0_s, part.t1_s, window_s) if len(part) else None
    prim = part.primary_names().tolist() if len(part) else []
    labels = part.labels
    parts_r = np.round(part.parts_ms, PARTS_DECIMALS).tolist()
    gap_ms = part.gap_ms.tolist()
    st0, st1 = part.step0.tolist(), part.step1.tolist()
    a_ns, f_ns = _ns(np.nan_to_num(arr)), _ns(np.nan_to_num(first))

    children, loose = _evicted_pieces(
        log, keep_req, has_ttft, bounds, gap0, gap1, a_ns, f_ns, t_end_s
    )

    win = window_s
    for r in np.flatnonzero(keep_req).tolist():
        tid = request_tid(r)
        evs: list[tuple[int, int, int, dict[str, Any]]] = []  # (ts, -dur, order, event)
        if has_ttft[r]:
            a, b = int(a_ns[r]), int(f_ns[r])
            # a window shows the ttft that overlaps it, with the evictions nested in it
            if win is None or (first[r] >= win[0] and arr[r] <= win[1]):
                args = {"ttft_ms": (b - a) / 1e6, **(ttft_args or {}).get(r, {})}
                evs.append((a, a - b, 0, _request_slice(tid, a, b, "ttft", args)))
                for x0, x1 in children.get((r, -1), ()):
                    evs.append((x0, x0 - x1, 1, evicted_event(tid, x0, x1)))
        for j in range(int(bounds[r]), int(bounds[r + 1])):
            if keep_gap is not None and not keep_gap[j]:
                continue
            a, b = int(gap0[j]), int(gap1[j])
            pr = parts_r[j]
            parts = {lb: v for lb, v in zip(labels, pr, strict=True) if v}
            args = dict(zip(GAP_ARGS, (gap_ms[j], parts, st0[j], st1[j]), strict=True))
            evs.append((a, a - b, 0, _request_slice(tid, a, b, prim[j], args)))
            for x0, x1 in children.get((r, j), ()):
                evs.append((x0, x0 - x1, 1, evicted_event(tid, x0, x1)))
        evs.sort(key=lambda e: (e[0], e[1], e[2]))
        out += (name(r) if evs else []) + [e[3] for e in evs]
    for r, a, b in sorted(loose):
        if b > a and (win is None or (b / 1e9 >= win[0] and a / 1e9 <= win[1])):
            out += name(r) + [evicted_event(request_tid(r), a, b)]
    return out


def _request_slice(tid: int, a: int, b: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """A top-level slice on a request's track (its ttft or one of its gaps), [a, b] ns."""
    return {
        "ph": "X",
        "pid": PID_REQUESTS,
        "tid": tid,
        "ts": _us(a),
        "dur": _us(b - a),
        "name": name,
        "args": args,
    }


# -- writing ---------------------------------------------------------------------------


def trace_json(events: list[dict[str, Any]], *, meta: Mapping[str, Any] | None = None) -> str:
    """The trace file's text: Chrome's JSON Object Format, serialised once."""
    doc: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if meta:
        doc["otherData"] = dict(meta)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False)


def write_trace(events: list[dict[str, Any]], path: str, *, meta=None) -> int:
    """Write the trace to `path` (gzip if it ends in ``.gz``; no timestamp or file name in
    the gzip header, so the same input gives the same bytes). Returns bytes written."""
    data = trace_json(events, meta=meta).encode()
    if path.endswith(".gz"):
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
            gz.write(data)
        data = buf.getvalue()

    atomic_write(path, data, fsync=False)
    return len(data)


def read_trace(path: str) -> list[dict[str, Any]]:
    """The events of a trace file (Object or Array format, gzipped or not; a live trace
    cut off by a killed run is read up to its last complete event)."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    text = raw.decode()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        body = text.rstrip().rstrip(",")
        cut = body.rfind("}")
        doc = json.loads(body[: cut + 1] + "]") if body.startswith("[") else json.loads(body)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


# -- validation ------------------------------------------------------------------------

_META_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_trace(
    events: Sequence[Mapping[str, Any]], *, max_ts_us: float | None = None, limit: int = 20
) -> list[str]:
    """Problems that would make Perfetto drop or misdraw events; empty if none.

    Checks: known phases (X, M, C, i, and the flow ends s, t, f with an integer id);
    numeric ``pid``/``tid``; a non-empty string name;
    ``ts`` (and ``dur``) finite numbers of microseconds, ``dur >= 0``, and within
    ``[0, max_ts_us]`` when given (catches seconds or nanoseconds passed as µs); metadata
    names and args; counter args all finite numbers; on every (pid, tid) track the
    complete slices well nested (a slice lies inside the enclosing one or after it);
    every slice's track named by a ``thread_name``; no tid shared by two processes; and
    ``args.parts`` (ms) non-negative and summing to the slice's duration."""
    errs: list[str] = []

    def err(i: int, msg: str) -> None:
        if len(errs) < limit:
            errs.append(f"event {i}: {msg}")

    named_threads: set[tuple[Any, Any]] = set()
    tracks: dict[tuple[Any, Any], list[tuple[float, float, int]]] = {}
    for i, ev in enumerate(events):
        slice_ = _check_event(i, ev, err, named_threads, max_ts_us)
        if slice_ is not None:
            tracks.setdefault(slice_[0], []).append(slice_[1])
    _check_tracks(tracks, named_threads, errs, err)
    return errs


def _check_event(
    i: int,
    ev: Any,
    err: Callable[[int, str], None],
    named_threads: set[tuple[Any, Any]],
    max_ts_us: float | None,
) -> tuple[tuple[Any, Any], tuple[float, float, int]] | None:
    """One event's checks (`validate_trace`); a complete slice's track and span, to check
    the nesting with its track's others. A ``thread_name`` adds its track to
    `named_threads`."""
    if not isinstance(ev, Mapping):
        err(i, "not an object")
        return None
    ph = ev.get("ph")
    name = ev.get("name")
    if not isinstance(name, str) or not name:
        err(i, f"name must be a non-empty string, got {name!r}")
    if not isinstance(ev.get("pid"), int):
        err(i, f"pid must be an integer, got {ev.get('pid')!r}")
    if ph == "M":
        if name not in _META_NAMES:
            err(i, f"unknown metadata event {name!r}")
        args = ev.get("args", {})
        if str(name).endswith("_name"):
            if not isinstance(args.get("name"), str):
                err(i, f"{name} needs args.name (a string)")
            if name == "thread_name":
                named_threads.add((ev.get("pid"), ev.get("tid")))
        elif not isinstance(args.get("sort_index"), int):
            err(i, f"{name} needs args.sort_index (an integer)")
        return None
    raw_ts = ev.get("ts")
    if not _is_num(raw_ts):
        err(i, f"ts must be a finite number of µs, got {raw_ts!r}")
        return None
    ts = float(raw_ts)  # type: ignore[arg-type]
    if ts < -TOL_US or (max_ts_us is not None and ts > max_ts_us + TOL_US):
        bound = "" if max_ts_us is None else f", {max_ts_us}"
        err(i, f"ts {ts} µs outside [0{bound}] µs (wrong unit, or not shifted to >= 0?)")
    if ph == "C":
        args = ev.get("args")
        if not isinstance(args, Mapping) or not args or not all(map(_is_num, args.values())):
            err(i, f"counter args must be finite numbers, got {args!r}")
        return None
    if ph in ("i", "I"):
        return None
    if ph in ("s", "t", "f"):  # a flow arrow's ends: bound to the slice they fall in
        if not isinstance(ev.get("id"), int) or not isinstance(ev.get("tid"), int):
            err(i, f"a flow event needs an integer id and tid, got {ev.get('id')!r}")
        return None
    if ph != "X":
        err(i, f"unsupported phase {ph!r}")
        return None
    if not isinstance(ev.get("tid"), int):
        err(i, f"tid must be an integer, got {ev.get('tid')!r}")
    raw_dur = ev.get("dur")
    if not _is_num(raw_dur) or raw_dur < 0:  # type: ignore[operator]
        err(i, f"dur must be a finite number >= 0 µs, got {raw_dur!r}")
        return None
    dur = float(raw_dur)  # type: ignore[arg-type]
    parts = (ev.get("args") or {}).get("parts")
    if parts is not None:
        raw = list(parts.values()) if isinstance(parts, Mapping) else [None]
        if not all(_is_num(v) for v in raw):
            err(i, f"args.parts must be numbers of ms, got {parts!r}")
        else:
            vals = [float(v) for v in raw if v is not None]
            if min(vals, default=0.0) < -1e-6:
                err(i, f"args.parts has a negative part: {parts!r}")
            total_us = sum(vals) * 1000
            if abs(total_us - dur) > TOL_US + 1e-9 * dur:
                err(i, f"args.parts sum to {total_us} µs but the slice lasts {dur} µs")
    return (ev.get("pid"), ev.get("tid")), (ts, ts + dur, i)


def _check_tracks(
    tracks: dict[tuple[Any, Any], list[tuple[float, float, int]]],
    named_threads: set[tuple[Any, Any]],
    errs: list[str],
    err: Callable[[int, str], None],
) -> None:
    """No tid shared by two processes; every slice's track named; on every track the
    complete slices well nested (a slice lies inside the enclosing one or after it)."""
    owner: dict[Any, Any] = {}
    for pid, tid in sorted(set(tracks) | named_threads, key=repr):
        if tid is not None and owner.setdefault(tid, pid) != pid:
            errs.append(
                f"tid {tid} is used by pid {owner[tid]} and pid {pid} (Perfetto keys "
                "JSON threads by tid: give each track its own)"
            )
    for key, items in tracks.items():
        if key not in named_threads:
            err(items[0][2], f"track pid={key[0]} tid={key[1]} has no thread_name")
        items.sort(key=lambda x: (x[0], -(x[1] - x[0])))
        stack: list[tuple[float, float, int]] = []
        for a, b, i in items:
            while stack and stack[-1][1] <= a + TOL_US:
                stack.pop()
            if stack and b > stack[-1][1] + TOL_US:
                j = stack[-1][2]
                err(
                    i,
                    f"slice [{a}, {b}] µs on pid={key[0]} tid={key[1]} overlaps event "
                    f"{j} [{stack[-1][0]}, {stack[-1][1]}] without nesting",
                )
                continue
            stack.append((a, b, i))


def _dump(ev: Mapping[str, Any]) -> str:
    return json.dumps(ev, separators=(",", ":"))
