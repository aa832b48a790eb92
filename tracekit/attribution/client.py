"""Gaps at the client boundary: between two streamed chunks of a request, partitioned.

A merged server run (`tracekit.log.merge`) has two boundaries. The engine boundary is where the
engine core emits tokens (`RawLog.emissions`, partitioned by `tracekit.attribution.itl` as for
any engine). The client boundary is where the API server writes each chunk of a stream
(`RawLog.client_emissions`): what a streaming client measures. A *client gap* is
``[a, b]`` between the writes of two consecutive chunks of one request. Every millisecond
of it goes to exactly one label:

1. **The engine part** ``[a, x]``, ``x = clip(e, a, b)``, where `e` is when the engine core
   emitted the last token the later chunk carries: until then the token did not exist.
   It is partitioned by `tracekit.attribution.itl` itself, as if ``[a, x]`` were an engine gap of
   the request (its evictions, the step whose device work `e` read): the engine labels.
2. **The frontend part** ``[x, b]``: the token existed, the client did not have it yet. The
   API server's windows (on the run's clock) own it, first match wins:
   ``frontend_gc`` (its GC pauses) > ``sse_write`` (chunks being written) > ``output``
   (output processing and detokenisation) > ``input`` (input processing of arriving
   requests) > ``hop`` (from `e` until the API server received the step's outputs: IPC,
   serialisation, the output queue) > ``frontend_other`` (what no window covers: building
   the chunk, the event loop, other tasks).
3. **What the OS took of the API server's thread** there: at an instant inside one of its
   OS intervals (``proc_os``: its event loop's), that interval's run-queue share is
   ``frontend_os_runqueue`` and, inside one of its segments only (between them the loop
   may sit idle), its off-CPU share ``frontend_os_blocked``, taken from the label that
   owns the instant (docs/partition.md, "Unrecorded windows", rule 5). Columns only where
   the run has such intervals.

**Unrecorded windows** (docs/partition.md, "Unrecorded windows"). Each process's rows
cover a span (`RawLog.coverage`, on the run's clock: from its recorder's start to the end
of its complete rows); outside it that process recorded nothing, so no cause of it or of
another process may be charged there. When the engine emission `e` is unknown and the gap
reaches past the engine core's span (``b > core_end``), the token did not exist before
``core_end`` (the core's rows are complete until then) and whether it existed after is
unknown: ``x = clip(core_end, a, b)`` and all of ``[x, b]`` is ``unrecorded:engine_core``.
Otherwise the engine part's time outside the core's span is ``unrecorded:engine_core`` and
the frontend part's time outside the span of the API server that wrote the chunk is
``unrecorded:api_server``; the rest is partitioned as above, over the recorded time only.
A log without coverage (before schema v4): spans unknown, nothing is unrecorded.

The event loop runs one thing at a time, so a window of another request (its output
processing, its chunk's write) inside this gap delayed this chunk all the same: windows
are not filtered by request. Parts sum to the gap (checked; a violation is an error).

`client_partition` is vectorised (a timeline of elementary intervals and cumulative
sums); `client_partition_reference` (`tracekit.attribution.reference`) does the same with
loops over each gap's windows and `partition_reference` for the engine part. Tests check
they agree.

ITL in three conventions (`itl_conventions`), the ones streaming benchmarks disagree on
when a chunk carries several tokens: *per chunk* (the client gap), *per token* (a chunk's
gap divided by its tokens, counted once per token) and *per engine step* (the engine
boundary's gaps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.attribution.itl import RECONCILE_TOL_MS, itl_labels, partition, primary_of
from tracekit.attribution.timeline import PreparedRun, prepared
from tracekit.errors import ReconcileError
from tracekit.labels import FRONTEND_OS_LABELS  # the OS's time at an API server (rule 5)
from tracekit.log.rawlog import Emissions, Evictions, RawLog, Requests
from tracekit.log.serve_contract import CORE, FRONTEND

#: Frontend labels, in the order that owns an overlap first.
FRONTEND_PRECEDENCE = ("frontend_gc", "sse_write", "output", "input")
FRONTEND_LABELS = (*FRONTEND_PRECEDENCE, "hop", "frontend_other")
#: Time of a client gap where a process it depends on recorded nothing, by that process's
#: role (docs/partition.md, "Unrecorded windows"); a column only where some gap has any.
UNRECORDED_CORE, UNRECORDED_API = "unrecorded:engine_core", "unrecorded:api_server"
UNRECORDED_LABELS = (UNRECORDED_CORE, UNRECORDED_API)
#: proc_segments label -> frontend label
FRONTEND_WINDOW = {"gc": "frontend_gc", "sse_write": "sse_write", "output": "output",
                   "input": "input"}  # fmt: skip


@dataclass(frozen=True)
class ClientPartition:
    """Every client gap of a run. Rows are gaps, sorted by request then time."""

    # engine labels, FRONTEND_LABELS, FRONTEND_OS_LABELS (with evidence), unrecorded labels
    # (if any)
    labels: tuple[str, ...]
    request: np.ndarray
    t0_s: np.ndarray  # the earlier chunk's write
    t1_s: np.ndarray  # the later chunk's write
    # x: when the later chunk's last token left the engine (clipped to the gap); where that
    # is unrecorded, the end of the engine core's span (docstring, "Unrecorded windows")
    engine_s: np.ndarray
    num_tokens: np.ndarray  # tokens the later chunk carried
    gap_ms: np.ndarray
    parts_ms: np.ndarray  # (gaps, labels), sums to gap_ms

    def __len__(self) -> int:
        return len(self.gap_ms)

    @property
    def reconcile_err_ms(self) -> np.ndarray:
        return np.abs(self.gap_ms - self.parts_ms.sum(axis=1))

    def column(self, label: str) -> np.ndarray:
        return self.parts_ms[:, self.labels.index(label)]

    def engine_ms(self) -> np.ndarray:
        n = self.labels.index(FRONTEND_LABELS[0])
        return self.parts_ms[:, :n].sum(axis=1)

    def frontend_ms(self) -> np.ndarray:
        """Time of each gap the API server held (its windows, the hop, the rest of its
        part, and what the OS took of its thread there)."""
        return self._sum_of((*FRONTEND_LABELS, *FRONTEND_OS_LABELS))

    def unrecorded_ms(self) -> np.ndarray:
        """Time of each gap where a process it depends on recorded nothing."""
        return self._sum_of(UNRECORDED_LABELS)

    def _sum_of(self, names: tuple[str, ...]) -> np.ndarray:
        cols = [j for j, lb in enumerate(self.labels) if lb in names]
        return self.parts_ms[:, cols].sum(axis=1)

    def primary_names(self) -> np.ndarray:
        """Largest part of each gap if >= 1 ms and >= 25% of it (as for engine gaps, the same
        tolerance and ties), 'forward' / 'residual' / 'frontend_other' excluded; else 'clean'."""
        skip = frozenset({"forward", "residual", "frontend_other"})
        prim, causes = primary_of(self.parts_ms, self.gap_ms, self.labels, skip)
        if not causes:
            return np.array(["clean"] * len(self), dtype=object)
        return np.array([*causes, "clean"], dtype=object)[prim]


@dataclass(frozen=True)
class ClientGaps:
    request: np.ndarray
    a: np.ndarray
    b: np.ndarray
    x: np.ndarray
    e: np.ndarray  # engine emission of the later chunk's last token (NaN: unknown)
    recv: np.ndarray  # when the API server received that step's outputs (NaN: unknown)
    step0: np.ndarray
    step1: np.ndarray
    dstep1: np.ndarray
    num_tokens: np.ndarray
    process: np.ndarray  # the API server that wrote the later chunk (meta["processes"])
    # the spans (`RawLog.coverage`, run's clock) of the engine core and of that API server:
    # -inf / inf where unknown
    core_lo: np.ndarray
    core_hi: np.ndarray
    fe_lo: np.ndarray
    fe_hi: np.ndarray


def core_process(log: RawLog) -> int:
    """The engine core's index in ``meta["processes"]`` (0 where none is named)."""
    procs = log.meta.get("processes", [])
    for i, p in enumerate(procs if isinstance(procs, list) else []):
        if isinstance(p, dict) and p.get("role") == CORE:
            return i
    return 0


def process_spans(log: RawLog, process: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of each named process's coverage on the run's clock; (-inf, inf) for a
    process without a coverage row (unknown: never assumed partial)."""
    cov = log.coverage
    n = int(max(int(cov.process.max(initial=-1)), int(np.max(process, initial=-1)))) + 1
    lo, hi = np.full(n, -np.inf), np.full(n, np.inf)
    lo[cov.process], hi[cov.process] = cov.t_start_s, cov.t_end_s
    p = np.asarray(process, dtype=np.int64)
    return lo[p], hi[p]


def client_gaps(log: RawLog) -> ClientGaps:
    """Consecutive chunk pairs per request, each with the engine emission its later chunk
    waited for (by cumulative token count) and when that step's outputs were received."""
    ce, em = log.client_emissions, log.emissions
    order = np.lexsort((ce.t_s, ce.request))
    r, t, k = ce.request[order], ce.t_s[order], ce.num_tokens[order]
    proc = ce.process[order]
    # cumulative tokens per request at each chunk, and at each engine emission
    c_cum = _cum_by_request(r, k)
    eo = np.lexsort((em.t_s, em.request))
    er, et, ek = em.request[eo], em.t_s[eo], em.num_tokens[eo]
    e_cum = _cum_by_request(er, ek)
    # the first engine emission of the same request whose cumulative count reaches c_cum:
    # search in (request, cumulative) order; both are sorted that way
    big = float(max(int(e_cum.max(initial=0)), int(c_cum.max(initial=0))) + 1)
    key_e = er.astype(np.float64) * big + e_cum
    key_c = r.astype(np.float64) * big + c_cum
    j = np.searchsorted(key_e, key_c, side="left")
    ok = j < len(key_e)
    ok[ok] = er[j[ok]] == r[ok]
    e = np.full(len(r), np.nan)
    e[ok] = et[j[ok]]
    step = np.full(len(r), -1, dtype=np.int64)
    dstep = np.full(len(r), -1, dtype=np.int64)
    step[ok] = em.step[eo][j[ok]]
    dstep[ok] = em.device_step[eo][j[ok]]
    recv = received_at(log, step, proc)
    pair = np.flatnonzero(r[1:] == r[:-1])
    a, b = t[pair], t[pair + 1]
    e1 = e[pair + 1]
    x = np.where(np.isnan(e1), a, np.clip(e1, a, b))
    core_lo, core_hi = process_spans(log, np.full(len(pair), core_process(log)))
    fe_lo, fe_hi = process_spans(log, proc[pair + 1])
    return ClientGaps(
        request=r[pair + 1],
        a=a,
        b=b,
        x=x,
        e=e1,
        recv=recv[pair + 1],
        step0=step[pair],
        step1=step[pair + 1],
        dstep1=dstep[pair + 1],
        num_tokens=k[pair + 1],
        process=proc[pair + 1],
        core_lo=core_lo,
        core_hi=core_hi,
        fe_lo=fe_lo,
        fe_hi=fe_hi,
    )


def received_at(log: RawLog, step: np.ndarray, process: np.ndarray) -> np.ndarray:
    """When API server `process` received engine step `step`'s outputs (each API server
    gets its own requests' outputs of a step), per row; NaN where unknown (step -1, or no
    delivery row)."""
    recv = np.full(len(step), np.nan)
    dl = log.deliveries
    ok = np.asarray(step) >= 0
    if len(dl) and ok.any():
        big_p = float(max(int(dl.process.max(initial=0)), int(np.max(process, initial=0))) + 1)
        dkey = dl.step.astype(np.float64) * big_p + dl.process
        d_order = np.argsort(dkey, kind="stable")
        ds, dr = dkey[d_order], dl.t_recv_s[d_order]
        want = step.astype(np.float64) * big_p + process
        p = np.searchsorted(ds, want)
        hit = (p < len(ds)) & ok
        hit[hit] = ds[p[hit]] == want[hit]
        recv[hit] = dr[p[hit]]
    return recv


def _cum_by_request(r: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Running token count within each request (rows sorted by request)."""
    c = np.cumsum(k).astype(np.float64)
    if not len(c):
        return c
    head = np.ones(len(r), dtype=bool)
    head[1:] = r[1:] != r[:-1]
    start = np.maximum.accumulate(np.where(head, np.arange(len(r)), 0))
    base = np.concatenate([[0.0], c])[start]
    return c - base


def engine_part_log(
    log: RawLog, g: ClientGaps, lo: np.ndarray | None = None, hi: np.ndarray | None = None
) -> RawLog:
    """The run with one pseudo-request per client gap whose engine part ``[lo, hi]``
    (default ``[a, x]``) is non-empty, emitting at its two ends: `partition` then
    partitions exactly the engine parts."""
    lo = g.a if lo is None else lo
    hi = g.x if hi is None else hi
    live = np.flatnonzero(hi > lo)
    n = len(live)
    req = np.repeat(np.arange(n), 2)
    t = np.column_stack([lo[live], hi[live]]).ravel()
    step = np.column_stack([g.step0[live], g.step1[live]]).ravel()
    dstep = np.column_stack([g.step0[live], g.dstep1[live]]).ravel()
    em = Emissions(request=req, t_s=t, step=step, num_tokens=np.ones(2 * n, dtype=np.int64),
                   device_step=dstep)  # fmt: skip
    # each pseudo-request inherits its request's evictions
    ev = log.evictions
    # each pseudo-request's rows: its request's, in their order (a gap's range of them in
    # the rows sorted by request, stably)
    by_req = np.argsort(ev.request, kind="stable")
    lo = np.searchsorted(ev.request[by_req], g.request[live], side="left")
    count = np.searchsorted(ev.request[by_req], g.request[live], side="right") - lo
    owner = np.repeat(np.arange(n, dtype=np.int64), count)
    first = np.cumsum(count) - count
    src = by_req[np.arange(int(count.sum()), dtype=np.int64) + np.repeat(lo - first, count)]
    evictions = Evictions(
        request=owner.astype(np.int64),
        t_evict_s=ev.t_evict_s[src],
        t_readmit_s=ev.t_readmit_s[src],
        mode=ev.mode[src],
    )
    nan = np.full(n, np.nan)
    requests = Requests(arrival_s=nan, prompt_tokens=np.full(n, -1),
                        max_new_tokens=np.full(n, -1), first_token_s=nan.copy())  # fmt: skip
    return replace(log, emissions=em, evictions=evictions, requests=requests,
                   request_ids=tuple(str(i) for i in range(n)))  # fmt: skip


def _frontend_processes(log: RawLog) -> list[int]:
    procs = log.meta.get("processes", [])
    return [i for i, p in enumerate(procs) if isinstance(p, dict) and p.get("role") == FRONTEND]


def frontend_windows(log: RawLog, process: int | None = None) -> list[tuple[float, float, int]]:
    """(start, end, precedence rank) of every API server window that owns frontend time;
    `process`: that API server's only (each API server's event loop delays only the
    chunks it writes)."""
    ps = log.proc_segments
    fe = np.isin(ps.process, _frontend_processes(log) if process is None else [process])
    rank = {lb: FRONTEND_PRECEDENCE.index(FRONTEND_WINDOW[lb]) for lb in FRONTEND_WINDOW}
    lab = np.array([rank.get(x, -1) for x in log.labels] + [-1], dtype=np.int64)
    r = lab[ps.label] if len(ps) else np.zeros(0, dtype=np.int64)
    m = fe & (r >= 0) & (ps.t_end_s > ps.t_start_s)
    return list(zip(ps.t_start_s[m].tolist(), ps.t_end_s[m].tolist(), r[m].tolist(), strict=True))


#: meta key: (request, API server) pairs a slice of a long run states for the requests
#: whose first chunk its parts may not hold (`stating_api_servers`)
API_SERVERS_META = "request_api_servers"


def request_api_servers(log: RawLog) -> np.ndarray:
    """Per request, the API server (index into ``meta["processes"]``) that wrote its first
    chunk; -1 for a request with no chunk. Where the log's meta states some
    (`API_SERVERS_META`: a slice of a long run, whose first chunks may lie in later parts),
    those are taken."""
    ce = log.client_emissions
    out = np.full(len(log.requests), -1, dtype=np.int64)
    o = np.lexsort((-ce.t_s, ce.request))  # per request latest first: the first chunk wins
    out[ce.request[o]] = ce.process[o]
    stated = log.meta.get(API_SERVERS_META) if isinstance(log.meta, dict) else None
    if stated:
        pairs = np.asarray(stated, dtype=np.int64).reshape(-1, 2)
        ok = (pairs[:, 0] >= 0) & (pairs[:, 0] < len(out))
        out[pairs[ok, 0]] = pairs[ok, 1]
    return out


def stating_api_servers(log: RawLog, pairs: Sequence[tuple[int, int]]) -> RawLog:
    """`log` with the API server of each request in `pairs` stated in its meta (the whole
    run's `request_api_servers`, for a slice that may not hold their first chunks)."""
    if not pairs:
        return log
    return replace(log, meta={**log.meta, API_SERVERS_META: [list(p) for p in pairs]})


def frontend_os_between(
    log: RawLog, process: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, what the OS took of API server `process`'s event loop over ``[lo, hi]``, in
    seconds: its run-queue share and (inside its segments) its off-CPU share, spread evenly
    over each interval of ``proc_os`` (docs/partition.md, "Unrecorded windows", rule 5);
    0 for a process without intervals (-1: none)."""
    rq_out, bl_out = np.zeros(len(lo)), np.zeros(len(lo))
    po = log.proc_os
    for p in np.intersect1d(np.unique(process), np.unique(po.process)).tolist():
        rows, mine = np.flatnonzero(process == p), np.flatnonzero(po.process == p)
        t0, t1 = po.t_start_s[mine], po.t_end_s[mine]
        # one process's intervals are sorted and disjoint: the integral of each share is
        # piecewise linear through (t0, its total before) and (t1, its total after)
        xs = np.column_stack([t0, t1]).ravel()
        blocked = np.where(po.in_segment[mine] == 1, po.offcpu_s[mine], 0.0)
        for out, amount in ((rq_out, po.runqueue_s[mine]), (bl_out, blocked)):
            after = np.cumsum(amount)
            cum = np.column_stack([after - amount, after]).ravel()
            out[rows] = np.interp(hi[rows], xs, cum) - np.interp(lo[rows], xs, cum)
    return rq_out, bl_out


def client_partition(
    log: RawLog, *, check: bool = True, run: PreparedRun | None = None
) -> ClientPartition:
    """Partition every client gap of a merged server run (see the module docstring).

    `run`: the log's `PreparedRun`, if the caller partitions it more than once (one prepared
    from other tables is not used); the engine part's partition uses it too."""
    return client_partition_of(log, client_gaps(log), check=check, run=run)


def client_partition_of(
    log: RawLog, g: ClientGaps, *, check: bool = True, run: PreparedRun | None = None
) -> ClientPartition:
    """`client_partition` of the client gaps `g` (`client_gaps` of the run, or some of them
    with what the run says of each: a slice of a long run, `tracekit.analysis.stream_client`),
    each partitioned over `log`'s engine and API server rows."""
    run = prepared(log, run)
    # the engine core's span ends inside the gap before the token was recorded: from x on,
    # whether the token existed is unrecorded (module docstring, "Unrecorded windows")
    cut = np.isnan(g.e) & (g.b > g.core_hi)
    x = np.where(cut, np.clip(g.core_hi, g.a, g.b), g.x)
    lo = np.clip(g.core_lo, g.a, x)  # [lo, hi]: the engine part [a, x] within the core's span
    hi = np.clip(g.core_hi, lo, x)
    fx = np.where(cut, g.b, x)  # [fx, b]: the frontend part (empty when cut)
    front, unrec_api = frontend_part(log, g.process, fx, g.b, g.e, g.recv)
    unrec = {
        UNRECORDED_CORE: ((x - g.a) - (hi - lo) + np.where(cut, g.b - x, 0.0)) * 1e3,
        UNRECORDED_API: unrec_api,
    }
    unrec_labels = tuple(k for k, v in unrec.items() if (v > 0).any())
    live = np.flatnonzero(hi > lo)
    eng = partition(engine_part_log(log, g, lo, hi), check=check, run=run) if len(live) else None
    eng_labels = eng.labels if eng is not None else itl_labels(run)
    os_labels = FRONTEND_OS_LABELS if len(log.proc_os) else ()
    labels = (*eng_labels, *FRONTEND_LABELS, *os_labels, *unrec_labels)
    n, ne = len(g.a), len(eng_labels)
    nfl = len(FRONTEND_LABELS) + len(os_labels)
    parts = np.zeros((n, len(labels)))
    if eng is not None:
        parts[live[eng.request], :ne] = eng.parts_ms
    parts[:, ne : ne + nfl] = front[:, :nfl]
    for j, name in enumerate(unrec_labels):
        parts[:, ne + nfl + j] = unrec[name]
    out = ClientPartition(
        labels=labels,
        request=g.request,
        t0_s=g.a,
        t1_s=g.b,
        engine_s=x,
        num_tokens=g.num_tokens,
        gap_ms=(g.b - g.a) * 1e3,
        parts_ms=parts,
    )
    return check_client_reconciled(out, log.path) if check else out


def frontend_part(
    log: RawLog, process: np.ndarray, x: np.ndarray, b: np.ndarray, e: np.ndarray,
    recv: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The frontend part ``[x, b]`` of windows that end where API server `process` wrote a
    chunk at `b` (a client gap's, rule 2; a client-boundary TTFT's, docs/ttft.md), with `e`
    when the engine core emitted the token the chunk waited for and `recv` when that API
    server received that step's outputs (NaN: unknown). Returns (its columns in ms,
    FRONTEND_LABELS then FRONTEND_OS_LABELS, over the time that API server recorded; the
    rest, ``unrecorded:api_server``, in ms): the module docstring's rules 2-3 and
    "Unrecorded windows" rule 3, the one place they are applied."""
    fe_lo, fe_hi = process_spans(log, process)
    flo = np.clip(fe_lo, x, b)  # [flo, fhi]: the part within the API server's span
    fhi = np.clip(fe_hi, flo, b)
    parts = np.zeros((len(x), len(FRONTEND_LABELS) + len(FRONTEND_OS_LABELS)))
    # per API server, one timeline of its windows, owner by precedence, and of its OS
    # intervals, for the windows whose chunk it wrote
    for proc in np.unique(process).tolist():
        rows = np.flatnonzero(process == proc)
        parts[rows] = _frontend_parts(log, int(proc), flo[rows], fhi[rows], e[rows], recv[rows])
    return parts, ((b - x) - (fhi - flo)) * 1e3


def _frontend_parts(
    log: RawLog, process: int, x: np.ndarray, b: np.ndarray, e: np.ndarray, recv: np.ndarray
) -> np.ndarray:
    """The frontend columns of windows [x, b] inside the span of `process`, which wrote
    their chunks (ms): FRONTEND_LABELS then FRONTEND_OS_LABELS. Its windows own the
    frontend part by precedence, the hop (e to recv) and ``frontend_other`` the time no
    window owns; at an instant inside one of its OS intervals (``proc_os``), that
    interval's run-queue share of the instant is ``frontend_os_runqueue`` and, inside a
    segment, its off-CPU share ``frontend_os_blocked``, taken from whichever label owns
    the instant."""
    nf = len(FRONTEND_PRECEDENCE)
    w = np.array(frontend_windows(log, process), dtype=np.float64).reshape(-1, 3)
    po = log.proc_os
    mine = po.process == process
    os0, os1 = po.t_start_s[mine], po.t_end_s[mine]
    length = os1 - os0
    with np.errstate(divide="ignore", invalid="ignore"):
        rq_rate = np.where(length > 0, po.runqueue_s[mine] / length, 0.0)
        # off-CPU time is evidence only inside a segment (between them the loop may be idle)
        bl_rate = np.where((length > 0) & (po.in_segment[mine] == 1),
                           po.offcpu_s[mine] / length, 0.0)  # fmt: skip
    # elementary intervals: cut at every window and OS interval edge
    bounds = np.unique(np.concatenate([w[:, 0], w[:, 1], os0, os1]))
    width, mid = np.diff(bounds), (bounds[:-1] + bounds[1:]) / 2
    owner = np.full(len(width), -1)  # the window class owning each, -1: none
    if len(w):
        k0, k1 = np.searchsorted(bounds, w[:, 0]), np.searchsorted(bounds, w[:, 1])
        for c in range(nf - 1, -1, -1):  # the first in precedence wins
            m = w[:, 2] == c
            count = np.zeros(len(bounds))
            np.add.at(count, k0[m], 1.0)
            np.add.at(count, k1[m], -1.0)
            owner[np.cumsum(count)[:-1] > 0.5] = c
    # the OS interval over each (one process's never overlap), behind a sentinel for none
    k = np.searchsorted(np.concatenate([[-np.inf], os0]), mid, side="right") - 1
    inside = mid < np.concatenate([[-np.inf], os1])[k]
    rq = np.where(inside, np.concatenate([[0.0], rq_rate])[k], 0.0)
    bl = np.where(inside, np.concatenate([[0.0], bl_rate])[k], 0.0)

    def over(rate: np.ndarray) -> Any:
        """lo, hi -> the integral of `rate` (per elementary interval) over [lo, hi], s."""
        if len(bounds) < 2:
            return lambda lo, hi: np.zeros(len(lo))
        cum = np.concatenate([[0.0], np.cumsum(width * rate)])
        return lambda lo, hi: np.interp(hi, bounds, cum) - np.interp(lo, bounds, cum)

    parts = np.zeros((len(x), len(FRONTEND_LABELS) + len(FRONTEND_OS_LABELS)))
    os_rq, os_bl = np.zeros(len(x)), np.zeros(len(x))
    for c in range(nf):
        is_c = (owner == c).astype(np.float64)
        own, r_c, b_c = over(is_c)(x, b), over(is_c * rq)(x, b), over(is_c * bl)(x, b)
        parts[:, c] = own - r_c - b_c
        os_rq, os_bl = os_rq + r_c, os_bl + b_c
    # the time no window owns: the hop (from e until the API server received the step's
    # outputs), the rest frontend_other
    none = (owner < 0).astype(np.float64)
    hop_lo = np.clip(np.where(np.isnan(e), b, e), x, b)
    hop_hi = np.clip(np.where(np.isnan(recv), hop_lo, recv), hop_lo, b)
    owned_in_hop = over((owner >= 0).astype(np.float64))(hop_lo, hop_hi)
    r_hop, b_hop = over(none * rq)(hop_lo, hop_hi), over(none * bl)(hop_lo, hop_hi)
    r_none, b_none = over(none * rq)(x, b), over(none * bl)(x, b)
    parts[:, nf] = np.maximum((hop_hi - hop_lo) - owned_in_hop - r_hop - b_hop, 0.0)
    os_rq, os_bl = os_rq + r_none, os_bl + b_none
    parts[:, nf + 2], parts[:, nf + 3] = os_rq, os_bl
    parts *= 1e3
    front = (b - x) * 1e3
    parts[:, nf + 1] = np.maximum(front - parts.sum(axis=1), 0.0)
    return parts


def check_client_reconciled(p: ClientPartition, path: str = "") -> ClientPartition:
    if not len(p):
        return p
    err = p.reconcile_err_ms
    i = int(np.argmax(err))
    if err[i] > RECONCILE_TOL_MS * max(1.0, p.gap_ms[i]) or p.parts_ms.min() < -RECONCILE_TOL_MS:
        raise ReconcileError(
            f"{path}: client gap {i} (request {int(p.request[i])}) is {p.gap_ms[i]!r} ms but "
            f"its parts sum to {p.parts_ms[i].sum()!r} ms "
            f"({dict(zip(p.labels, p.parts_ms[i].round(6).tolist(), strict=True))})"
        )
    return p


# -- figures ------------------------------------------------------------------------------

PCTS = (50, 90, 99)


def _pcts(v: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    if not len(v):
        return {f"p{q}": float("nan") for q in PCTS} | {"mean": float("nan"), "n": 0}
    if weights is not None:
        return _weighted_pcts(v, weights)
    return {f"p{q}": float(np.percentile(v, q)) for q in PCTS} | {
        "mean": float(v.mean()),
        "n": int(len(v)),
    }


def _weighted_pcts(v: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    """`_pcts` of `v` with each value repeated `weights` times, without building the
    repeated array (a chunk may claim 2^31 tokens: memory stays that of `v`). numpy's
    linear percentile reads position h = q/100 (n - 1) of the sorted values; the value
    at a position is the one whose run of repeats covers it."""
    w = np.asarray(weights, dtype=np.float64)
    o = np.argsort(v, kind="stable")
    vs, ws = np.asarray(v, dtype=np.float64)[o], w[o]
    ends = np.cumsum(ws)  # position (exclusive) where each value's repeats end
    n = float(ends[-1])

    def at(pos: float) -> float:
        return float(vs[min(int(np.searchsorted(ends, pos, side="right")), len(vs) - 1)])

    out = {}
    for q in PCTS:
        h = q / 100.0 * (n - 1)
        lo = float(np.floor(h))
        a, b = at(lo), at(min(lo + 1, n - 1))
        out[f"p{q}"] = a + (h - lo) * (b - a)
    return out | {"mean": float(np.dot(vs, ws) / n), "n": int(n)}


def itl_conventions(log: RawLog, cp: ClientPartition, engine_gap_ms: np.ndarray) -> dict[str, Any]:
    """ITL (ms) per chunk, per token (chunk gap / its tokens, once per token) and per engine
    step (the engine boundary's gaps), side by side."""
    per_token = cp.gap_ms / np.maximum(cp.num_tokens, 1)
    return {
        "per_chunk": _pcts(cp.gap_ms),
        "per_token": _pcts(per_token, np.maximum(cp.num_tokens, 1)),
        "per_engine_step": _pcts(np.asarray(engine_gap_ms)),
        "tokens_per_chunk_mean": float(cp.num_tokens.mean()) if len(cp) else float("nan"),
    }


def client_summary(log: RawLog, cp: ClientPartition, engine_gap_ms: np.ndarray) -> dict[str, Any]:
    """What analyze and report show for the client boundary: ITL conventions, the share of
    all client-gap time and of tail time (gaps >= p99) by label, engine vs frontend."""
    out: dict[str, Any] = {"gaps": len(cp), "chunks": len(log.client_emissions)}
    out["itl_ms"] = itl_conventions(log, cp, engine_gap_ms)
    total = cp.gap_ms.sum()
    out["all_share"] = {
        lb: float(cp.parts_ms[:, j].sum() / total) if total > 0 else 0.0
        for j, lb in enumerate(cp.labels)
    }
    if len(cp):
        p99 = float(np.percentile(cp.gap_ms, 99))
        tail = cp.gap_ms >= p99
        tt = cp.gap_ms[tail].sum()
        out["p99_ms"] = p99
        out["tail_share"] = {
            lb: float(cp.parts_ms[tail, j].sum() / tt) if tt > 0 else 0.0
            for j, lb in enumerate(cp.labels)
        }
        out["frontend_share"] = float(cp.frontend_ms().sum() / total) if total > 0 else 0.0
        out["reconcile_max_err_ms"] = float(cp.reconcile_err_ms.max())
    return out


#: Counter name prefix of speculative decoding's per-position acceptance: the value of
#: ``spec.accepted_pos.K`` in a step is how many drafts had their token at position K
#: (0-based) accepted (`engine_adapters.vllm_v1.count_acceptance`).
SPEC_POS_PREFIX = "spec.accepted_pos."


def spec_acceptance(log: RawLog) -> dict[str, Any] | None:
    """Speculative decoding from the counters recorded per step: ``spec.drafted`` and
    ``spec.accepted`` (draft tokens proposed and accepted), ``spec.drafts`` (drafts
    checked: requests with draft tokens in a step) and ``spec.accepted_pos.K`` (drafts
    whose token at position K was accepted). Returns None without ``spec.drafted``.

    - ``acceptance``: accepted / drafted draft tokens;
    - ``mean_accepted_length``: 1 + accepted / drafts, tokens a checked draft yielded
      (the forward pass's own token counted, as vLLM's log does);
    - ``acceptance_per_pos``: per position K, drafts with position K accepted / drafts
      (vLLM's per-position rate; it can only fall with K: acceptance stops at the first
      rejection); ``accepted_per_pos``: the counts;
    - ``tokens_per_emission``: tokens per engine emission (every emission of the run).

    A log recorded before ``spec.drafts`` existed has no per-position figures (NaN and
    empty lists)."""
    names = log.counter_names
    if "spec.drafted" not in names:
        return None
    c = log.counters
    totals = (
        np.bincount(c.name.astype(np.int64), weights=c.value, minlength=len(names))
        if len(c)
        else None
    )

    def total(name: str) -> float:
        if name not in names or totals is None:
            return 0.0
        return float(totals[names.index(name)])

    drafted, accepted = total("spec.drafted"), total("spec.accepted")
    drafts = total("spec.drafts") if "spec.drafts" in names else float("nan")
    # positions 0, 1, ... as far as the log names them without a hole (a recorder writes every
    # position up to a step's longest draft): bounded by the names present, never by a
    # number a name claims
    present = set(names)
    per_pos: list[float] = []
    while f"{SPEC_POS_PREFIX}{len(per_pos)}" in present:
        per_pos.append(total(f"{SPEC_POS_PREFIX}{len(per_pos)}"))
    em = log.emissions
    return {
        "drafted": drafted,
        "accepted": accepted,
        "drafts": drafts,
        "acceptance": accepted / drafted if drafted else float("nan"),
        "mean_accepted_length": 1.0 + accepted / drafts if drafts > 0 else float("nan"),
        "accepted_per_pos": per_pos,
        "acceptance_per_pos": [v / drafts for v in per_pos] if drafts > 0 else [],
        "tokens_per_emission": float(em.num_tokens.mean()) if len(em) else float("nan"),
    }


__all__ = [
    "API_SERVERS_META",
    "FRONTEND_LABELS",
    "FRONTEND_OS_LABELS",
    "SPEC_POS_PREFIX",
    "UNRECORDED_LABELS",
    "ClientGaps",
    "ClientPartition",
    "client_gaps",
    "client_partition",
    "client_partition_of",
    "client_summary",
    "itl_conventions",
    "spec_acceptance",
    "stating_api_servers",
]
