"""Single gaps as records: for drilling into the tail (`tracekit gaps`, the HTML report)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tracekit.analysis.window import Window, select_gaps
from tracekit.attribution.client import client_partition
from tracekit.attribution.evictions import preempt_causes, recompute_causes
from tracekit.attribution.itl import Partition, partition
from tracekit.errors import LogError
from tracekit.log.rawlog import RawLog


def with_labels(records: list[dict[str, Any]], labels: tuple[str, ...]) -> list[dict[str, Any]]:
    """`records` (gap or TTFT records of part of a run: a slice) with the whole run's
    partition `labels` as their ``parts`` keys, in its order: 0 for a label the part's
    partition lacks (a partition has only the labels its own segments name)."""
    for rec in records:
        parts = rec["parts"]
        if tuple(parts) != labels:
            rec["parts"] = {lb: parts.get(lb, 0.0) for lb in labels}
            rec["parts"].update((k, v) for k, v in parts.items() if k not in labels)
    return records


def gap_records(
    log: RawLog,
    part: Partition | None = None,
    *,
    min_ms: float | None = None,
    request_id: str | None = None,
    index: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """One dict per gap: request (its id), t0_s, t1_s (engine clock), gap_ms, parts and
    context (ms by label; parts sum to gap_ms), primary, and the steps it spans; a gap
    with `preempt` time also has ``preempt_causes``: the pieces of that part, each naming
    the eviction it comes from (victim, step, reason, evictors; docs/partition.md, "Who
    evicted whom"); a gap whose `prefill` part holds others' re-prefill also has
    ``recompute_causes``: that share's pieces, each naming the victim's eviction."""
    p = part if part is not None else partition(log)
    sel = np.ones(len(p), dtype=bool) if index is None else np.zeros(len(p), dtype=bool)
    if index is not None:
        sel[index] = True
    if min_ms is not None:
        sel &= p.gap_ms >= min_ms
    ids = log.request_names()
    if request_id is not None:
        sel &= np.isin(p.request, requests_named(log, request_id))
    rows = np.flatnonzero(sel) if index is None else np.asarray(index)[sel[np.asarray(index)]]
    prim = p.primary_names()
    causes = preempt_causes(log, p, rows)
    rc_causes = recompute_causes(log, p, rows)
    out = []
    for i in rows.tolist():
        out.append(
            {
                "request": ids[int(p.request[i])],
                "t0_s": float(p.t0_s[i]),
                "t1_s": float(p.t1_s[i]),
                "gap_ms": float(p.gap_ms[i]),
                "parts": {lb: float(v) for lb, v in zip(p.labels, p.parts_ms[i], strict=True)},
                "context": {
                    lb: float(v) for lb, v in zip(p.labels, p.context_ms[i], strict=True) if v
                },
                "primary": str(prim[i]),
                "step0": int(p.step0[i]),
                "step1": int(p.step1[i]),
            }
        )
        if i in causes:
            out[-1]["preempt_causes"] = causes[i]
        if i in rc_causes:
            out[-1]["recompute_causes"] = rc_causes[i]
    return out


def _client_base(name: str) -> str:
    """A run's request name less what tracekit added to the client's id: ``~K`` (the K-th
    request with that id) and ``#K`` (the K-th choice of ``n > 1``)."""
    for sep in ("~", "#"):
        head, found, tail = name.rpartition(sep)
        if found and head and tail.isdigit():
            name = head
    return name


def requests_named(log: RawLog, request_id: str) -> np.ndarray:
    """The indices of the requests `request_id` names: the request with exactly that id;
    else every request the client knew by it: its choices (``#K``), the later requests that
    reused it (``~K``), and a completion's prompts (vLLM names them ``ID-PROMPT``: the
    client sees ``cmpl-X``, the run ``cmpl-X-0``). Raises LogError when none matches."""
    ids = log.request_names()
    if request_id in ids:
        return np.array([ids.index(request_id)], dtype=np.int64)
    out = []
    for i, name in enumerate(ids):
        base = _client_base(name)
        head, dash, tail = base.rpartition("-")
        if base == request_id or (dash and head == request_id and tail.isdigit()):
            out.append(i)
    if not out:
        raise LogError(log.path, "request", f"no request with id {request_id!r} in this run")
    return np.array(out, dtype=np.int64)


def client_gap_records(
    log: RawLog,
    cp: Any = None,
    *,
    min_ms: float | None = None,
    request_id: str | None = None,
    window: Window | None = None,
) -> list[dict[str, Any]]:
    """One dict per client-boundary gap of a server run (`tracekit.attribution.client`):
    request, t0_s, t1_s (the two chunk writes, run clock), gap_ms, parts (ms by label, sum
    to gap_ms; engine labels, then the frontend's), primary, tokens (the later chunk's),
    engine_ms and frontend_ms. `window`: only the gaps whose later chunk lands in it."""

    p = cp if cp is not None else client_partition(log)
    sel = np.ones(len(p), dtype=bool) if window is None else window.contains(p.t1_s)
    if min_ms is not None:
        sel &= p.gap_ms >= min_ms
    if request_id is not None:
        sel &= np.isin(p.request, requests_named(log, request_id))
    ids = log.request_names()
    prim = p.primary_names()
    eng, front = p.engine_ms(), p.frontend_ms()
    out = []
    for i in np.flatnonzero(sel).tolist():
        out.append(
            {
                "request": ids[int(p.request[i])],
                "t0_s": float(p.t0_s[i]),
                "t1_s": float(p.t1_s[i]),
                "gap_ms": float(p.gap_ms[i]),
                "parts": {lb: float(v) for lb, v in zip(p.labels, p.parts_ms[i], strict=True)},
                "primary": str(prim[i]),
                "tokens": int(p.num_tokens[i]),
                "engine_ms": float(eng[i]),
                "frontend_ms": float(front[i]),
            }
        )
    return out


def worst_gaps(
    log: RawLog, part: Partition | None = None, n: int = 10, *, max_steps: int = 12
) -> list[dict[str, Any]]:
    """The `n` longest gaps of the run, longest first, as `gap_records` plus the engine
    steps each one spans (every step overlapping ``[t0_s, t1_s]``; of more than `max_steps`,
    the first and last halves, since a long gap starts and ends where its cause is;
    `num_steps` counts all): index, t_start_s, dur_ms, the step's attributes and
    its segment time by label (ms)."""
    p = part if part is not None else partition(log)
    if n <= 0 or len(p) == 0:
        return []
    order = np.lexsort((np.arange(len(p)), -p.gap_ms))[:n]  # longest first, stable
    records = gap_records(log, p, index=order)
    add_steps(log, records, max_steps)
    return records


def add_steps(log: RawLog, records: list[dict[str, Any]], max_steps: int) -> None:
    """Give each record (with `t0`, `t1`) the engine steps it spans: `num_steps` and `steps`
    (see `worst_gaps`)."""
    st, sg = log.steps, log.segments
    seg_ms: dict[int, dict[str, float]] = {}
    if len(sg):
        names = list(log.labels)
        dur = (sg.t_end_s - sg.t_start_s) * 1e3
        for s, lb, d in zip(sg.step.tolist(), sg.label.tolist(), dur.tolist(), strict=True):
            if s >= 0:
                row = seg_ms.setdefault(s, {})
                name = names[lb] if 0 <= lb < len(names) else str(lb)
                row[name] = row.get(name, 0.0) + d
    t_start, t_end = st.t_start_s, st.t_end_s
    for rec in records:
        # steps overlapping the gap: started before it ended, ended after it started
        hit = np.flatnonzero((t_start < rec["t1_s"]) & (t_end > rec["t0_s"]))
        rec["num_steps"] = int(len(hit))
        if len(hit) > max_steps:
            half = max(max_steps // 2, 1)
            hit = np.concatenate([hit[:half], hit[-half:]])
        rec["steps"] = [
            {
                "step": i,
                "t_start_s": float(t_start[i]),
                "dur_ms": float((t_end[i] - t_start[i]) * 1e3),
                "num_decode": int(st.num_decode[i]),
                "num_prefill_tokens": int(st.num_prefill_tokens[i]),
                "graph_size": int(st.graph_size[i]),
                "num_preempted": int(st.num_preempted[i]),
                "num_swapped_in": int(st.num_swapped_in[i]),
                "segments_ms": seg_ms.get(i, {}),
            }
            for i in hit.tolist()
        ]


def stall_events(p: Partition, index: np.ndarray) -> list[np.ndarray]:
    """Gaps `index` grouped by the event that stalled them: one event is the gaps closed by
    the same emitting step with the same primary cause (a GC pause or a long prefill in a
    step delays every request of the batch at once, and they all resume in that step).
    Events come longest first (by their longest gap); each holds its gaps longest first."""
    index = np.asarray(index, dtype=np.int64)
    if not len(index):
        return []
    key = p.step1[index].astype(np.int64) * (len(p.causes) + 2) + (p.primary[index] + 1)
    order = np.lexsort((index, -p.gap_ms[index], key))  # by event, longest gap first
    idx, key = index[order], key[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    groups = np.split(idx, starts[1:])
    return sorted(groups, key=lambda g: (-float(p.gap_ms[g[0]]), int(g[0])))


def worst_stalls(
    log: RawLog,
    part: Partition | None = None,
    n: int = 10,
    *,
    max_steps: int = 12,
    max_requests: int = 24,
) -> list[dict[str, Any]]:
    """The `n` worst stall events of the run (see `stall_events`), among its tail gaps
    (at or above the run's p99): one record per event, its longest gap as in `worst_gaps`
    (request, t0, t1, gap_ms, parts, context, primary, steps) plus `num_requests` hit,
    `requests` (the first `max_requests` ids, longest gap first) and `gap_ms_min`."""
    p = part if part is not None else partition(log)
    if n <= 0 or len(p) == 0:
        return []
    tail = np.flatnonzero(p.gap_ms >= np.percentile(p.gap_ms, 99))
    events = stall_events(p, tail)[:n]
    ids = log.request_names()
    records = gap_records(log, p, index=np.array([int(g[0]) for g in events], dtype=np.int64))
    for rec, g in zip(records, events, strict=True):
        rec["num_requests"] = int(len(g))
        rec["requests"] = [ids[int(p.request[i])] for i in g[:max_requests].tolist()]
        rec["gap_ms_min"] = float(p.gap_ms[g].min())
    add_steps(log, records, max_steps)
    return records


def even_picks(n: int, room: int) -> np.ndarray:
    """Which of `n` things in order an even stride keeps when there is room for `room`:
    all of them when they fit, else ``linspace(0, n - 1, room)`` rounded down."""
    if n <= room:
        return np.arange(n, dtype=np.int64)
    if room <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.linspace(0, n - 1, room).astype(np.int64)


def thin_marks(t_s: np.ndarray, length_ms: np.ndarray | None, room: int) -> np.ndarray:
    """Which marks of a series a page draws, in their order: all of them up to `room`;
    beyond it the `room` longest (`length_ms`, ties: the earlier mark) or, for marks with
    no length, an even stride (`even_picks`)."""
    n = len(t_s)
    if n <= room or length_ms is None:
        return even_picks(n, room)
    return np.sort(np.lexsort((np.arange(n), -length_ms))[: max(room, 0)])


def itl_series(
    log: RawLog,
    part: Partition | None = None,
    *,
    max_points: int = 2500,
    min_gc_ms: float = 1.0,
    window: Window | None = None,
) -> dict:
    """Every gap of the run as a point in time (`t_s`: when it ended, `gap_ms`, `primary`),
    for an ITL-over-time chart, thinned to at most `max_points` points (`num_gaps` counts
    all; docs/reports.md, "ITL over time"): the tail (gaps at or above the run's p99)
    first, every gap of it when it fits, the others by an even stride in the room left;
    a tail longer than `max_points` gives its `max_points // 2` worst gaps (ties: the
    earlier in the partition) and an even stride over all of it for the rest of the room.
    Plus the marks: evictions (`evict_t_s`, an even stride beyond `max_points`) and GC
    pauses (`gc_t_s`, `gc_ms`, `gc_generation`) of at least `min_gc_ms` (the
    `max_points` longest beyond it). With a `window`: the gaps of `part` (the whole run's)
    that end in it, and the marks inside it."""
    p = select_gaps(part if part is not None else partition(log), window)
    n = len(p)
    keep = np.zeros(n, dtype=bool)
    if n:
        tail = np.flatnonzero(p.gap_ms >= np.percentile(p.gap_ms, 99))
        if len(tail) <= max_points:
            keep[tail] = True
            rest = np.flatnonzero(~keep)
            keep[rest[even_picks(len(rest), max_points - len(tail))]] = True
        else:
            worst = max_points // 2
            keep[tail[np.lexsort((tail, -p.gap_ms[tail]))[:worst]]] = True
            keep[tail[even_picks(len(tail), max_points - worst)]] = True
    sel = np.flatnonzero(keep)
    sel = sel[np.argsort(p.t1_s[sel], kind="stable")]
    gc = log.gc_pauses
    gc_ms = (gc.t_end_s - gc.t_start_s) * 1e3
    big = gc_ms >= min_gc_ms
    evict_t_s = log.evictions.t_evict_s
    if window is not None:  # the marks inside the window only
        big &= window.contains(gc.t_start_s)
        evict_t_s = evict_t_s[window.contains(evict_t_s)]
    gcs = np.flatnonzero(big)
    gcs = gcs[thin_marks(gc.t_start_s[gcs], gc_ms[gcs], max_points)]
    return {
        "num_gaps": int(n),
        "t_s": p.t1_s[sel].tolist(),
        "gap_ms": p.gap_ms[sel].tolist(),
        "primary": p.primary_names()[sel].tolist(),
        "evict_t_s": evict_t_s[thin_marks(evict_t_s, None, max_points)].tolist(),
        "gc_t_s": gc.t_start_s[gcs].tolist(),
        "gc_ms": gc_ms[gcs].tolist(),
        "gc_generation": gc.generation[gcs].tolist(),
    }
