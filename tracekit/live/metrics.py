"""Live mode: every gap partitioned while the engine serves, as Prometheus metrics and
OpenTelemetry spans (the `live` extra: prometheus-client, opentelemetry-sdk).

    from tracekit.live import LiveMetrics, attach
    live = LiveMetrics(port=9400, slo_ms=200)      # metrics on :9400/metrics
    rec = tracekit.Recorder("raw/run.npz")
    attach(rec, live)                              # open at start, every flush, close at stop

`LiveMetrics` is a recorder sink: ``open(meta)`` at start, ``write(chunk)`` once per flush
(the rows the recorder flushed, a `tracekit.log.flush.FlushedRows`), ``close(final)`` at
stop. ``write`` only queues the chunk; one background thread partitions and exports, so
the engine never waits on it, nor on a scraper (the HTTP server has threads of its own).

**Which gaps are settled when.** A chunk holds the rows completed before the flush, but a
window still open then (a tokenizer call on another thread, a GC pause, a device window
resolved later) can start before the flush and overlap a gap that has already closed. So
a gap is *settled* (partitioned and exported) only once its closing emission is older than
the latest flush by `hold_s`: a window that was open for less than `hold_s` has arrived by
then. A window open longer than that arrives *late*: it is counted in
``tracekit_live_late_rows_total`` (and logged once), and the gaps it overlapped were
exported without it. Each settlement runs `tracekit.attribution.itl.partition` on a bounded
window of rows: the settled gaps' first emissions (one carried row per request) to the
watermark, and the rows overlapping that span, nothing older.

**What agrees with the offline analysis of the same run's raw log.** With no late rows
and no truncated gaps (both exported), after `close`: ``tracekit_gaps_total`` is the
log's gap count, ``tracekit_gap_seconds`` has the report's histogram counts (bins
``[lo, hi)``), and ``tracekit_gap_cause_seconds_total{cause}`` is the sum of that label
over all gaps, every label *including* ``graph`` and ``forward``, to float rounding. The
graph baseline (design.md rule 4) is fitted over the whole run's captured steps, so
``graph``/``forward`` cannot be known exactly while the run goes on; but a gap's graph
part is linear in the eager steps' excess fractions: ``graph = sum_s frac_s * w_s``, where
``w_s`` is the decode time of eager step ``s`` the gap owns (what `partition` charges with
``frac = 1``). The sink keeps ``w_s`` per eager step and each step's GC-free decode time,
and exports ``graph = sum_s frac_s(fit so far) * w_s``, ``forward = decode time - graph``:
their sum is exact at every scrape; while the run goes, each settled gap adds its graph
under the line fitted so far (`_RunningLine`) and every `refit_s` the whole sum is
re-evaluated under it; at `close` it is evaluated once with `fit_baseline` over every step
of the run (the offline fit itself), hence exact. Until then either may move down as well
as up (Prometheus reads that as a counter reset). Per-gap figures that
must be final when the gap is exported (its primary cause for
``tracekit_tail_gaps_total``, the span's ``graph``/``forward`` parts) use the fit so far;
their sum, and every other part, is exact.

**Sliding window.** ``tracekit_tail_gaps_total{primary_cause}`` and
``tracekit_tail_gap_cause_seconds_total{cause}`` count the gaps at or above the p99 of the
last `tail_window` settled gaps (the batch being settled included), by primary cause and by
label. Live figures: the offline report's tail is over the whole run's p99.

TTFT: ``tracekit_ttft_seconds`` (histogram of first token - arrival per request) and the
p50/p99 of the last `tail_window` TTFTs as gauges. The TTFT partition by cause plugs in
through `ttft_partitioner` (see there).

Memory: the retained rows span the oldest in-flight request's last emission (a request is
in flight until it has emitted its ``max_new_tokens``, or for `max_retain_s` after its last
emission when that is unknown); per step, three numbers for the graph fit and one weight.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from tracekit.analysis.figures import HIST_EDGES_MS
from tracekit.attribution.itl import CLEAN, fit_baseline, partition, primary_of
from tracekit.labels import DEFAULT_CAUSE_MAP, STANDARD_LABELS, cause_of
from tracekit.log.flush import (
    EVICT,
    TABLES,
    UNKNOWN_TICK,
    FlushedRows,
    column_index,
    pair_evictions,
    to_table,
)
from tracekit.log.rawlog import (
    GRAPH_EAGER,
    Counters,
    Emissions,
    GcPauses,
    OsSamples,
    RawLog,
    Requests,
    Segments,
    Steps,
)

log = logging.getLogger("tracekit.live")

#: TTFT histogram buckets, seconds (upper bounds; +Inf added).
TTFT_BUCKETS_S: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# column positions in the retained rows (the flush's layout, by name)
_ST = {c: i for i, c in enumerate(TABLES["steps"])}
_SG = {c: i for i, c in enumerate(TABLES["segments"])}
_GC = {c: i for i, c in enumerate(TABLES["gc_pauses"])}
_EM = {c: i for i, c in enumerate(TABLES["emissions"])}
_RQ = {c: i for i, c in enumerate(TABLES["requests"])}
_OS = {c: i for i, c in enumerate(TABLES["os_samples"])}
_NO_TICK = np.iinfo(np.int64).max
#: A span lists at most this many of the steps its gap overlaps (the first and last halves).
MAX_SPAN_STEPS = 64


def _missing_extra(e: ImportError) -> ImportError:
    return ImportError(
        f"tracekit.live needs the `live` extra ({e.name} is missing): pip install 'tracekit[live]'"
    )


class _Grow:
    """A numpy array indexed by a growing integer id (steps, requests), filled with `fill`."""

    def __init__(self, dtype: Any, fill: Any) -> None:
        self.a = np.full(64, fill, dtype=dtype)
        self.fill = fill

    def ensure(self, n: int) -> np.ndarray:
        if n > len(self.a):
            b = np.full(max(n, 2 * len(self.a)), self.fill, dtype=self.a.dtype)
            b[: len(self.a)] = self.a
            self.a = b
        return self.a


class _Ring:
    """The last `n` values (a sliding window), as one preallocated array."""

    def __init__(self, n: int) -> None:
        self.buf = np.zeros(max(1, n))
        self.count = 0

    def extend(self, v: np.ndarray) -> None:
        n = len(self.buf)
        v = v[-n:]
        i = self.count % n
        k = min(len(v), n - i)
        self.buf[i : i + k] = v[:k]
        self.buf[: len(v) - k] = v[k:]
        self.count += len(v)

    def values(self) -> np.ndarray:
        return self.buf[: min(self.count, len(self.buf))]


class _RunningLine:
    """The graph baseline's line (design.md rule 4) fitted as steps settle: least squares
    of GC-free decode ms against the padded batch size over the captured steps with decode
    time, from centred sums merged batch by batch (Chan et al.), so a long run costs O(1)
    per step. A running estimate only: the exact totals use `fit_baseline` at close."""

    def __init__(self) -> None:
        self.n = 0
        self.mx = self.my = self.m2x = self.cxy = 0.0
        self.sizes: set[int] = set()

    def add(self, graph_size: np.ndarray, net_ms: np.ndarray) -> None:
        sel = (graph_size > 0) & (net_ms > 0)
        if not sel.any():
            return
        x, y = graph_size[sel].astype(np.float64), net_ms[sel]
        nb, mxb, myb = len(x), float(x.mean()), float(y.mean())
        m2b = float(((x - mxb) ** 2).sum())
        cb = float(((x - mxb) * (y - myb)).sum())
        n = self.n + nb
        dx, dy = mxb - self.mx, myb - self.my
        self.m2x += m2b + dx * dx * self.n * nb / n
        self.cxy += cb + dx * dy * self.n * nb / n
        self.mx += dx * nb / n
        self.my += dy * nb / n
        self.n = n
        self.sizes.update(np.unique(graph_size[sel]).tolist())

    def excess_frac(self, graph_size: np.ndarray, num_decode: np.ndarray, net_ms: np.ndarray):
        """Each eager step's fraction of decode time over the line (0 for the others)."""
        frac = np.zeros(len(net_ms))
        if self.n == 0:
            return frac
        slope = self.cxy / self.m2x if len(self.sizes) >= 2 else 0.0
        icpt = self.my - slope * self.mx
        eager = (graph_size == GRAPH_EAGER) & (net_ms > 0)
        net = net_ms[eager]
        frac[eager] = np.minimum(
            1.0, np.maximum(0.0, net - (slope * num_decode[eager] + icpt)) / net
        )
        return frac


class LiveMetrics:
    """A recorder sink that partitions every gap as the run goes and exports it.

    port: serve ``/metrics`` on this port (0: any free one, see `port` after `open`);
        None: no server (`registry` can still be read, e.g. by the caller's own server).
    addr: the address the metrics server binds.
    slo_ms: every settled gap at least this long becomes an OpenTelemetry span (request
        id, gap, parts, the engine steps it spans), through `tracer_provider` (default:
        the global one, with whatever exporter the application configured).
    hold_s: how long after a flush a gap waits to be settled: a window open for longer is
        late (counted, see the module docstring).
    tail_window: how many recent gaps (and TTFTs) the sliding p99 is taken over.
    max_retain_s: a request with no known ``max_new_tokens`` stops pinning the retained
        rows this long after its last emission; a later gap of it is counted truncated.
    refit_s: how often (engine clock) the running graph total is re-evaluated over every
        eager step under the line fitted so far (between, new gaps add their estimates).
    ttft_partitioner: ``f(window: RawLog, requests: np.ndarray) -> (labels, parts_ms)``,
        the TTFT partition by cause (``tracekit.attribution.ttft``) of the given requests (indices)
        over a window holding every row from their arrival on (its requests table has each
        request's arrival and first token; its emissions table is empty); exported as
        ``tracekit_ttft_cause_seconds_total{cause}``. None: not exported.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        addr: str = "127.0.0.1",
        slo_ms: float | None = None,
        tracer_provider: Any = None,
        hold_s: float = 2.0,
        tail_window: int = 10_000,
        max_retain_s: float = 300.0,
        ttft_partitioner: Callable[[RawLog, np.ndarray], tuple[tuple[str, ...], np.ndarray]]
        | None = None,
        close_timeout_s: float = 60.0,
        refit_s: float = 10.0,
    ) -> None:
        try:
            from prometheus_client import CollectorRegistry
        except ImportError as e:
            raise _missing_extra(e) from None
        self._tracer: Any = None
        if slo_ms is not None:
            try:
                from opentelemetry import trace
            except ImportError as e:
                raise _missing_extra(e) from None
            provider = tracer_provider or trace.get_tracer_provider()
            self._tracer = provider.get_tracer("tracekit.live")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self.slo_ms = slo_ms
        self.port = port
        self._addr = addr
        self._hold_s = hold_s
        self._tail = _Ring(tail_window)
        self._ttft_ring = _Ring(tail_window)
        self._max_retain_s = max_retain_s
        self._ttft_partitioner = ttft_partitioner
        self._close_timeout_s = close_timeout_s
        self._refit_s = refit_s
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._lock = threading.Lock()  # guards what the collector reads
        self._opened = False
        self._closed = False
        # the run's clock and vocabularies
        self._t0_tick = 0
        self._spt = 1e-9
        self._unix0 = 0.0
        self._cause_map: dict[str, str] = dict(DEFAULT_CAUSE_MAP)
        self._labels: list[str] = []
        self._req_ids: list[str] = []
        # retained rows (ticks), see _prune
        cols = {k: len(c) for k, c in TABLES.items()}
        self._segs = np.zeros((0, cols["segments"]), dtype=np.int64)
        self._gcs = np.zeros((0, cols["gc_pauses"]), dtype=np.int64)
        self._events = np.zeros((0, cols["events"]), dtype=np.int64)
        self._os_rows = np.zeros((0, cols["os_samples"]), dtype=np.int64)  # OS evidence
        self._pending = np.zeros((0, cols["emissions"]), dtype=np.int64)  # unsettled emissions
        self._steps = np.zeros((0, cols["steps"]), dtype=np.int64)
        self._step_base = 0  # global index of self._steps[0]
        self._settled_to_tick = -_NO_TICK  # gaps closing at or before this tick are settled
        self._horizon_tick = -_NO_TICK  # rows ending before this tick were dropped
        # per request (by index)
        # each request's last settled emission (carried into the next window): tick, step,
        # token count, device step
        self._carry = _Grow(np.int64, UNKNOWN_TICK)
        self._carry_step = _Grow(np.int64, -1)
        self._carry_nt = _Grow(np.int64, 0)
        self._carry_dstep = _Grow(np.int64, -1)
        self._tokens = _Grow(np.int64, 0)
        self._max_new = _Grow(np.int64, -1)
        self._prompt = _Grow(np.int64, -1)
        self._arrival = _Grow(np.int64, UNKNOWN_TICK)
        self._first = _Grow(np.int64, _NO_TICK)
        # requests whose arrival is known and TTFT not yet exported; requests with a carried
        # emission not known to be finished (they pin the retained rows)
        self._ttft_open = np.zeros(0, dtype=np.int64)
        self._inflight = np.zeros(0, dtype=np.int64)
        # per step (global index): the graph fit's inputs, and each eager step's weight w_s
        self._st_graph = _Grow(np.int64, -1)
        self._st_ndec = _Grow(np.int64, 0)
        self._st_net = _Grow(np.float64, 0.0)
        self._w = _Grow(np.float64, 0.0)
        self._num_settled_steps = 0
        self._line = _RunningLine()
        self._eager_idx = _Grow(np.int64, 0)  # settled eager steps, in order
        self._num_eager = 0
        self._refit_ticks = 0
        self._last_refit_tick = -_NO_TICK
        # exported state (read by the collector under _lock)
        self._gaps = 0
        self._gap_sum_s = 0.0
        self._hist = np.zeros(len(HIST_EDGES_MS) - 1, dtype=np.int64)
        self._cause_ms: dict[str, float] = dict.fromkeys(STANDARD_LABELS, 0.0)
        self._decode_ms = 0.0  # graph + forward over all settled gaps (baseline-free)
        self._graph_ms = 0.0  # sum_s frac_s * w_s with the fit so far
        self._fit_steps = 0
        self._tail_count: dict[str, int] = {}
        self._tail_ms: dict[str, float] = dict.fromkeys(STANDARD_LABELS, 0.0)
        self._itl_p99_ms = math.nan
        self._ttft_n = 0
        self._ttft_sum_s = 0.0
        self._ttft_hist = np.zeros(len(TTFT_BUCKETS_S) + 1, dtype=np.int64)
        self._ttft_p50_ms = math.nan
        self._ttft_p99_ms = math.nan
        self._ttft_cause_ms: dict[str, float] = {}
        self._late_rows = 0
        self._truncated = 0
        self._errors = 0
        self._spans = 0
        self._written = 0  # chunks queued (only `write` counts up)
        self._consumed = 0  # chunks partitioned (only the worker counts up)
        self._cpu_s = 0.0  # CPU time of the worker thread (partitioning and exporting)
        self._is_final = False

    # -- the sink protocol -------------------------------------------------------------
    def open(self, meta: Mapping[str, Any]) -> None:
        """At the recorder's start: the run's clock, cause map; starts the worker (and the
        metrics server, if a port was given)."""
        if self._opened:
            raise RuntimeError("a LiveMetrics sink follows one run; make a new one per run")
        self._opened = True
        self._t0_tick = int(meta["t0_tick"])
        self._spt = float(meta.get("seconds_per_tick", 1e-9))
        self._unix0 = float(meta.get("started_unix_s", 0.0))
        self._cause_map = {**DEFAULT_CAUSE_MAP, **dict(meta.get("cause_map") or {})}
        self._hold_ticks = int(self._hold_s / self._spt)
        self._retain_ticks = int(self._max_retain_s / self._spt)
        self._refit_ticks = int(self._refit_s / self._spt)
        self._thread = threading.Thread(target=self._run, name="tracekit-live", daemon=True)
        self._thread.start()
        if self.port is not None and self._server is None:
            self.serve(self.port)

    def write(self, chunk: Mapping[str, np.ndarray]) -> None:
        """One flushed chunk: queued for the worker (never blocks, never raises)."""
        if self._thread is None:  # not opened (or opening failed): nothing would consume it
            return
        self._written += 1
        self._q.put(chunk)

    def close(self, final: Mapping[str, Any] | None = None) -> None:
        """At the recorder's stop: settle every remaining gap with the whole run's graph
        fit (waits for the worker, at most `close_timeout_s`). The server keeps serving
        until `shutdown`."""
        if not self._opened or self._closed:
            return
        self._closed = True
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(self._close_timeout_s)
            if self._thread.is_alive():
                log.warning(
                    "tracekit live: still partitioning %d chunk(s) after %.0f s at close; "
                    "the metrics settle when it is done",
                    self._written - self._consumed,
                    self._close_timeout_s,
                )

    def serve(self, port: int = 0) -> int:
        """Serve ``/metrics`` from this sink's registry (its own threads); returns the port."""
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(port, addr=self._addr, registry=self.registry)
        self.port = int(self._server.server_port)
        return self.port

    def shutdown(self) -> None:
        """Stop the metrics server (if any)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def is_final(self) -> bool:
        """True once `close` has settled every gap (graph/forward use the whole run's fit)."""
        return self._is_final

    # -- the worker ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            chunk = self._q.get()
            cpu0 = time.thread_time()
            try:
                if chunk is None:
                    self._settle(final=True)
                    return
                self._ingest(chunk)
                self._settle(final="stop_tick" in chunk)
            except Exception as e:  # recording goes on; said once, then counted
                with self._lock:
                    self._errors += 1
                if self._errors == 1:
                    log.error(
                        "tracekit live: exporting failed (%s: %s); recording goes on, later "
                        "failures are only counted in tracekit_live_errors_total",
                        type(e).__name__,
                        e,
                        exc_info=True,
                    )
                if chunk is None:
                    return
            finally:
                self._cpu_s += time.thread_time() - cpu0
                if chunk is not None:
                    self._consumed += 1

    def _ingest(self, chunk: Mapping[str, np.ndarray]) -> None:
        flushed = FlushedRows.of(chunk)
        rows = {k: flushed.table(k) for k in TABLES if k in flushed and k != "counters"}
        if "t0_tick" in flushed and not self._t0_tick:
            self._t0_tick = int(flushed["t0_tick"])
        self._labels = flushed.strings("labels") if "labels" in flushed else self._labels
        start = int(flushed.scalar("request_ids_start", len(self._req_ids)) or 0)
        new_ids = flushed.strings("request_ids")
        self._req_ids[start : start + len(new_ids)] = new_ids
        n_req = len(self._req_ids)

        # a row that starts before what is settled was open longer than hold_s: late
        late = 0
        for k, start_col in (("segments", "t0_tick"), ("gc_pauses", "t0_tick"),
                             ("emissions", "t_tick"), ("events", "t_tick")):  # fmt: skip
            if k in rows and len(rows[k]):
                col = column_index(k, start_col)
                late += int((rows[k][:, col] < self._settled_to_tick).sum())
        st = rows.get("steps")
        if st is not None and len(st):
            late += int((st[:, _ST["t0_tick"]] < self._settled_to_tick).sum())
            self._steps = np.concatenate([self._steps, st])
        if late:
            with self._lock:
                self._late_rows += late
            if self._late_rows == late:
                log.warning(
                    "tracekit live: %d row(s) arrived after the gaps they overlap were "
                    "exported (a window open longer than hold_s=%.1f s); those gaps' live "
                    "parts miss them: raise hold_s",
                    late,
                    self._hold_s,
                )
        for k, attr in (("segments", "_segs"), ("gc_pauses", "_gcs"), ("events", "_events"),
                        ("os_samples", "_os_rows")):  # fmt: skip
            if k in rows and len(rows[k]):
                setattr(self, attr, np.concatenate([getattr(self, attr), rows[k]]))
        rq = rows.get("requests")
        if rq is not None and len(rq):
            arr = self._arrival.ensure(n_req)
            req, arrival = rq[:, _RQ["request"]], rq[:, _RQ["arrival_tick"]]
            known = arrival != UNKNOWN_TICK
            fresh = req[known][arr[req[known]] == UNKNOWN_TICK]
            arr[req[known]] = arrival[known]
            self._ttft_open = np.union1d(self._ttft_open, fresh)
            self._max_new.ensure(n_req)[req] = rq[:, _RQ["max_new_tokens"]]
            self._prompt.ensure(n_req)[req] = rq[:, _RQ["prompt_tokens"]]
        em = rows.get("emissions")
        if em is not None and len(em):
            self._pending = np.concatenate([self._pending, em])
            req = em[:, _EM["request"]]
            np.add.at(self._tokens.ensure(n_req), req, em[:, _EM["num_tokens"]])
            np.minimum.at(self._first.ensure(n_req), req, em[:, _EM["t_tick"]])
        self._flush_tick = int(flushed.scalar("flush_tick", self._settled_to_tick) or 0)

    def _secs(self, ticks: np.ndarray) -> np.ndarray:
        """Engine-clock seconds, computed exactly as the raw log's merge does."""
        return (ticks - self._t0_tick).astype(np.float64) * self._spt

    # -- TTFT -------------------------------------------------------------------------------
    def _export_ttft(self, w_tick: int) -> None:
        """The requests whose first token came by w_tick (and whose arrival is known): held
        like the gaps, so a TTFT partition sees every window of their wait."""
        n_req = len(self._req_ids)
        first = self._first.ensure(n_req)
        arr = self._arrival.ensure(n_req)
        o = self._ttft_open
        came = (first[o] != _NO_TICK) & (first[o] <= w_tick)
        new = o[came]
        if not len(new):
            return
        self._ttft_open = o[~came]
        # first token - arrival, ms: the offline figure's arithmetic (seconds, then subtract)
        ttft_ms = (self._secs(first[new]) - self._secs(arr[new])) * 1e3
        self._ttft_ring.extend(ttft_ms)
        window = self._ttft_ring.values()
        which = np.searchsorted(np.array(TTFT_BUCKETS_S) * 1e3, ttft_ms, side="left")
        parts = None
        if self._ttft_partitioner is not None:
            lo = int(arr[new].min())  # every row from the earliest of their arrivals on
            win = self._window(self._pending[:0], lo=lo, with_requests=True)[0]
            parts = self._ttft_partitioner(win, new)
        with self._lock:
            self._ttft_n += len(new)
            self._ttft_sum_s += float(ttft_ms.sum()) / 1e3
            np.add.at(self._ttft_hist, which, 1)
            self._ttft_p50_ms = float(np.percentile(window, 50))
            self._ttft_p99_ms = float(np.percentile(window, 99))
            if parts is not None:
                labels, ms = parts
                for lb, v in zip(labels, np.asarray(ms).sum(axis=0).tolist(), strict=True):
                    self._ttft_cause_ms[lb] = self._ttft_cause_ms.get(lb, 0.0) + v

    # -- settling gaps ------------------------------------------------------------------------
    def _settle(self, *, final: bool) -> None:
        w_tick = _NO_TICK if final else self._flush_tick - self._hold_ticks
        if w_tick <= self._settled_to_tick:
            return
        pend = self._pending
        take = pend[:, _EM["t_tick"]] <= w_tick
        new_em = pend[take]
        self._pending = pend[~take]
        steps_done = self._steps_to_settle(w_tick)
        if len(new_em) or steps_done:
            self._settle_window(new_em, w_tick, final)
        self._export_ttft(w_tick)
        self._settled_to_tick = w_tick
        if final:
            graph_ms = self._graph_exact()
            with self._lock:
                self._graph_ms = graph_ms
                self._is_final = True
        else:
            self._prune(w_tick)

    def _steps_to_settle(self, w_tick: int) -> int:
        """How many retained steps, from the first unsettled one, ended by w_tick."""
        i = self._num_settled_steps - self._step_base
        ends = self._steps[i:, _ST["t1_tick"]]
        return int(np.searchsorted(np.cumsum(ends > w_tick), 0, side="right")) if len(ends) else 0

    def _window(
        self, new_em: np.ndarray, *, lo: int | None = None, with_requests: bool = False
    ) -> tuple[RawLog, int, np.ndarray]:
        """The rows that settling `new_em` needs, as a RawLog (steps re-based to `step_lo`),
        and the window's emissions (the involved requests' carried rows, then `new_em`)."""
        req = np.unique(new_em[:, _EM["request"]])
        n = len(self._req_ids)
        c_t = self._carry.ensure(n)[req]
        carried = np.column_stack(
            [
                req,
                c_t,
                self._carry_step.ensure(n)[req],
                self._carry_nt.ensure(n)[req],
                self._carry_dstep.ensure(n)[req],
            ]
        )[c_t != UNKNOWN_TICK]
        em = np.concatenate([carried, new_em]) if len(carried) else new_em
        lo_t = [int(em[:, _EM["t_tick"]].min())] if len(em) else []
        first_unsettled = self._num_settled_steps - self._step_base
        if first_unsettled < len(self._steps):
            lo_t.append(int(self._steps[first_unsettled, _ST["t0_tick"]]))
        if lo is None:
            lo = min(lo_t) if lo_t else self._settled_to_tick
        if len(em):
            carried_t = carried[:, _EM["t_tick"]]
            truncated = int((carried_t < self._horizon_tick).sum()) if len(carried) else 0
            if truncated:
                with self._lock:
                    self._truncated += truncated
        segs = self._segs[self._segs[:, _SG["t1_tick"]] >= lo]
        gcs = self._gcs[self._gcs[:, _GC["t1_tick"]] >= lo]
        os_rows = self._os_rows[_from_the_sample_before(self._os_rows, lo) :]
        # steps: every one a row refers to (the emitting ones too: a span lists the steps
        # its gap overlaps), from the first unsettled one on
        refs = [segs[:, _SG["step"]], em[:, _EM["step"]], em[:, _EM["device_step"]]]
        ref = np.concatenate(refs)
        ref = ref[ref >= self._step_base]
        step_lo = min(
            int(ref.min()) if len(ref) else self._num_settled_steps, self._num_settled_steps
        )
        step_lo = max(step_lo, self._step_base)
        step_hi = max(int(ref.max()) + 1 if len(ref) else 0, self._step_base + len(self._steps))
        st = np.zeros((step_hi - step_lo, len(TABLES["steps"])), dtype=np.int64)
        st[:, _ST["graph_size"]] = -1  # a step not yet ended: no decode known
        st[:, _ST["t0_tick"]] = st[:, _ST["t1_tick"]] = self._t0_tick
        known = self._steps[step_lo - self._step_base :]
        st[: len(known)] = known

        def rebase(s: np.ndarray) -> np.ndarray:
            return np.where(s >= 0, s - step_lo, s)

        secs = self._secs
        window = RawLog(
            steps=to_table(Steps, "steps", st, secs),
            segments=replace(
                to_table(Segments, "segments", segs, secs),
                step=rebase(segs[:, _SG["step"]]),
            ),
            gc_pauses=to_table(GcPauses, "gc_pauses", gcs, secs),
            emissions=replace(
                to_table(Emissions, "emissions", em, secs),
                # step: global, only reported (step0/step1), never indexed
                device_step=np.where(
                    em[:, _EM["device_step"]] >= step_lo, em[:, _EM["device_step"]] - step_lo, -1
                ),
            ),
            evictions=pair_evictions(self._events, secs),
            os_samples=to_table(OsSamples, "os_samples", os_rows, secs),
            # the partition never reads the requests: built only for a TTFT partitioner
            requests=self._requests_table() if with_requests else Requests.empty(),
            counters=Counters.empty(),
            labels=tuple(self._labels),
            request_ids=tuple(self._req_ids) if with_requests else (),
            cause_map=self._cause_map,
            path="<live window>",
        )
        return window, step_lo, em

    def _requests_table(self) -> Requests:
        """Every request so far: arrival and first token (NaN: not yet), prompt, max new."""
        n = len(self._req_ids)
        arr, first = self._arrival.ensure(n)[:n], self._first.ensure(n)[:n]
        return Requests(
            arrival_s=np.where(arr != UNKNOWN_TICK, self._secs(arr), np.nan),
            prompt_tokens=self._prompt.ensure(n)[:n].copy(),
            max_new_tokens=self._max_new.ensure(n)[:n].copy(),
            first_token_s=np.where(first != _NO_TICK, self._secs(first), np.nan),
        )

    def _settle_window(self, new_em: np.ndarray, w_tick: int, final: bool) -> None:
        win, step_lo, em = self._window(new_em)
        eager = win.steps.graph_size == GRAPH_EAGER
        # frac = 1 on every eager step: the graph column is then each gap's eager decode
        # time, sum_s w_{g,s}; graph + forward is the gap's decode time whatever the fit
        p = partition(win, excess_frac=eager.astype(np.float64))
        net = p.baseline.decode_net_ms
        n_win = len(win.steps)

        # steps that ended by w_tick: their GC-free decode time is final (rule 4's inputs)
        first = self._num_settled_steps - step_lo
        n_done = n_win - first if final else self._steps_to_settle(w_tick)
        if n_done:
            g = slice(self._num_settled_steps, self._num_settled_steps + n_done)
            hi = self._num_settled_steps + n_done
            self._st_graph.ensure(hi)[g] = win.steps.graph_size[first : first + n_done]
            self._st_ndec.ensure(hi)[g] = win.steps.num_decode[first : first + n_done]
            self._st_net.ensure(hi)[g] = net[first : first + n_done]
            self._line.add(
                win.steps.graph_size[first : first + n_done], net[first : first + n_done]
            )
            eager_done = np.flatnonzero(win.steps.graph_size[first : first + n_done] == 0)
            if len(eager_done):
                k = self._num_eager
                self._eager_idx.ensure(k + len(eager_done))[k : k + len(eager_done)] = (
                    self._num_settled_steps + eager_done
                )
                self._num_eager += len(eager_done)
            self._num_settled_steps = hi

        # each gap's weight w_{g,s} per eager step it touches
        gcol, fcol = p.labels.index("graph"), p.labels.index("forward")
        e_ms = p.parts_ms[:, gcol].copy()
        d_ms = e_ms + p.parts_ms[:, fcol]
        gi, si, wv = self._eager_weights(win, p, eager, e_ms)
        if len(gi):
            np.add.at(self._w.ensure(step_lo + n_win), step_lo + si, wv)

        # each gap's graph under the running line (this window's decode times)
        frac_win = self._line.excess_frac(win.steps.graph_size, win.steps.num_decode, net)
        g_est = np.zeros(len(p))
        np.add.at(g_est, gi, frac_win[si] * wv)
        # the run's graph total: exact at close (design.md's fit over every captured step);
        # meanwhile the new gaps' estimates are added, and every `refit_s` of engine clock
        # the whole total is re-evaluated under the line so far
        if w_tick - self._last_refit_tick >= self._refit_ticks:
            graph_ms = self._graph_running()
            self._last_refit_tick = w_tick
        else:
            graph_ms = self._graph_ms + float(g_est.sum())
        parts = p.parts_ms.copy()
        parts[:, gcol] = g_est
        parts[:, fcol] = d_ms - g_est
        primary, causes = primary_of(parts, p.gap_ms, p.labels)

        # the sliding window's p99, the batch included
        self._tail.extend(p.gap_ms)
        window = self._tail.values()
        p99 = float(np.percentile(window, 99)) if len(window) else math.nan
        tail = p.gap_ms >= p99
        names = np.array([*causes, "clean"], dtype=object)[
            np.where(primary == CLEAN, len(causes), primary)
        ]
        which = np.searchsorted(np.array(HIST_EDGES_MS), p.gap_ms, side="right") - 1
        sums = p.parts_ms.sum(axis=0)
        tail_sums = parts[tail].sum(axis=0)
        with self._lock:
            self._gaps += len(p)
            self._gap_sum_s += float(p.gap_ms.sum()) / 1e3
            np.add.at(self._hist, which, 1)
            for j, lb in enumerate(p.labels):
                if j not in (gcol, fcol):
                    self._cause_ms[lb] = self._cause_ms.get(lb, 0.0) + float(sums[j])
                self._tail_ms[lb] = self._tail_ms.get(lb, 0.0) + float(tail_sums[j])
            self._decode_ms += float(d_ms.sum())
            self._graph_ms = graph_ms
            self._fit_steps = self._line.n
            for nm in names[tail].tolist():
                self._tail_count[nm] = self._tail_count.get(nm, 0) + 1
            if len(p):
                self._itl_p99_ms = p99
        if self._tracer is not None and self.slo_ms is not None and len(p):
            sel = np.flatnonzero(p.gap_ms >= self.slo_ms)
            if len(sel):
                self._export_spans(win, p, parts, names, step_lo, sel)

        # carry each request's last settled emission into the next window
        if len(new_em):
            o = np.lexsort((new_em[:, _EM["t_tick"]], new_em[:, _EM["request"]]))
            last = o[np.r_[new_em[o, 0][1:] != new_em[o, 0][:-1], True]]
            r = new_em[last, 0]
            n = int(r.max()) + 1
            self._carry.ensure(n)[r] = new_em[last, 1]
            self._carry_step.ensure(n)[r] = new_em[last, 2]
            self._carry_nt.ensure(n)[r] = new_em[last, 3]
            self._carry_dstep.ensure(n)[r] = new_em[last, 4]
            self._inflight = np.union1d(self._inflight, r)

    def _eager_weights(self, win: RawLog, p: Any, eager: np.ndarray, e_ms: np.ndarray):
        """(gap, window step, w) for every gap's eager decode time, per eager step.

        A gap touched by one eager step's decode windows owns ``e_ms`` of it; a gap touched
        by several is partitioned again once per such step with only that step's fraction
        at 1 (rare: a gap spanning several eager steps)."""
        sg = win.segments
        if not len(p) or not eager.any() or not len(sg):
            z = np.zeros(0, dtype=np.int64)
            return z, z, np.zeros(0)
        causes = np.array(
            [cause_of(lb, self._cause_map) for lb in win.labels] or [""], dtype=object
        )
        dec = np.flatnonzero(
            (causes[sg.label] == "decode") & (sg.step >= 0) & eager[np.maximum(sg.step, 0)]
        )
        if not len(dec):
            z = np.zeros(0, dtype=np.int64)
            return z, z, np.zeros(0)
        # touching: the decode window overlaps the gap's open interval
        hit_g, hit_s = [], []
        for j in dec.tolist():
            g = np.flatnonzero((p.t0_s < sg.t_end_s[j]) & (p.t1_s > sg.t_start_s[j]))
            hit_g.append(g)
            hit_s.append(np.full(len(g), sg.step[j]))
        pairs = np.unique(np.column_stack([np.concatenate(hit_g), np.concatenate(hit_s)]), axis=0)
        gi, si = pairs[:, 0], pairs[:, 1]
        per_gap = np.bincount(gi, minlength=len(p))
        one = per_gap[gi] == 1
        w = np.where(one, e_ms[gi], 0.0)
        multi = np.flatnonzero(~one)
        for s in np.unique(si[multi]).tolist():
            frac = np.zeros(len(win.steps))
            frac[s] = 1.0
            col = partition(win, excess_frac=frac, check=False).column("graph")
            k = multi[si[multi] == s]
            w[k] = col[gi[k]]
        return gi, si, w

    def _graph_running(self) -> float:
        """sum_s frac_s * w_s over the settled eager steps, under the running line."""
        idx = self._eager_idx.a[: self._num_eager]
        frac = self._line.excess_frac(
            np.zeros(len(idx), dtype=np.int64), self._st_ndec.a[idx], self._st_net.a[idx]
        )
        return float(np.dot(frac, self._w.a[idx]))

    def _graph_exact(self) -> float:
        """sum_s frac_s * w_s with `tracekit.attribution.itl.fit_baseline` over every step of the
        run (design.md rule 4, the offline fit itself): the exact graph total."""
        n = self._num_settled_steps
        stub = RawLog(
            steps=Steps.from_columns(
                t_start_s=np.zeros(n),
                t_end_s=np.zeros(n),
                num_decode=self._st_ndec.ensure(n)[:n],
                num_prefill_tokens=np.zeros(n),
                graph_size=self._st_graph.ensure(n)[:n],
                num_preempted=np.zeros(n),
                num_swapped_in=np.zeros(n),
            ),
            segments=Segments.empty(),
            gc_pauses=GcPauses.empty(),
            emissions=Emissions.empty(),
            evictions=pair_evictions(self._events[:0], self._secs),
            requests=Requests.empty(),
        )
        base = fit_baseline(stub, self._st_net.ensure(n)[:n])
        return float(np.dot(base.eager_excess_frac, self._w.ensure(n)[:n]))

    # -- OpenTelemetry --------------------------------------------------------------------------
    def _export_spans(self, win, p, parts, names, step_lo, sel) -> None:
        st = win.steps
        for i in sel.tolist():
            t0, t1 = float(p.t0_s[i]), float(p.t1_s[i])
            hit = np.flatnonzero((st.t_start_s < t1) & (st.t_end_s > t0)) + step_lo
            n_hit = len(hit)
            if n_hit > MAX_SPAN_STEPS:  # a long gap: its first and last steps, where its cause is
                half = MAX_SPAN_STEPS // 2
                hit = np.concatenate([hit[:half], hit[-half:]])
            attrs: dict[str, Any] = {
                "tracekit.request_id": self._req_ids[int(p.request[i])],
                "tracekit.gap_ms": float(p.gap_ms[i]),
                "tracekit.t0_s": t0,
                "tracekit.t1_s": t1,
                "tracekit.step0": int(p.step0[i]),
                "tracekit.step1": int(p.step1[i]),
                "tracekit.steps": hit.tolist(),
                "tracekit.num_steps": n_hit,
                "tracekit.primary_cause": str(names[i]),
                "tracekit.graph_fit_steps": self._fit_steps,
            }
            for lb, v in zip(p.labels, parts[i].tolist(), strict=True):
                attrs[f"tracekit.part.{lb}_ms"] = v
            start_ns = int((self._unix0 + t0) * 1e9)
            span = self._tracer.start_span("tracekit.gap", start_time=start_ns, attributes=attrs)
            span.end(end_time=max(start_ns, int((self._unix0 + t1) * 1e9)))
            with self._lock:
                self._spans += 1

    # -- retention --------------------------------------------------------------------------------
    def _prune(self, w_tick: int) -> None:
        """Drop the rows no future gap (or unsettled step) can overlap."""
        n_req = len(self._req_ids)
        carry = self._carry.ensure(n_req)
        inf = self._inflight
        max_new = self._max_new.ensure(n_req)[inf]
        done = (max_new > 0) & (self._tokens.ensure(n_req)[inf] >= max_new)
        inf = self._inflight = inf[~done & (carry[inf] >= w_tick - self._retain_ticks)]
        # and a request with emissions still to settle needs the rows from its carried one
        pend = np.unique(self._pending[:, _EM["request"]])
        live = np.union1d(inf, pend[carry[pend] != UNKNOWN_TICK])
        bounds = [w_tick]
        if len(live):
            bounds.append(int(carry[live].min()))
        if len(self._pending):
            bounds.append(int(self._pending[:, _EM["t_tick"]].min()))
        i = self._num_settled_steps - self._step_base
        if i < len(self._steps):
            bounds.append(int(self._steps[i, _ST["t0_tick"]]))
        if self._ttft_partitioner is not None and len(self._ttft_open):
            bounds.append(int(self._arrival.ensure(n_req)[self._ttft_open].min()))
        H = min(bounds)
        if H <= self._horizon_tick:
            return
        self._horizon_tick = H
        self._segs = self._segs[self._segs[:, _SG["t1_tick"]] >= H]
        self._gcs = self._gcs[self._gcs[:, _GC["t1_tick"]] >= H]
        self._os_rows = self._os_rows[_from_the_sample_before(self._os_rows, H) :]
        self._events = _drop_closed_evictions(self._events, H)
        # steps: keep every one a retained row or a live carry may still name
        keep = [self._num_settled_steps]
        s = self._segs[:, _SG["step"]]
        if len(s[s >= 0]):
            keep.append(int(s[s >= 0].min()))
        for a in (self._carry_step.ensure(n_req)[live], self._carry_dstep.ensure(n_req)[live]):
            if len(a[a >= 0]):
                keep.append(int(a[a >= 0].min()))
        for col in ("step", "device_step"):
            a = self._pending[:, _EM[col]]
            if len(a[a >= 0]):
                keep.append(int(a[a >= 0].min()))
        first = max(self._step_base, min(keep))
        self._steps = self._steps[first - self._step_base :]
        self._step_base = first

    # -- the exported values ------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The exported values, consistent with each other (what a scrape sees)."""
        with self._lock:
            cause = {k: v for k, v in self._cause_ms.items()}
            cause["graph"] = self._graph_ms
            cause["forward"] = self._decode_ms - self._graph_ms
            return {
                "gaps": self._gaps,
                "gap_sum_s": self._gap_sum_s,
                "hist": self._hist.copy(),
                "cause_ms": cause,
                "tail_count": dict(self._tail_count),
                "tail_ms": dict(self._tail_ms),
                "itl_window_p99_ms": self._itl_p99_ms,
                "ttft_n": self._ttft_n,
                "ttft_sum_s": self._ttft_sum_s,
                "ttft_hist": self._ttft_hist.copy(),
                "ttft_window_p50_ms": self._ttft_p50_ms,
                "ttft_window_p99_ms": self._ttft_p99_ms,
                "ttft_cause_ms": dict(self._ttft_cause_ms),
                "late_rows": self._late_rows,
                "truncated_gaps": self._truncated,
                "errors": self._errors,
                "spans": self._spans,
                "backlog": self._written - self._consumed,
                "cpu_s": self._cpu_s,
                "fit_steps": self._fit_steps,
                "settled_to_s": float(self._secs(np.array([self._settled_to_tick]))[0])
                if abs(self._settled_to_tick) != _NO_TICK
                else math.nan,
                "final": self._is_final,
            }


def _from_the_sample_before(os_rows: np.ndarray, tick: int) -> int:
    """The first OS sample a window from `tick` needs: the last one at or before it (the
    OS interval that covers `tick` starts there), else the first one. Samples are kept in
    the order they were recorded: the loop thread's are in time order."""
    t = os_rows[:, _OS["t_tick"]]
    before = np.flatnonzero(t <= tick)
    return int(before[-1]) if len(before) else 0


def _drop_closed_evictions(ev: np.ndarray, horizon: int) -> np.ndarray:
    """Event rows without the eviction/readmission pairs that ended before `horizon`."""
    if not len(ev):
        return ev
    req, kinds, ts = (ev[:, column_index("events", c)] for c in ("request", "kind", "t_tick"))
    order = np.lexsort((np.arange(len(ev)), ts, req))
    drop = np.zeros(len(ev), dtype=bool)
    open_at: dict[int, int] = {}
    for i in order.tolist():  # per eviction event: a few per second at most
        r, kind, t = int(req[i]), int(kinds[i]), int(ts[i])
        if kind == EVICT:
            open_at[r] = i
        elif r in open_at:
            j = open_at.pop(r)
            if t < horizon:
                drop[i] = drop[j] = True
        elif t < horizon:
            drop[i] = True  # a readmission without its eviction: it pairs with nothing
    return ev[~drop]


class _Collector:
    """Builds the metric families from a sink's snapshot at each scrape."""

    def __init__(self, sink: LiveMetrics) -> None:
        self.sink = sink

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        s = self.sink.snapshot()
        yield CounterMetricFamily(
            "tracekit_gaps", "Inter-token gaps settled (consecutive emissions of one request).",
            value=s["gaps"],
        )  # fmt: skip
        cum = np.cumsum(s["hist"]).tolist()
        edges = HIST_EDGES_MS[1:]
        buckets = [
            (_le(hi / 1e3), c) for hi, c in zip(edges, cum, strict=True) if math.isfinite(hi)
        ]
        buckets.append(("+Inf", cum[-1]))
        yield HistogramMetricFamily(
            "tracekit_gap_seconds",
            "Inter-token gaps, seconds; bucket le=X counts gaps < X (the report's [lo, hi) bins).",
            buckets=buckets,
            sum_value=s["gap_sum_s"],
        )
        c = CounterMetricFamily(
            "tracekit_gap_cause_seconds",
            "Gap time by cause (the exclusive partition), seconds; graph/forward use the "
            "graph baseline fitted so far (exact once the run has closed).",
            labels=["cause"],
        )
        for lb, v in sorted(s["cause_ms"].items()):
            c.add_metric([lb], v / 1e3)
        yield c
        t = CounterMetricFamily(
            "tracekit_tail_gaps",
            "Gaps at or above the sliding window's p99, by primary cause ('clean' included).",
            labels=["primary_cause"],
        )
        for lb, v in sorted(s["tail_count"].items()):
            t.add_metric([lb], v)
        yield t
        tm = CounterMetricFamily(
            "tracekit_tail_gap_cause_seconds",
            "Time of the gaps at or above the sliding window's p99, by cause, seconds.",
            labels=["cause"],
        )
        for lb, v in sorted(s["tail_ms"].items()):
            tm.add_metric([lb], v / 1e3)
        yield tm
        yield _gauge(GaugeMetricFamily, "tracekit_itl_window_p99_seconds",
                     "p99 of the sliding window of recent gaps, seconds.",
                     s["itl_window_p99_ms"])  # fmt: skip
        tc = np.cumsum(s["ttft_hist"]).tolist()
        tb = [(_le(b), v) for b, v in zip(TTFT_BUCKETS_S, tc, strict=False)]
        tb.append(("+Inf", tc[-1]))
        yield HistogramMetricFamily(
            "tracekit_ttft_seconds",
            "Time to first token (first emission - arrival) per request, seconds.",
            buckets=tb,
            sum_value=s["ttft_sum_s"],
        )
        yield _gauge(GaugeMetricFamily, "tracekit_ttft_window_p50_seconds",
                     "Median TTFT over the sliding window of recent requests, seconds.",
                     s["ttft_window_p50_ms"])  # fmt: skip
        yield _gauge(GaugeMetricFamily, "tracekit_ttft_window_p99_seconds",
                     "p99 TTFT over the sliding window of recent requests, seconds.",
                     s["ttft_window_p99_ms"])  # fmt: skip
        if s["ttft_cause_ms"]:
            tt = CounterMetricFamily(
                "tracekit_ttft_cause_seconds", "TTFT time by cause, seconds.", labels=["cause"]
            )
            for lb, v in sorted(s["ttft_cause_ms"].items()):
                tt.add_metric([lb], v / 1e3)
            yield tt
        for name, key, doc in (
            ("tracekit_live_late_rows", "late_rows",
             "Rows that arrived after the gaps they overlap were exported (raise hold_s)."),
            ("tracekit_live_truncated_gaps", "truncated_gaps",
             "Gaps settled after rows they needed were dropped (a request quiet > max_retain_s)."),
            ("tracekit_live_errors", "errors", "Settlements that failed (logged once)."),
            ("tracekit_live_spans", "spans", "OpenTelemetry spans sent for gaps above the SLO."),
            ("tracekit_live_cpu_seconds", "cpu_s",
             "CPU time the live worker thread spent partitioning and exporting."),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=s[key])
        yield GaugeMetricFamily(
            "tracekit_live_backlog_chunks",
            "Flushed chunks not yet partitioned.",
            value=s["backlog"],
        )
        yield _gauge(GaugeMetricFamily, "tracekit_live_settled_to_seconds",
                     "Engine clock up to which every gap is settled, seconds.",
                     s["settled_to_s"] * 1e3)  # fmt: skip
        yield GaugeMetricFamily(
            "tracekit_live_final",
            "1 once the run has closed: every gap settled, graph/forward on the whole run's fit.",
            value=1.0 if s["final"] else 0.0,
        )


def _le(x: float) -> str:
    return repr(float(x))


def _gauge(cls: Any, name: str, doc: str, ms: float) -> Any:
    return cls(name, doc, value=ms / 1e3)


def attach(recorder: Any, sink: Any) -> Any:
    """Feed `sink` from a `tracekit.Recorder` (before its start): opened at the recorder's
    start, every flushed chunk written off the engine thread, closed at its stop; a sink
    that raises is logged once and detached, the recording goes on. The same as
    ``Recorder(..., sinks=[sink])``. Returns `sink`."""
    recorder.add_sink(sink)
    return sink


__all__ = ["LiveMetrics", "attach", "TTFT_BUCKETS_S"]
