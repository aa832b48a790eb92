"""The Prometheus exporter of live mode: a collector that turns the settler's totals
(`tracekit.live.stats.LiveTotals`) into metric families at each scrape, and the HTTP
server that serves them. Needs ``prometheus_client`` (the `live` extra)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tracekit.analysis.figures import HIST_EDGES_MS
from tracekit.live.settler import TTFT_BUCKETS_S
from tracekit.live.stats import LiveTotals, WorkerStats

Reader = Callable[[], tuple[LiveTotals, WorkerStats]]


def make_registry(read: Reader) -> CollectorRegistry:
    """A registry of its own holding one `LiveCollector` over `read`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector(read))
    return registry


def serve(registry: CollectorRegistry, port: int, addr: str) -> Any:
    """Serve ``/metrics`` from `registry` on its own threads; returns the server."""
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server


class LiveCollector:
    """Builds the metric families from one consistent read of the totals at each scrape."""

    def __init__(self, read: Reader) -> None:
        self.read = read

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        s, w = self.read()
        yield CounterMetricFamily(
            "tracekit_gaps", "Inter-token gaps settled (consecutive emissions of one request).",
            value=s.gaps,
        )  # fmt: skip
        cum = np.cumsum(s.hist).tolist()
        edges = HIST_EDGES_MS[1:]
        buckets = [
            (_le(hi / 1e3), c) for hi, c in zip(edges, cum, strict=True) if math.isfinite(hi)
        ]
        buckets.append(("+Inf", cum[-1]))
        yield HistogramMetricFamily(
            "tracekit_gap_seconds",
            "Inter-token gaps, seconds; bucket le=X counts gaps < X (the report's [lo, hi) bins).",
            buckets=buckets,
            sum_value=s.gap_sum_s,
        )
        c = CounterMetricFamily(
            "tracekit_gap_cause_seconds",
            "Gap time by cause (the exclusive partition), seconds; graph/forward use the "
            "graph baseline fitted so far (exact once the run has closed).",
            labels=["cause"],
        )
        for lb, v in sorted(s.cause_ms.items()):
            c.add_metric([lb], v / 1e3)
        yield c
        t = CounterMetricFamily(
            "tracekit_tail_gaps",
            "Gaps at or above the sliding window's p99, by primary cause ('clean' included).",
            labels=["primary_cause"],
        )
        for lb, v in sorted(s.tail_count.items()):
            t.add_metric([lb], v)
        yield t
        tm = CounterMetricFamily(
            "tracekit_tail_gap_cause_seconds",
            "Time of the gaps at or above the sliding window's p99, by cause, seconds.",
            labels=["cause"],
        )
        for lb, v in sorted(s.tail_ms.items()):
            tm.add_metric([lb], v / 1e3)
        yield tm
        yield _gauge_ms("tracekit_itl_window_p99_seconds",
                        "p99 of the sliding window of recent gaps, seconds.",
                        s.itl_window_p99_ms)  # fmt: skip
        tc = np.cumsum(s.ttft_hist).tolist()
        tb = [(_le(b), v) for b, v in zip(TTFT_BUCKETS_S, tc, strict=False)]
        tb.append(("+Inf", tc[-1]))
        yield HistogramMetricFamily(
            "tracekit_ttft_seconds",
            "Time to first token (first emission - arrival) per request, seconds.",
            buckets=tb,
            sum_value=s.ttft_sum_s,
        )
        yield _gauge_ms("tracekit_ttft_window_p50_seconds",
                        "Median TTFT over the sliding window of recent requests, seconds.",
                        s.ttft_window_p50_ms)  # fmt: skip
        yield _gauge_ms("tracekit_ttft_window_p99_seconds",
                        "p99 TTFT over the sliding window of recent requests, seconds.",
                        s.ttft_window_p99_ms)  # fmt: skip
        if s.ttft_cause_ms:
            tt = CounterMetricFamily(
                "tracekit_ttft_cause_seconds", "TTFT time by cause, seconds.", labels=["cause"]
            )
            for lb, v in sorted(s.ttft_cause_ms.items()):
                tt.add_metric([lb], v / 1e3)
            yield tt
        for name, value, doc in (
            ("tracekit_live_late_rows", s.late_rows,
             "Rows that arrived after the gaps they overlap were exported (raise hold_s)."),
            ("tracekit_live_truncated_gaps", s.truncated_gaps,
             "Gaps settled after rows they needed were dropped (a request quiet > max_retain_s)."),
            ("tracekit_live_errors", w.errors, "Settlements that failed (logged once)."),
            ("tracekit_live_spans", w.spans, "OpenTelemetry spans sent for gaps above the SLO."),
            ("tracekit_live_cpu_seconds", w.cpu_s,
             "CPU time the live worker thread spent partitioning and exporting."),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "tracekit_live_backlog_chunks",
            "Flushed batches not yet partitioned.",
            value=w.backlog_batches,
        )
        yield _gauge_ms("tracekit_live_settled_to_seconds",
                        "Engine clock up to which every gap is settled, seconds.",
                        s.settled_to_s * 1e3)  # fmt: skip
        yield GaugeMetricFamily(
            "tracekit_live_final",
            "1 once the run has closed: every gap settled, graph/forward on the whole run's fit.",
            value=1.0 if s.final else 0.0,
        )


def _le(x: float) -> str:
    return repr(float(x))


def _gauge_ms(name: str, doc: str, ms: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=ms / 1e3)
