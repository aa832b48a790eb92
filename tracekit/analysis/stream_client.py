"""The client boundary of a long server run, read in slices (docs/reports.md, "Reading a
long run in slices").

A server's run merged into a parts folder (`tracekit.log.merge_stream`: each part the
engine core's rows of its time range, with the chunks written, the deliveries, the API
servers' windows and OS intervals of the same range) is read in slices by
`tracekit.analysis.stream` for its engine boundary. Its client boundary
(`tracekit.attribution.client`, `client_ttft`) is read here, in the same bounded memory,
with the figures of the whole merged run:

1. **The client index pass**, after the engine's (`analyze_sliced`'s index pass gives the
   whole run's graph baselines): every part once, in order. Each chunk is matched to the
   engine emission its last token came from as `client_gaps` matches them, by the running
   token counts of its request (kept per request; the emissions not yet streamed wait in
   a small table; a chunk recorded before its emission, the processes' clocks disagreeing,
   waits for it), so each client gap is known with its engine emission and steps: its
   length is counted for the exact percentiles (`ExactQuantiles`, per chunk and per token)
   and its row waits in a temporary file (72 bytes a gap; a late match is written into
   its row). Per part it notes how far back the gaps written in it reach (the part of the
   earlier chunk, of the emissions both chunks waited for) and how far forward (an
   emission recorded in a later part); per request, its arrival, first chunk and first
   emission (where a client TTFT reaches).
2. **Client slices**: consecutive parts own the gaps and client TTFTs whose (later, first)
   chunk was written in them; each slice reads the parts its own gaps and TTFTs reach
   (and the deliveries of the steps it reads), and also every earlier part whose API
   server windows or OS intervals reach into them (from a TTFT's arrival), and partitions them
   with `client_partition_of` and the client TTFT rule over that log, with the whole run's
   baselines. Sums by label are added up; of the client TTFTs, two values a request
   (client and engine boundary, for the percentiles) and their parts summed by label. A
   slice's log holds only the requests its parts name (`SlicedRun.local_log_of`).

Equal to the whole merged run's `client` figures: counts and percentiles exactly, sums and
shares to float rounding.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tracekit.allocator import give_back_freed_memory
from tracekit.analysis.figures import RunAnalysis
from tracekit.analysis.quantiles import ExactQuantiles
from tracekit.analysis.results import ClientSummary, ItlConventions
from tracekit.analysis.stream import (
    DEFAULT_SLICE_EMISSIONS,
    Index,
    analyze_sliced,
    gap_lengths,
    index_pass,
    whole_baselines,
)
from tracekit.analysis.stream_ttft import TTFT_LABEL_GROUPS, ordered
from tracekit.analysis.unrecorded import unrecorded_entries
from tracekit.attribution.client import (
    FRONTEND_LABELS,
    UNRECORDED_API,
    UNRECORDED_CORE,
    UNRECORDED_LABELS,
    ClientGaps,
    ClientPartition,
    client_partition_of,
    core_process,
    frontend_part,
    process_spans,
    received_at,
)
from tracekit.attribution.client_ttft import client_ttft_labels
from tracekit.attribution.itl import FIT_ALL_CAPTURED
from tracekit.attribution.timeline import GraphBaseline, PreparedRun, fit_baseline_steps
from tracekit.attribution.ttft import TtftPartition, ttft_partition
from tracekit.labels import FRONTEND_OS_LABELS, partition_labels
from tracekit.log.flush import TABLES
from tracekit.log.merged_tables import MERGED_TABLES
from tracekit.log.parts import Retained
from tracekit.log.rawlog import Coverage, RawLog
from tracekit.log.serve_contract import ADDED, FRONTEND
from tracekit.log.slices import NotSliceable, SlicedRun, grown, parts_holding

__all__ = ["analyze_sliced_client"]

_EM = {c: TABLES["emissions"].index(c) for c in TABLES["emissions"]}
_RQ = TABLES["requests"].index("request")
_CE = {c: MERGED_TABLES["client_emissions"].index(c) for c in MERGED_TABLES["client_emissions"]}
_CT = {c: TABLES["counters"].index(c) for c in TABLES["counters"]}
#: a client gap's row in the temporary file: what `ClientGaps` needs beside the slice's log
#: (steps as recorded; -1: none)
GAP_COLUMNS = ("request", "a", "b", "e", "step0", "step1", "dstep1", "num_tokens", "process")
_G = {c: j for j, c in enumerate(GAP_COLUMNS)}
PCTS = (50, 90, 99)
NEVER = np.iinfo(np.int64).min


def _within(r: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Running total of `k` within each request (rows sorted by request)."""
    c = np.cumsum(k)
    if not len(c):
        return c
    head = np.ones(len(r), dtype=bool)
    head[1:] = r[1:] != r[:-1]
    start = np.maximum.accumulate(np.where(head, np.arange(len(r)), 0))
    return c - np.concatenate([[0], c])[start]


@dataclass
class ClientIndex:
    """What the client index pass gathers (module docstring, 1): per request, per part,
    per run."""

    # per request: tokens emitted and streamed so far; the last chunk (time, part, the step
    # and part of the emission it waited for); the first chunk (time, API server, part);
    # the first emission (time, step, part); the part of the arrival row, the arrival
    room: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    req: dict[str, np.ndarray] = field(default_factory=dict)
    # the emissions not yet streamed whole: request, running count, time, step, device
    # step, part (sorted by request, count)
    pending: tuple[np.ndarray, ...] = ()
    # per part: the earliest part its gaps and first chunks reach back to, the latest
    # forward, their earliest start, its gaps, its latest API server window end and its
    # earliest delivered step
    back: list[int] = field(default_factory=list)
    fwd: list[int] = field(default_factory=list)
    t_lo: list[float] = field(default_factory=list)
    num_gaps: list[int] = field(default_factory=list)
    win_end: list[float] = field(default_factory=list)
    deliv_min: list[float] = field(default_factory=list)
    chunks: int = 0
    tokens_sum: float = 0.0
    per_chunk: ExactQuantiles = field(default_factory=lambda: ExactQuantiles(PCTS))
    per_token: ExactQuantiles = field(default_factory=lambda: ExactQuantiles(PCTS))
    per_token_sum: float = 0.0
    engine_sum: float = 0.0
    engine_last: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: chunks whose emission is not recorded yet (if ever), by an id: [request, running
    #: count, the gap it ends (its slot in the file, its part; -1: none), the gap it begins
    #: (the same)]
    late: dict[int, list[int]] = field(default_factory=dict)
    num_late: int = 0
    gaps_total: int = 0
    added_s: list[np.ndarray] = field(default_factory=list)
    coverage: np.ndarray | None = None
    has_proc_os: bool = False
    spill: Any = None

    _INT = ("emitted", "streamed", "last_part", "last_mstep", "last_mpart", "last_late",
            "first_proc", "first_part", "fe_step", "fe_part", "arr_part")  # fmt: skip
    _FLOAT = ("last_w", "first_w", "fe_t", "arr_t")

    def grow(self, n: int) -> None:
        """The per-request columns lengthened to `n` requests."""
        for k in self._INT:
            fill = 0 if k in ("emitted", "streamed") else -1
            a = self.req.get(k, np.zeros(0, dtype=np.int64))
            self.req[k] = grown(self.room, k, a, n, fill)
        for k in self._FLOAT:
            a = self.req.get(k, np.zeros(0, dtype=np.float64))
            self.req[k] = grown(self.room, k, a, n, np.nan)  # type: ignore[arg-type]
        self.engine_last = grown(self.room, "engine_last", self.engine_last, n, NEVER)


def client_index_pass(run: SlicedRun) -> ClientIndex:
    """Every part once, in order (module docstring, 1); after `run`'s engine index pass."""
    cx = ClientIndex(spill=tempfile.TemporaryFile())
    z = np.zeros(0, dtype=np.int64)
    cx.pending = (z, z, np.zeros(0), z, z, z)
    flushed = np.array([e.flush_tick for e in run.parts], dtype=np.int64)
    sampled = [(k, e.os_from_tick) for k, e in enumerate(run.parts) if e.os_from_tick is not None]
    os_parts = np.array([k for k, _ in sampled], dtype=np.int64)
    os_first = np.array([t for _, t in sampled], dtype=np.int64)
    for i in range(len(run.paths)):
        part = run.read(i)
        t = part["tables"]
        n_req = part["request_ids_start"] + len(part["request_ids"])
        ce = t.get("client_emissions")
        if ce is not None and len(ce):
            n_req = max(n_req, int(ce[:, _CE["request"]].max()) + 1)
        cx.grow(n_req)
        rq = t.get("requests")
        if rq is not None and len(rq):
            ticks = rq[:, TABLES["requests"].index("arrival_tick")]
            n_s = int(np.searchsorted(os_parts, i))  # the parts sampled before part `i`
            cx.req["arr_part"][rq[:, _RQ]] = parts_holding(
                flushed, ticks, i, (os_parts[:n_s], os_first[:n_s]))  # fmt: skip
            arr = run.secs(ticks)
            cx.req["arr_t"][rq[:, _RQ]] = np.fmin(cx.req["arr_t"][rq[:, _RQ]], arr)
        cr = t.get("client_requests")  # the arrival the join gave (the API server's receipt)
        if cr is not None and len(cr):
            r = cr[:, 0].astype(np.int64)
            cx.req["arr_t"][r] = np.fmin(cx.req["arr_t"][r], cr[:, 1])
        _add_emissions(run, cx, i, t.get("emissions"))
        _add_chunks(cx, i, ce)
        _add_other(cx, part)
    return cx


def _add_emissions(run: SlicedRun, cx: ClientIndex, i: int, em: np.ndarray | None) -> None:
    """Part `i`'s engine emissions: each request's running count, its first emission, the
    engine gaps' sum (the per-step ITL's mean) and the emissions waiting for their chunk."""
    if em is None or not len(em):
        return
    gap, _ = gap_lengths(run, cx.engine_last, em)
    cx.engine_sum += float(gap.sum())
    o = np.lexsort((em[:, _EM["t_tick"]], em[:, _EM["request"]]))  # as `client_gaps`
    r, k = em[o, _EM["request"]], em[o, _EM["num_tokens"]]
    cum = cx.req["emitted"][r] + _within(r, k)
    last = np.ones(len(r), dtype=bool)
    last[:-1] = r[1:] != r[:-1]
    cx.req["emitted"][r[last]] = cum[last]
    first = np.ones(len(r), dtype=bool)
    first[1:] = r[1:] != r[:-1]
    new = first & (cx.req["fe_part"][r] < 0)
    t_s = run.secs(em[o, _EM["t_tick"]])
    cx.req["fe_t"][r[new]] = t_s[new]
    cx.req["fe_step"][r[new]] = em[o, _EM["step"]][new]
    cx.req["fe_part"][r[new]] = i
    old = cx.pending
    cols = (r, cum, t_s, em[o, _EM["step"]], em[o, _EM["device_step"]], np.full(len(r), i))
    both = tuple(np.concatenate([a, b]) for a, b in zip(old, cols, strict=True))
    s = np.lexsort((both[1], both[0]))
    cx.pending = tuple(a[s] for a in both)
    if cx.late:
        _resolve_late(cx)


def _resolve_late(cx: ClientIndex) -> None:
    """The chunks written before the emission they waited for was recorded, matched now
    that more emissions are: their gaps' rows in the file get the emission (the later
    chunk's) and the step (the earlier chunk's), and their parts read forward to it."""
    ids = list(cx.late)
    r = np.array([cx.late[j][0] for j in ids], dtype=np.int64)
    c = np.array([cx.late[j][1] for j in ids], dtype=np.int64)
    t, step, dstep, part = _matched(cx, r, c)
    for n in np.flatnonzero(part >= 0).tolist():
        req, _, slot, own, next_slot, next_own = cx.late.pop(ids[n])
        if slot >= 0:  # the gap it ends: its emission
            _patch(cx, slot, "e", float(t[n]))
            _patch(cx, slot, "step1", float(step[n]))
            _patch(cx, slot, "dstep1", float(dstep[n]))
            cx.fwd[own] = max(cx.fwd[own], int(part[n]))
        if next_slot >= 0:  # the gap it begins: its step
            _patch(cx, next_slot, "step0", float(step[n]))
            cx.fwd[next_own] = max(cx.fwd[next_own], int(part[n]))
        if cx.req["last_late"][req] == ids[n]:  # still its request's last chunk
            cx.req["last_mstep"][req], cx.req["last_mpart"][req] = step[n], part[n]
            cx.req["last_late"][req] = -1


def _patch(cx: ClientIndex, slot: int, column: str, value: float) -> None:
    """One value of gap row `slot` in the temporary file."""
    cx.spill.seek((slot * len(GAP_COLUMNS) + _G[column]) * 8)
    np.array([value], dtype=np.float64).tofile(cx.spill)


def _add_chunks(cx: ClientIndex, i: int, ce: np.ndarray | None) -> None:
    """Part `i`'s chunks: each matched to its emission, its gap written out and counted,
    and how far the part's gaps and first chunks reach."""
    back, fwd, t_lo, n_gaps = i, i, math.inf, 0
    if ce is not None and len(ce):
        ce = ce[np.argsort(ce[:, _CE["row"]], kind="stable")]  # the run's order
        o = np.lexsort((ce[:, _CE["t_s"]], ce[:, _CE["request"]]))  # as `client_gaps`
        r = ce[o, _CE["request"]].astype(np.int64)
        w = ce[o, _CE["t_s"]]
        k = ce[o, _CE["num_tokens"]].astype(np.int64)
        proc = ce[o, _CE["process"]].astype(np.int64)
        rq = cx.req
        ccum = rq["streamed"][r] + _within(r, k)
        m_t, m_step, m_dstep, m_part = _matched(cx, r, ccum)
        head = np.ones(len(r), dtype=bool)
        head[1:] = r[1:] != r[:-1]
        prev_w = np.where(head, rq["last_w"][r], np.roll(w, 1))
        prev_part = np.where(head, rq["last_part"][r], i)
        prev_mstep = np.where(head, rq["last_mstep"][r], np.roll(m_step, 1))
        prev_mpart = np.where(head, rq["last_mpart"][r], np.roll(m_part, 1))
        has = ~np.isnan(prev_w)
        rows = np.column_stack([
            r, prev_w, w, m_t, prev_mstep, m_step, m_dstep, k, proc,
        ])[has].astype(np.float64)  # fmt: skip
        cx.spill.seek(0, 2)
        rows.tofile(cx.spill)
        n_gaps = int(has.sum())
        slot = np.full(len(r), -1, dtype=np.int64)
        slot[has] = cx.gaps_total + np.arange(n_gaps)
        cx.gaps_total += n_gaps
        _note_late(cx, i, r, ccum, head, slot, m_part < 0)
        if n_gaps:
            gap_ms = (w[has] - prev_w[has]) * 1e3
            cx.per_chunk.count(gap_ms)
            tok = np.maximum(k[has], 1)
            cx.per_token.count_weighted(gap_ms / tok, tok)
            cx.per_token_sum += float(np.dot(gap_ms / tok, tok))
            cx.tokens_sum += float(k[has].sum())
            mp = prev_mpart[has]
            back = min(back, int(prev_part[has].min()), int(mp[mp >= 0].min(initial=i)))
            fwd = max(fwd, int(m_part[has].max()), int(prev_mpart[has].max()))
            t_lo = min(t_lo, float(prev_w[has].min()))
        first = ~has & (rq["first_part"][r] < 0)
        fr = r[first]
        rq["first_w"][fr], rq["first_proc"][fr], rq["first_part"][fr] = w[first], proc[first], i
        tail = np.ones(len(r), dtype=bool)
        tail[:-1] = head[1:]
        rt = r[tail]
        rq["streamed"][rt], rq["last_w"][rt], rq["last_part"][rt] = ccum[tail], w[tail], i
        rq["last_mstep"][rt], rq["last_mpart"][rt] = m_step[tail], m_part[tail]
        cx.chunks += len(r)
        p = cx.pending  # an emission streamed whole is never waited for again
        keep = p[1] >= rq["streamed"][p[0]]
        cx.pending = tuple(a[keep] for a in p)
    cx.back.append(back)
    cx.fwd.append(fwd)
    cx.t_lo.append(t_lo)
    cx.num_gaps.append(n_gaps)


def _note_late(
    cx: ClientIndex, i: int, r: np.ndarray, ccum: np.ndarray, head: np.ndarray,
    slot: np.ndarray, late: np.ndarray,
) -> None:  # fmt: skip
    """Part `i`'s chunks (sorted by request; `slot`: the row of the gap each ends, -1:
    none) noted where they or the chunk before them wait for an emission (`late`)."""
    rq = cx.req
    ids = np.full(len(r), -1, dtype=np.int64)
    for j in np.flatnonzero(late).tolist():
        ids[j] = cx.num_late
        cx.late[cx.num_late] = [int(r[j]), int(ccum[j]), int(slot[j]), i, -1, -1]
        cx.num_late += 1
    prev = np.where(head, rq["last_late"][r], np.roll(ids, 1))
    for j in np.flatnonzero((prev >= 0) & (slot >= 0)).tolist():
        if int(prev[j]) in cx.late:
            cx.late[int(prev[j])][4:] = [int(slot[j]), i]
    tail = np.ones(len(r), dtype=bool)
    tail[:-1] = head[1:]
    rq["last_late"][r[tail]] = ids[tail]


def _matched(cx: ClientIndex, r: np.ndarray, ccum: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per chunk (request `r`, running count `ccum`): the first emission of its request
    whose running count reaches it (`client_gaps`' match): its time (NaN: none yet), step,
    device step and part (-1: none)."""
    pr, pc, pt, ps, pd, pp = cx.pending
    t, step = np.full(len(r), np.nan), np.full(len(r), -1, dtype=np.int64)
    dstep, part = step.copy(), step.copy()
    if len(pr) and len(r):
        big = float(max(int(pc.max()), int(ccum.max())) + 1)
        j = np.searchsorted(pr.astype(np.float64) * big + pc, r.astype(np.float64) * big + ccum)
        ok = j < len(pr)
        ok[ok] = pr[j[ok]] == r[ok]
        t[ok], step[ok], dstep[ok], part[ok] = pt[j[ok]], ps[j[ok]], pd[j[ok]], pp[j[ok]]
    return t, step, dstep, part


def _add_other(cx: ClientIndex, part: dict[str, Any]) -> None:
    """Part's API server windows' latest end, its earliest delivered step, the run's
    coverage (in the last part) and the requests the engine core added (counters)."""
    t = part["tables"]
    end = -math.inf
    for k in ("proc_segments", "proc_os"):
        a = t.get(k)
        if a is not None and len(a):
            end = max(end, float(a[:, MERGED_TABLES[k].index("t_end_s")].max()))
            cx.has_proc_os |= k == "proc_os"
    cx.win_end.append(end)
    d = t.get("deliveries")
    steps = d[:, 0][d[:, 0] >= 0] if d is not None and len(d) else np.zeros(0)
    cx.deliv_min.append(float(steps.min()) if len(steps) else math.inf)
    if "proc_coverage" in t:
        cx.coverage = t["proc_coverage"]
    c = t.get("counters")
    if c is not None and len(c) and ADDED in part["counter_names"]:
        m = c[:, _CT["name"]] == part["counter_names"].index(ADDED)
        cx.added_s.append(c[m, _CT["t_tick"]].copy())


def owned_ttfts(cx: ClientIndex, a: int, b: int) -> np.ndarray:
    """The requests whose client TTFT parts ``[a, b)`` own: first chunk written there, at or
    after the first token (`client_ttft_rows`; the others have none)."""
    rq = cx.req
    fp = rq["first_part"]
    with np.errstate(invalid="ignore"):
        own = (fp >= a) & (fp < b) & (rq["fe_t"] <= rq["first_w"])
    return np.flatnonzero(own)


def client_bounds(run: SlicedRun, cx: ClientIndex, max_emissions: int) -> list[tuple[int, ...]]:
    """Each client slice's parts ``(c, a, b, d)``: read ``[c, d)``, own the gaps and TTFTs
    whose chunk was written in ``[a, b)``; as many parts owned as keep the emissions read
    within `max_emissions` (at least one part a slice)."""
    n = len(run.parts)
    counts = np.array([e.num_emissions for e in run.parts], dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(counts)])
    win_end = np.array(cx.win_end)
    deliv = np.array(cx.deliv_min)
    out: list[tuple[int, ...]] = []
    a = 0
    while a < n:
        b, c = a + 1, min(cx.back[a], max(0, a - 1))
        while b < n and cum[b + 1] - cum[min(c, cx.back[b])] <= max_emissions:
            b, c = b + 1, min(c, cx.back[b])
        d = max(b, max(cx.fwd[a:b]) + 1)
        t_lo = min(cx.t_lo[a:b])
        own = owned_ttfts(cx, a, b)
        if len(own):
            for col in ("arr_part", "fe_part"):
                v = cx.req[col][own]
                c = min(c, int(v[v >= 0].min(initial=c)))
            d = max(d, int(cx.req["fe_part"][own].max()) + 1)
            # the TTFT's own windows from its arrival (docs/ttft.md, rule 0)
            t_lo = min(t_lo, float(np.fmin(cx.req["arr_t"][own], cx.req["fe_t"][own]).min()))
        # an API server window or OS interval begun in an earlier part reaching the gaps
        reach = np.flatnonzero(win_end[:c] > t_lo)
        c = int(reach[0]) if len(reach) else c
        # the deliveries of the steps read, where later parts hold them
        last_step = run.parts[d - 1].first_step + run.parts[d - 1].num_steps - 1
        later = np.flatnonzero(deliv[d:] <= last_step)
        d = d + int(later[-1]) + 1 if len(later) else d
        out.append((c, a, b, d))
        a = b
    return out


@dataclass(frozen=True)
class ClientSliceTask:
    """One client slice's work (picklable): the parts to read ``[c, d)``, how a log read
    from part `c` starts, the run's coverage, the whole run's baselines cut to its steps, its
    own gaps' rows (`GAP_COLUMNS`), its own TTFTs' requests with their first chunk (time,
    API server) and first emission's step, and the client gaps' tail threshold."""

    parts_dir: str
    max_inflate_mb: float | None
    c: int
    d: int
    retained: Retained | None
    coverage: np.ndarray | None
    base_itl: GraphBaseline
    base_ttft: GraphBaseline
    base_client: GraphBaseline
    fit: str
    gaps: np.ndarray
    ttft_requests: np.ndarray
    ttft_w: np.ndarray
    ttft_proc: np.ndarray
    ttft_step: np.ndarray
    p99: float
    paths: tuple[str, ...] = ()  # of parts ``[c, d)``, as listed (`SlicedRun`'s `parts`)
    #: what other parts carry to the slice's log (`SlicedRun.carried_into`)
    carried: dict[str, Any] | None = None


@dataclass
class ClientSums:
    """A client slice's figures, added up over the slices."""

    labels: set[str] = field(default_factory=set)
    all_parts: dict[str, float] = field(default_factory=dict)
    tail_parts: dict[str, float] = field(default_factory=dict)
    gap_total: float = 0.0
    tail_total: float = 0.0
    frontend_total: float = 0.0
    max_err: float = 0.0
    #: per process whose absence left client-gap time unrecorded: (ms, gaps)
    lost: dict[tuple[str, int], tuple[float, int]] = field(default_factory=dict)
    #: the client TTFTs (`client_ttft_assembled`'s), folded as they come: a request's two
    #: TTFTs (client, engine; ms) for the percentiles, its parts summed by label (a day's
    #: ~3 M requests kept whole were ~200 bytes each)
    ttft: list[np.ndarray] = field(default_factory=list)
    ttft_engine: list[np.ndarray] = field(default_factory=list)
    ttft_parts: dict[str, float] = field(default_factory=dict)
    ttft_total: float = 0.0
    ttft_labels: set[str] = field(default_factory=set)  # the engine boundary's
    ttft_unrec: bool = False  # some TTFT with ``unrecorded:api_server`` time
    ttft_read: bool = False  # some slice owned TTFTs (none: no figures)


def _add(d: dict, key: Any, v: float) -> None:
    d[key] = d.get(key, 0.0) + v


def slice_log(task: ClientSliceTask) -> tuple[RawLog, PreparedRun, np.ndarray]:
    """The slice's log (with the run's meta and coverage), prepared with the whole run's
    baselines as `analyze` prepares the whole run, and each of its requests' number in the
    run: it holds only the requests its parts' rows name, numbered 0, 1, ... in the run's
    order (`SlicedRun.local_log_of`; the run's numbering held every request named so far,
    ~3 M columns a slice at a day's end)."""
    run = SlicedRun(task.parts_dir, max_inflate_mb=task.max_inflate_mb,
                    parts=(task.c, task.paths))  # fmt: skip
    local = run.local_log_of(task.c, task.d, retained=task.retained, final=True,
                             carried=task.carried)  # fmt: skip
    log = local.log
    if task.coverage is not None:
        cov = task.coverage
        cols = MERGED_TABLES["proc_coverage"]
        log = replace(log, coverage=Coverage.from_columns(
            **{n: cov[:, j] for j, n in enumerate(cols)}))  # fmt: skip
    prep = PreparedRun(log)
    prep.use_baseline(FIT_ALL_CAPTURED, task.base_ttft)
    prep.corrected().use_baseline(task.fit, task.base_itl)
    if task.fit != FIT_ALL_CAPTURED:  # the client gaps' engine part: design.md's fit
        prep.corrected().use_baseline(FIT_ALL_CAPTURED, task.base_client)
    return log, prep, local.numbers


def _steps(raw: np.ndarray, first: int) -> np.ndarray:
    """Steps as recorded, numbered as the slice's log numbers them (-1 stays)."""
    s = np.asarray(raw).astype(np.int64)
    return np.where(s >= 0, s - first, -1)


def slice_gaps(log: RawLog, rows: np.ndarray, first: int, numbers: np.ndarray) -> ClientGaps:
    """`client_gaps` of the slice's own gaps, from their rows (`GAP_COLUMNS`), their
    requests numbered as the slice's log numbers them (`numbers`: each one's in the run;
    a gap's request is named by its chunks' rows, in the slice's own parts)."""
    g = {c: rows[:, j] for c, j in _G.items()}
    a, b, e = g["a"], g["b"], g["e"]
    proc = g["process"].astype(np.int64)
    step1 = _steps(g["step1"], first)
    core_lo, core_hi = process_spans(log, np.full(len(a), core_process(log)))
    fe_lo, fe_hi = process_spans(log, proc)
    return ClientGaps(
        request=_local(numbers, g["request"].astype(np.int64)), a=a, b=b,
        x=np.where(np.isnan(e), a, np.clip(e, a, b)), e=e, recv=received_at(log, step1, proc),
        step0=_steps(g["step0"], first), step1=step1, dstep1=_steps(g["dstep1"], first),
        num_tokens=g["num_tokens"].astype(np.int64), process=proc, core_lo=core_lo,
        core_hi=core_hi, fe_lo=fe_lo, fe_hi=fe_hi,
    )  # fmt: skip


def _local(numbers: np.ndarray, req: np.ndarray) -> np.ndarray:
    """Requests numbered as the run numbers them, as a slice's log numbers them."""
    at = np.searchsorted(numbers, req)
    if len(req) and not (
        len(numbers) and np.array_equal(numbers[np.minimum(at, len(numbers) - 1)], req)
    ):
        raise NotSliceable("a client gap whose request its slice's parts do not name")
    return at


def run_client_slice(task: ClientSliceTask) -> ClientSums:
    """Partition one client slice's own gaps and TTFTs and add up what the figures need."""
    log, prep, numbers = slice_log(task)
    first = task.retained.first_step if task.retained is not None else 0
    s = ClientSums()
    if len(task.gaps):
        g = slice_gaps(log, task.gaps, first, numbers)
        _add_gaps(s, client_partition_of(log, g, run=prep), g.process, task.p99)
    if len(task.ttft_requests):
        tp = ttft_partition(log, run=prep)
        req = numbers[tp.request]  # as the run numbers them
        at = np.searchsorted(task.ttft_requests, req)
        at = np.minimum(at, len(task.ttft_requests) - 1)
        mine = task.ttft_requests[at] == req
        p = replace(tp.take(mine), request=req[mine])
        w, proc = task.ttft_w[at[mine]], task.ttft_proc[at[mine]]
        recv = received_at(log, _steps(task.ttft_step[at[mine]], first), proc)
        front, unrec = frontend_part(log, proc, p.first_token_s, w, p.first_token_s, recv)
        _add_ttfts(s, p, w, front, unrec)
    return s


def _add_ttfts(
    s: ClientSums, p: TtftPartition, w: np.ndarray, front: np.ndarray, unrec: np.ndarray
) -> None:
    """One slice's client TTFTs added to its sums: as `client_ttft_assembled` makes each
    (its engine parts, its frontend parts, ``unrecorded:api_server``) and
    `client_ttft_figures` adds them up by label."""
    s.ttft_read = True
    s.ttft.append((w - p.arrival_s) * 1e3)
    s.ttft_engine.append(np.asarray(p.ttft_ms, dtype=np.float64))
    s.ttft_total += float(s.ttft[-1].sum())
    s.ttft_labels |= set(p.labels)
    s.ttft_unrec |= bool((unrec > 0).any())
    for lb, v in zip(p.labels, p.parts_ms.sum(axis=0).tolist(), strict=True):
        _add(s.ttft_parts, lb, v)
    for lb, v in zip((*FRONTEND_LABELS, *FRONTEND_OS_LABELS), front.sum(axis=0).tolist(),
                     strict=True):  # fmt: skip
        _add(s.ttft_parts, lb, v)
    _add(s.ttft_parts, UNRECORDED_API, float(unrec.sum()))


def _add_gaps(s: ClientSums, cp: ClientPartition, process: np.ndarray, p99: float) -> None:
    """One slice's client partition added to its sums (`client_summary`'s)."""
    s.labels |= set(cp.labels)
    s.gap_total += float(cp.gap_ms.sum())
    s.frontend_total += float(cp.frontend_ms().sum())
    s.max_err = max(s.max_err, float(cp.reconcile_err_ms.max()))
    tail = cp.gap_ms >= p99
    s.tail_total += float(cp.gap_ms[tail].sum())
    for j, lb in enumerate(cp.labels):
        _add(s.all_parts, lb, float(cp.parts_ms[:, j].sum()))
        _add(s.tail_parts, lb, float(cp.parts_ms[tail, j].sum()))
    if UNRECORDED_CORE in cp.labels:
        v = cp.column(UNRECORDED_CORE)
        _lose(s, (UNRECORDED_CORE, -1), v)
    if UNRECORDED_API in cp.labels:
        v = cp.column(UNRECORDED_API)
        for k in np.unique(process).tolist():
            _lose(s, (UNRECORDED_API, int(k)), np.where(process == k, v, 0.0))


def _lose(s: ClientSums, key: tuple[str, int], v: np.ndarray) -> None:
    ms, n = s.lost.get(key, (0.0, 0))
    s.lost[key] = (ms + float(v.sum()), n + int((v > 0).sum()))


def _fold(s: ClientSums, part: ClientSums) -> None:
    """Add one slice's sums to the run's, in slice order."""
    s.labels |= part.labels
    for d in ("all_parts", "tail_parts"):
        for k, v in getattr(part, d).items():
            _add(getattr(s, d), k, v)
    s.gap_total += part.gap_total
    s.tail_total += part.tail_total
    s.frontend_total += part.frontend_total
    s.max_err = max(s.max_err, part.max_err)
    for k, (ms, n) in part.lost.items():
        old = s.lost.get(k, (0.0, 0))
        s.lost[k] = (old[0] + ms, old[1] + n)
    s.ttft += part.ttft
    s.ttft_engine += part.ttft_engine
    for k, v in part.ttft_parts.items():
        _add(s.ttft_parts, k, v)
    s.ttft_total += part.ttft_total
    s.ttft_labels |= part.ttft_labels
    s.ttft_unrec |= part.ttft_unrec
    s.ttft_read |= part.ttft_read


def analyze_sliced_client(
    parts_dir: str,
    *,
    baseline_fit: str = FIT_ALL_CAPTURED,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    max_inflate_mb: float | None = None,
    progress: Callable[[str], None] | None = None,
    path: str | None = None,
    mapper: Callable[[Callable[[Any], Any], list[Any]], Iterable[Any]] | None = None,
    indexer: Callable[..., Index] | None = None,
) -> RunAnalysis:
    """`tracekit.analysis.stream.analyze_sliced` (the same arguments), and of a merged
    server run its client boundary, read in slices too (the module docstring): the figures
    of `tracekit.analysis.figures.analyze` of the whole run, `client` included. The client
    slices run in this process, one after the other."""
    held: dict[str, Any] = {}

    def keep_index(run: SlicedRun, fit: str, say: Callable[[str], None], **kw: Any) -> Index:
        ix = (indexer or index_pass)(run, fit, say, **kw)
        held["run"], held["ix"] = run, ix
        return ix

    a = analyze_sliced(parts_dir, baseline_fit=baseline_fit, max_emissions=max_emissions,
                       max_inflate_mb=max_inflate_mb, progress=progress, path=path,
                       mapper=mapper, indexer=keep_index)  # fmt: skip
    run: SlicedRun = held["run"]
    if not isinstance(run.final, dict) or "processes" not in run.final:
        return a  # not a server's run: no client boundary
    client, lines = client_sliced(run, held["ix"], a, max_emissions, progress)
    return replace(a, client=client, warnings=[*a.warnings, *lines])


def client_sliced(
    run: SlicedRun,
    ix: Index,
    a: RunAnalysis,
    max_emissions: int,
    progress: Callable[[str], None] | None = None,
) -> tuple[ClientSummary | None, list[str]]:
    """A merged server run's client figures read in slices (after its engine analysis `a`,
    whose index pass `ix` was), and the lines of its unrecorded processes' entries."""
    say = progress or (lambda _msg: None)
    cx = client_index_pass(run)
    with cx.spill:
        offsets = np.concatenate([[0], np.cumsum(cx.num_gaps)]).astype(np.int64)
        _keep_gap_values(cx, int(offsets[-1]))
        p99 = cx.per_chunk.percentiles()[2] if cx.per_chunk.n else math.inf
        s = ClientSums()
        tasks = _tasks(run, ix, cx, max_emissions, p99, offsets)
        for j, (task, n) in enumerate(tasks):
            _fold(s, run_client_slice(task))
            give_back_freed_memory()  # the slice's, kept by the analysis's allocator
            say(f"client slice {j + 1} of {n}")
    entries = _unrecorded(run, cx, s, int(offsets[-1]) > 0)
    if not cx.chunks:
        return None, [u["line"] for u in entries]
    return _summary(cx, s, a, int(offsets[-1]), p99, entries), [u["line"] for u in entries]


_SPILL_ROWS = 1 << 18  # gap rows read back at once (18 MiB)


def _spilled(cx: ClientIndex, lo: int, hi: int) -> np.ndarray:
    """Gap rows ``[lo, hi)`` of the temporary file."""
    width = len(GAP_COLUMNS)
    cx.spill.seek(lo * width * 8)
    rows = np.fromfile(cx.spill, dtype=np.float64, count=(hi - lo) * width)
    return rows.reshape(-1, width)


def _keep_gap_values(cx: ClientIndex, n: int) -> None:
    """Pass 2 of the client gaps' exact percentiles: their lengths read back."""
    cx.per_chunk.wanted()
    cx.per_token.wanted()
    for lo in range(0, n, _SPILL_ROWS):
        g = _spilled(cx, lo, min(n, lo + _SPILL_ROWS))
        gap_ms = (g[:, _G["b"]] - g[:, _G["a"]]) * 1e3
        tok = np.maximum(g[:, _G["num_tokens"]], 1)
        cx.per_chunk.keep(gap_ms)
        cx.per_token.keep_weighted(gap_ms / tok, tok)


def _cut(base: GraphBaseline, a: int, b: int) -> GraphBaseline:
    return replace(base, eager_excess_frac=base.eager_excess_frac[a:b],
                   decode_net_ms=base.decode_net_ms[a:b])  # fmt: skip


def _tasks(
    run: SlicedRun, ix: Index, cx: ClientIndex, max_emissions: int, p99: float,
    offsets: np.ndarray,
) -> Iterable[tuple[ClientSliceTask, int]]:  # fmt: skip
    """The client slices as tasks, each made when it is run (its gap rows read then)."""
    base_itl, base_ttft = whole_baselines(run, ix)
    base_client = base_itl
    if ix.fit != FIT_ALL_CAPTURED:
        base_client = fit_baseline_steps(ix.steps("graph_size"), ix.steps("num_decode"),
                                         ix.steps("decode_net_itl"), FIT_ALL_CAPTURED)  # fmt: skip
    step0 = run.parts[0].first_step
    bounds = client_bounds(run, cx, max_emissions)
    rq = cx.req
    for c, a, b, d in bounds:
        s0 = run.parts[c].first_step - step0
        s1 = run.parts[d - 1].first_step - step0 + run.parts[d - 1].num_steps
        own = owned_ttfts(cx, a, b)
        yield ClientSliceTask(
            run.parts_dir, run.max_inflate_mb, c, d, run.retained(c), cx.coverage,
            _cut(base_itl, s0, s1), _cut(base_ttft, s0, s1), _cut(base_client, s0, s1),
            ix.fit, _spilled(cx, int(offsets[a]), int(offsets[b])), own,
            rq["first_w"][own], rq["first_proc"][own], rq["fe_step"][own], p99,
            tuple(run.paths[c:d]), run.carried_into(c, d),
        ), len(bounds)  # fmt: skip


def _unrecorded(
    run: SlicedRun, cx: ClientIndex, s: ClientSums, has_gaps: bool
) -> list[dict[str, Any]]:
    """`unrecorded_report`'s entries from the slices' sums."""
    n = len(run.parts)
    log = run.log_of(n - 1, n, tables=frozenset(), final=True)
    if cx.coverage is not None:
        cols = MERGED_TABLES["proc_coverage"]
        log = replace(log, coverage=Coverage.from_columns(
            **{k: cx.coverage[:, j] for j, k in enumerate(cols)}))  # fmt: skip
    core = core_process(log)

    def lost(k: int, role: str) -> tuple[float, int]:
        if k == core and UNRECORDED_CORE in s.labels:
            return s.lost.get((UNRECORDED_CORE, -1), (0.0, 0))
        if role == FRONTEND and UNRECORDED_API in s.labels:
            return s.lost.get((UNRECORDED_API, k), (0.0, 0))
        return 0.0, 0

    ticks = np.concatenate(cx.added_s) if cx.added_s else np.zeros(0)
    added_s = (ticks - run.t0_tick) * run.seconds_per_tick  # as the counters are read
    return unrecorded_entries(log, lost, has_gaps, lambda t: int((added_s < t).sum()))


def _weighted(q: ExactQuantiles, total: float) -> dict[str, Any]:
    """`tracekit.attribution.client`'s per-token percentiles (its own arithmetic) from
    weighted exact quantiles."""
    if not q.n:
        return {f"p{p}": math.nan for p in PCTS} | {"mean": math.nan, "n": 0}
    n = float(q.n)
    out = {}
    for p in PCTS:
        h = p / 100.0 * (n - 1)
        lo = float(np.floor(h))
        a, b = q.values_at(np.array([int(lo), int(min(lo + 1, n - 1))]))
        out[f"p{p}"] = float(a + (h - lo) * (b - a))
    return out | {"mean": total / n, "n": int(n)}


def _pct(v: np.ndarray, q: float) -> float:
    """`client_ttft_figures`' percentile: numpy's linear, NaN of none."""
    return float(np.percentile(v, q)) if len(v) else math.nan


def _summary(
    cx: ClientIndex, s: ClientSums, a: RunAnalysis, n_gaps: int, p99: float,
    entries: list[dict[str, Any]],
) -> ClientSummary:  # fmt: skip
    """`tracekit.analysis.results.client_result` from the slices' sums."""
    engine = set(s.labels) - set(FRONTEND_LABELS) - set(FRONTEND_OS_LABELS)
    engine -= set(UNRECORDED_LABELS)
    engine = engine if n_gaps else set(a.labels)  # no gap partitioned: the run's labels
    labels = (
        *partition_labels(engine), *FRONTEND_LABELS,
        *(FRONTEND_OS_LABELS if cx.has_proc_os else ()),
        *(lb for lb in UNRECORDED_LABELS if lb in s.labels),
    )  # fmt: skip
    total = s.gap_total
    pc = cx.per_chunk.percentiles()
    nan = math.nan
    itl = {
        "per_chunk": {"p50": pc[0], "p90": pc[1], "p99": pc[2],
                      "mean": total / n_gaps if n_gaps else nan, "n": n_gaps},
        "per_token": _weighted(cx.per_token, cx.per_token_sum),
        "per_engine_step": {"p50": a.itl_p50, "p90": a.itl_p90, "p99": a.itl_p99,
                            "mean": cx.engine_sum / a.gaps if a.gaps else nan, "n": a.gaps},
        "tokens_per_chunk_mean": cx.tokens_sum / n_gaps if n_gaps else nan,
    }  # fmt: skip
    tail: dict[str, Any] = {}
    if n_gaps:
        tt = s.tail_total
        tail = {
            "p99_ms": p99,
            "tail_share": {lb: s.tail_parts.get(lb, 0.0) / tt if tt > 0 else 0.0
                           for lb in labels},
            "frontend_share": s.frontend_total / total if total > 0 else 0.0,
            "reconcile_max_err_ms": s.max_err,
        }  # fmt: skip
    ttft: dict[str, Any] = {}
    if s.ttft_read:  # `client_ttft_figures` of the run's client TTFTs
        t, e = np.concatenate(s.ttft), np.concatenate(s.ttft_engine)
        engine_labels = ordered(s.ttft_labels, TTFT_LABEL_GROUPS)
        tl = client_ttft_labels(engine_labels, cx.has_proc_os, s.ttft_unrec)
        tt = s.ttft_total
        ttft = {"ttft_p50_ms": _pct(t, 50), "ttft_p99_ms": _pct(t, 99),
                "ttft_engine_p50_ms": _pct(e, 50), "ttft_engine_p99_ms": _pct(e, 99),
                "ttft_share": {lb: s.ttft_parts.get(lb, 0.0) / tt if tt > 0 else 0.0
                               for lb in tl}}  # fmt: skip
    return ClientSummary(
        num_gaps=n_gaps,
        num_chunks=cx.chunks,
        itl_ms=ItlConventions.of(itl),
        all_share={lb: s.all_parts.get(lb, 0.0) / total if total > 0 else 0.0 for lb in labels},
        spec=a.spec,
        unrecorded=tuple(entries),
        **tail,
        **ttft,
    )
