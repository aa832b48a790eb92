"""`LiveMetrics`, the recorder sink of live mode: ``write`` only queues a batch; one
background thread settles it (`tracekit.live.settler`) and exports what was measured
(`tracekit.live.stats`) through `tracekit.live.prometheus` and `tracekit.live.otel`, so the
engine never waits on it, nor on a scraper (the HTTP server has threads of its own).

**What agrees with the offline analysis of the same run's raw log.** With no late rows
and no truncated gaps (both exported), after `close`: ``tracekit_gaps_total`` is the
log's gap count, ``tracekit_gap_seconds`` has the report's histogram counts, and
``tracekit_gap_cause_seconds_total{cause}`` is the sum of that label over all gaps, to
float rounding (graph/forward: see the settler).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from tracekit.live.settler import (
    GAP_BUCKETS_S,
    TTFT_BUCKETS_S,
    Settler,
    TtftPartitioner,
    ttft_by_cause,
)
from tracekit.live.stats import GapExemplar, LiveTotals, WallView, WorkerStats
from tracekit.live.traceparent import parse_traceparent
from tracekit.log.clocks import WALL_CLOCKS

log = logging.getLogger("tracekit.live")


def _missing_extra(e: ImportError) -> ImportError:
    return ImportError(
        f"tracekit.live needs the `live` extra ({e.name} is missing): pip install 'tracekit[live]'"
    )


class LiveMetrics:
    """A recorder sink that partitions every gap as the run goes and exports it.

    port: serve ``/metrics`` on this port (0: any free one, see `port` after `open`);
        None: no server (`registry` can still be read, e.g. by the caller's own server).
    addr: the address the metrics server binds.
    slo_ms: every settled gap at least this long becomes an OpenTelemetry span (request
        id, gap, parts, the engine steps it spans), through `tracer_provider` (default:
        the global one, with whatever exporter the application configured).
    hold_s: how long after a flush a gap waits to be settled: a window open for longer is
        late (counted, see `tracekit.live.settler`).
    tail_window: how many recent gaps (and TTFTs) the sliding p99 is taken over.
    max_retain_s: a request with no known ``max_new_tokens`` stops pinning the retained
        rows this long after its last emission; a later gap of it is counted truncated.
    refit_s: how often (engine clock) the running graph total is re-evaluated over every
        eager step under the line fitted so far (between, new gaps add their estimates).
    otlp_endpoint: send the spans to this OTLP/HTTP collector (a tracer provider of its
        own; needs opentelemetry-exporter-otlp-proto-http, in the `live` extra).
    const_labels: labels on every series (default: ``run`` (the config's ``run``, else
        the start time and pid), ``engine`` and ``model`` (the config's, when strings),
        ``process`` (the pid)); given, they replace the defaults.
    gap_buckets_s / ttft_buckets_s: the histograms' bucket bounds, seconds (``le``: <=).
    ttft_partitioner: ``f(window: RawLog, requests: np.ndarray) -> (labels, parts_ms)``,
        the TTFT partition by cause (``tracekit.attribution.ttft``) of the given requests
        (indices) over a window holding every row from their arrival on (its requests
        table has each request's arrival and first token; its emissions table is empty);
        exported as ``tracekit_ttft_cause_seconds_total{cause}``. Default: the offline
        partition itself (`tracekit.live.settler.ttft_by_cause`); None: not exported.
    """

    #: While the engine idles, the recorder hands this sink a flush with no rows every
    #: interval (`tracekit.capture.sinks.Dispatcher`), so the last gaps settle.
    follows_idle_clock = True

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
        ttft_partitioner: TtftPartitioner | None = ttft_by_cause,
        close_timeout_s: float = 60.0,
        refit_s: float = 10.0,
        otlp_endpoint: str | None = None,
        const_labels: Mapping[str, str] | None = None,
        gap_buckets_s: tuple[float, ...] = GAP_BUCKETS_S,
        ttft_buckets_s: tuple[float, ...] = TTFT_BUCKETS_S,
    ) -> None:
        # optional dependencies: the exporters' modules import prometheus_client and
        # opentelemetry at their top, so they are imported only when a sink is made and
        # `import tracekit.live` needs neither
        try:
            import prometheus_client  # noqa: F401  (checked first: a cached exporter would not)

            import tracekit.live.prometheus as prometheus
        except ImportError as e:
            raise _missing_extra(e) from None
        self._spans_out: Any = None
        self._own_provider: Any = None  # a provider made here (OTLP): this sink's to shut down
        if slo_ms is not None:
            try:  # optional dependency: opentelemetry, only for a sink that sends spans
                import tracekit.live.otel as otel
            except ImportError as e:
                raise _missing_extra(e) from None
            if otlp_endpoint is not None:
                if tracer_provider is not None:
                    raise ValueError("otlp_endpoint or tracer_provider: give one")
                tracer_provider = otel.otlp_provider(otlp_endpoint, {"service.name": "tracekit"})
                self._own_provider = tracer_provider
            self._spans_out = otel.GapSpanExporter(tracer_provider)
        elif otlp_endpoint is not None:
            raise ValueError("otlp_endpoint: spans are sent only with an slo_ms")
        self._settler = Settler(
            hold_s=hold_s,
            tail_window=tail_window,
            max_retain_s=max_retain_s,
            refit_s=refit_s,
            slo_ms=slo_ms,
            ttft_partitioner=ttft_partitioner,
            gap_buckets_s=gap_buckets_s,
            ttft_buckets_s=ttft_buckets_s,
        )
        self._prometheus = prometheus
        self._const_labels = dict(const_labels) if const_labels is not None else None
        self.registry, self._collector = prometheus.make_registry(
            self._read,
            const_labels=self._const_labels,
            gap_buckets_s=self._settler.gap_buckets_s,
            ttft_buckets_s=self._settler.ttft_buckets_s,
        )
        self.slo_ms = slo_ms
        self.port = port
        self._addr = addr
        self._hold_s = hold_s
        self._close_timeout_s = close_timeout_s
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._lock = threading.Lock()  # guards what a scrape reads
        self._opened = False
        self._closed = False
        self._unix0_s = 0.0
        self._is_wall_clock = False
        self._totals = self._settler.totals.copy()  # the latest settled totals
        self._worker = WorkerStats()
        self._wall = WallView()
        # (engine-clock s, Unix s) at the start and at each flush: the engine clock on the
        # wall clock, whatever the recorder's timer counts (CPU time, a fake clock)
        self._clock_pts: deque[tuple[float, float]] = deque(maxlen=4096)
        self._written = 0  # batches queued (only `write` counts up)
        self._consumed = 0  # batches settled (only the worker counts up)

    # -- the sink protocol -------------------------------------------------------------
    def open(self, meta: Mapping[str, Any]) -> None:
        """At the recorder's start: the run's clock, cause map; starts the worker (and the
        metrics server, if a port was given)."""
        if self._opened:
            raise RuntimeError("a LiveMetrics sink follows one run; make a new one per run")
        self._opened = True
        self._unix0_s = float(meta.get("started_unix_s", time.time()))
        self._clock_pts.append((0.0, self._unix0_s))
        self._is_wall_clock = meta.get("clock") in WALL_CLOCKS
        self._settler.open(meta)
        with self._lock:  # the series the run's meta adds (the OS causes), at 0 from now on
            self._totals = self._settler.totals.copy()
        pid = str(meta.get("pid", os.getpid()))
        run_key = f"{self._unix0_s!r}-{pid}"
        if self._const_labels is None:
            cfg = meta.get("config") or {}
            pick = {k: cfg.get(k) for k in ("run", "engine", "model")}
            self._const_labels = {
                "run": str(pick["run"]) if isinstance(pick["run"], str) else run_key,
                "engine": pick["engine"] if isinstance(pick["engine"], str) else "",
                "model": pick["model"] if isinstance(pick["model"], str) else "",
                "process": pid,
            }
            self._collector.set_const_labels(self._const_labels)
        if self._spans_out is not None:
            self._spans_out.run_key = f"{self._const_labels.get('run', '')}-{run_key}"
        self._thread = threading.Thread(target=self._run, name="tracekit-live", daemon=True)
        self._thread.start()
        if self.port is not None and self._server is None:
            self.serve(self.port)

    def write(self, batch: Mapping[str, np.ndarray]) -> None:
        """One flushed batch: queued for the worker (never blocks, never raises)."""
        if self._thread is None:  # not opened (or opening failed): nothing would consume it
            return
        self._written += 1
        self._q.put((batch, time.time()))

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
                    "tracekit live: still partitioning %d batch(es) after %.0f s at close; "
                    "the metrics settle when it is done",
                    self._written - self._consumed,
                    self._close_timeout_s,
                )

    def serve(self, port: int = 0) -> int:
        """Serve ``/metrics`` from this sink's registry (its own threads); returns the port."""
        self._server = self._prometheus.serve(self.registry, port, self._addr)
        self.port = int(self._server.server_port)
        return self.port

    def shutdown(self) -> None:
        """Stop the metrics server (if any), and send the spans still batched for OTLP."""
        if self._own_provider is not None:
            self._own_provider.shutdown()
            self._own_provider = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def trace_parent(self, request_id: str, traceparent: str) -> bool:
        """The engine propagated `request_id`'s trace context: its slow-gap spans become
        children of the W3C ``traceparent`` header's span, in that trace (else each request
        has a trace of its own). Call it before the request's gaps settle (at its arrival).
        ValueError if the header is malformed; False (nothing kept) when this sink sends no
        spans (no `slo_ms`)."""
        parse_traceparent(traceparent)
        if self._spans_out is None:
            return False
        self._spans_out.set_parent(request_id, traceparent)
        return True

    @property
    def is_final(self) -> bool:
        """True once `close` has settled every gap (graph/forward use the whole run's fit)."""
        return self._totals.final

    # -- the worker ----------------------------------------------------------------------
    def _count_error(self, e: Exception) -> None:
        with self._lock:
            self._worker.errors += 1
        if self._worker.errors == 1:
            log.error(
                "tracekit live: exporting failed (%s: %s); recording goes on, later "
                "failures are only counted in tracekit_live_errors_total",
                type(e).__name__,
                e,
                exc_info=e,
            )

    def to_unix_s(self, engine_s: np.ndarray) -> np.ndarray:
        """Engine-clock seconds as Unix seconds. A recorder on a wall clock (`WALL_CLOCKS`):
        the start's Unix time plus the engine seconds, so the time a flush took to reach
        this sink never shifts a span. Any other clock (CPU time, a fake one): interpolated
        between the flushes' wall times (past the last one, a second is a second)."""
        if self._is_wall_clock:
            return self._unix0_s + np.asarray(engine_s, dtype=np.float64)
        e = np.array([p[0] for p in self._clock_pts])
        u = np.array([p[1] for p in self._clock_pts])
        x = np.asarray(engine_s, dtype=np.float64)
        out = np.interp(x, e, u)
        past = x > e[-1]
        out[past] = u[-1] + (x[past] - e[-1])
        before = x < e[0]
        out[before] = u[0] + (x[before] - e[0])
        return out

    def _run(self) -> None:
        s = self._settler
        while True:
            item = self._q.get()
            batch, unix_s = item if item is not None else (None, time.time())
            cpu0 = time.thread_time()
            late0 = s.totals.late_rows
            try:
                out = s.settle(final=True) if batch is None else s.add(batch)
                for e in out.errors:
                    self._count_error(e)
                if batch is not None and s.flush_s > self._clock_pts[-1][0]:
                    self._clock_pts.append((s.flush_s, unix_s))
                ids: list[tuple[str, str]] = []
                if self._spans_out is not None and out.slow_gaps:
                    ids = self._spans_out.export(out.slow_gaps, self.to_unix_s)
                wall = self._wall_view(out, ids)
                with self._lock:
                    self._totals = s.totals.copy()
                    self._worker.spans += len(ids)
                    self._wall = wall
                if batch is None:
                    return
            except Exception as e:  # recording goes on; said once, then counted
                self._count_error(e)
                with self._lock:
                    self._totals = s.totals.copy()
                if batch is None:
                    return
            finally:
                if late0 == 0 and s.totals.late_rows:
                    log.warning(
                        "tracekit live: %d row(s) arrived after the gaps they overlap were "
                        "exported (a window open longer than hold_s=%.1f s); those gaps' live "
                        "parts miss them: raise hold_s",
                        s.totals.late_rows,
                        self._hold_s,
                    )
                self._worker.cpu_s += time.thread_time() - cpu0
                if batch is not None:
                    self._consumed += 1

    def retained(self) -> dict[str, int]:
        """How many rows the settler holds now (read it once the worker is idle)."""
        return self._settler.retained()

    # -- the exported values ------------------------------------------------------------------
    def _wall_view(self, out: Any, ids: list[tuple[str, str]]) -> WallView:
        """The wall-clock values after a settlement: the settled-to time, and the latest
        slow gap's span per gap bucket (OpenMetrics exemplars)."""
        t = self._settler.totals
        to = self._settler.flush_s if t.final else t.settled_to_s
        ex = dict(self._wall.exemplars)
        if ids:
            g = out.slow_gaps
            t1 = self.to_unix_s(np.array([x.t1_s for x in g]))
            b = np.searchsorted(self._settler.gap_buckets_s, [x.gap_ms / 1e3 for x in g], "left")
            for i, (tid, sid) in enumerate(ids):
                ex[int(b[i])] = GapExemplar(tid, sid, g[i].gap_ms / 1e3, float(t1[i]))
        unix = float(self.to_unix_s(np.array([to]))[0]) if math.isfinite(to) else math.nan
        return WallView(settled_to_unix_s=unix, exemplars=ex)

    def _read(self) -> tuple[LiveTotals, WorkerStats, WallView]:
        with self._lock:
            w = WorkerStats(
                errors=self._worker.errors,
                spans=self._worker.spans,
                backlog_batches=self._written - self._consumed,
                cpu_s=self._worker.cpu_s,
            )
            return self._totals, w, self._wall

    def snapshot(self) -> dict[str, Any]:
        """The exported values, consistent with each other (what a scrape sees)."""
        t, w, _ = self._read()
        return {
            "gaps": t.gaps,
            "gap_sum_s": t.gap_sum_s,
            "hist": t.hist.copy(),
            "cause_ms": dict(t.cause_ms),
            "tail_count": dict(t.tail_count),
            "tail_ms": dict(t.tail_ms),
            "itl_window_p99_ms": t.itl_window_p99_ms,
            "ttft_n": t.ttft_n,
            "ttft_sum_s": t.ttft_sum_s,
            "ttft_hist": t.ttft_hist.copy(),
            "ttft_window_p50_ms": t.ttft_window_p50_ms,
            "ttft_window_p99_ms": t.ttft_window_p99_ms,
            "ttft_cause_ms": dict(t.ttft_cause_ms),
            "late_rows": t.late_rows,
            "truncated_gaps": t.truncated_gaps,
            "truncated_ttfts": t.truncated_ttfts,
            "errors": w.errors,
            "spans": w.spans,
            "backlog": w.backlog_batches,
            "cpu_s": w.cpu_s,
            "fit_steps": t.fit_steps,
            "settled_to_s": t.settled_to_s,
            "final": t.final,
            "evictions_by_reason": dict(t.evictions_by_reason),
            "recomputed_tokens": t.recomputed_tokens,
        }
