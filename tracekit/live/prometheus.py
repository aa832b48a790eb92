"""The Prometheus exporter of live mode: a collector that turns the settler's totals
(`tracekit.live.stats.LiveTotals`) into metric families at each scrape, and the HTTP
server that serves them (plain text, or OpenMetrics with exemplars when the scraper asks
for it). Needs ``prometheus_client`` (the `live` extra).

Conventions: every series carries the constant labels (run, engine, model, process by
default); a bucket ``le="X"`` counts the values <= X; every labelled series a run can
have from the start (each standard cause, each primary cause and ``clean``) is there at 0
from the first scrape; what is a counter only ever goes up. The graph/forward split of
decode time moves while the graph baseline is refitted, so it is a gauge
(``tracekit_gap_decode_split_seconds``); the counter holds ``decode`` (their sum), which
is settled for good. TTFT's ``graph`` and ``decode_other`` are exported as their sum,
``decode``, for the same reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Exemplar

from tracekit.live.stats import LiveTotals, WallView, WorkerStats

Reader = Callable[[], tuple[LiveTotals, WorkerStats, WallView]]
#: What a scrape of the client-boundary TTFT reads, consistently: counts per bucket (the
#: last one +Inf), their sum in seconds, and whether the recorder has stopped.
ClientReader = Callable[[], tuple[np.ndarray, float, bool]]
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
#: Decode's parts (the graph baseline's split), exported as a gauge, never as a counter.
DECODE_SPLIT = ("graph", "forward")
#: TTFT parts exported as one counter, ``decode`` (others' decoding, however it splits).
TTFT_DECODE_PARTS = ("decode_other", "graph")


def make_registry(read: Reader, **collector: Any) -> tuple[CollectorRegistry, LiveCollector]:
    """A registry of its own holding one `LiveCollector` over `read` (both returned)."""
    registry = CollectorRegistry(auto_describe=False)
    col = LiveCollector(read, **collector)
    registry.register(col)
    return registry, col


def client_ttft_registry(read: ClientReader, **collector: Any) -> CollectorRegistry:
    """A registry of its own holding one `ClientTtftCollector` over `read`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClientTtftCollector(read, **collector))
    return registry


def serve(registry: CollectorRegistry, port: int, addr: str) -> Any:
    """Serve ``/metrics`` from `registry` on its own threads; returns the server."""
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server


def safe_label(v: Any) -> str:
    """A label value that encodes as UTF-8 whatever it holds (a lone surrogate from a
    byte-decoded name comes out as its escape, so the scrape stays valid)."""
    return str(v).encode("utf-8", "backslashreplace").decode("utf-8")


class _Families:
    """What every tracekit collector shares: the constant labels on every series, and
    families built with them (a histogram's buckets cumulative, ``le`` counting <=)."""

    const: dict[str, str] | None = None

    def set_const_labels(self, labels: Mapping[str, str]) -> None:
        for k in labels:
            if not _LABEL_NAME.fullmatch(str(k)) or str(k).startswith("__"):
                raise ValueError(f"const_labels: {k!r} is not a Prometheus label name")
            if k in ("cause", "primary_cause", "le"):
                raise ValueError(f"const_labels: {k!r} is a label tracekit's series use")
        self.const = {str(k): safe_label(v) for k, v in labels.items()}

    def describe(self) -> list[Any]:
        return []

    # -- families with the constant labels ------------------------------------------------
    def _fam(self, cls: Any, name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        return cls(name, doc, labels=[*(self.const or {}), *labels])

    def _add(self, fam: Any, values: tuple[str, ...], *a: Any, **kw: Any) -> None:
        const = list((self.const or {}).values())
        fam.add_metric([*const, *(safe_label(v) for v in values)], *a, **kw)

    def _one(self, cls: Any, name: str, doc: str, value: float) -> Any:
        f = self._fam(cls, name, doc)
        self._add(f, (), value)
        return f

    def _hist(self, name, doc, bounds, counts, sum_s, exemplars=None) -> Any:
        f = self._fam(HistogramMetricFamily, name, doc)
        cum = np.cumsum(counts).tolist()
        buckets: list[Any] = []
        for i, (b, n) in enumerate(zip([*bounds, math.inf], cum, strict=True)):
            le = "+Inf" if math.isinf(b) else repr(float(b))
            ex = (exemplars or {}).get(i)
            if ex is None:
                buckets.append((le, n))
            else:
                labels = {"trace_id": ex.trace_id, "span_id": ex.span_id}
                buckets.append((le, n, Exemplar(labels, ex.gap_s, ex.unix_s)))
        self._add(f, (), buckets=buckets, sum_value=sum_s)
        return f


class LiveCollector(_Families):
    """Builds the metric families from one consistent read of the totals at each scrape.

    const_labels: added to every series (names must be Prometheus label names).
    gap_buckets_s / ttft_buckets_s: the settler's bucket bounds (its counts are per bucket).
    """

    def __init__(
        self,
        read: Reader,
        *,
        const_labels: Mapping[str, str] | None = None,
        gap_buckets_s: tuple[float, ...],
        ttft_buckets_s: tuple[float, ...],
    ) -> None:
        self.read = read
        if const_labels is not None:
            self.set_const_labels(const_labels)
        self.gap_buckets_s = gap_buckets_s
        self.ttft_buckets_s = ttft_buckets_s

    def collect(self) -> Iterator[Any]:
        if self.const is None:  # the run has not started: its labels are not known yet
            return
        s, w, v = self.read()
        yield from self._gap_families(s, v)
        yield from self._ttft_families(s)
        yield from self._eviction_families(s)
        yield from self._worker_families(s, w, v)

    def _eviction_families(self, s: LiveTotals) -> Iterator[Any]:
        """Evictions by their cause's reason, and the tokens recompute threw away."""
        c = self._fam(
            CounterMetricFamily,
            "tracekit_evictions",
            "Evictions, by the reason the scheduler gave (unknown: no cause told).",
            ("reason",),
        )
        for reason, n in sorted(s.evictions_by_reason.items()):
            self._add(c, (reason,), n)
        yield c
        yield self._one(CounterMetricFamily, "tracekit_recomputed_tokens",
                        "Computed tokens that recompute evictions threw away (as the scheduler "
                        "told them): the recompute tax's numerator.",
                        s.recomputed_tokens)  # fmt: skip

    def _gap_families(self, s: LiveTotals, v: WallView) -> Iterator[Any]:
        """The gaps: count, histogram, time by cause, decode's split, the sliding tail."""
        yield self._one(CounterMetricFamily, "tracekit_gaps",
                        "Inter-token gaps settled (consecutive emissions of one request).",
                        s.gaps)  # fmt: skip
        yield self._hist(
            "tracekit_gap_seconds",
            "Inter-token gaps, seconds; exemplars: a slow gap's span (trace_id, span_id).",
            self.gap_buckets_s, s.gap_le, s.gap_sum_s, v.exemplars,
        )  # fmt: skip
        c = self._fam(
            CounterMetricFamily,
            "tracekit_gap_cause_seconds",
            "Gap time by cause (the exclusive partition), seconds; decode is graph + forward "
            "(their split: tracekit_gap_decode_split_seconds).",
            ("cause",),
        )
        for lb, ms in sorted(s.cause_ms.items()):
            if lb not in DECODE_SPLIT:
                self._add(c, (lb,), ms / 1e3, created=s.created_s.get(lb))
        self._add(c, ("decode",), s.decode_ms / 1e3, created=s.created_s.get("decode"))
        yield c
        g = self._fam(
            GaugeMetricFamily,
            "tracekit_gap_decode_split_seconds",
            "Decode time of the settled gaps split by the graph baseline fitted so far "
            "(graph: excess of eager steps; forward: the rest), seconds; moves at each refit, "
            "final once tracekit_live_final is 1.",
            ("cause",),
        )
        for lb in DECODE_SPLIT:
            self._add(g, (lb,), s.cause_ms.get(lb, 0.0) / 1e3)
        yield g
        t = self._fam(
            CounterMetricFamily,
            "tracekit_tail_gaps",
            "Gaps at or above the sliding window's p99, by primary cause ('clean' included).",
            ("primary_cause",),
        )
        for lb, n in sorted(s.tail_count.items()):
            self._add(t, (lb,), n, created=s.created_s.get(lb))
        yield t
        tm = self._fam(
            CounterMetricFamily,
            "tracekit_tail_gap_cause_seconds",
            "Time of the gaps at or above the sliding window's p99, by cause, seconds "
            "(graph/forward under the fit at the time each gap was settled).",
            ("cause",),
        )
        for lb, ms in sorted(s.tail_ms.items()):
            self._add(tm, (lb,), ms / 1e3, created=s.created_s.get(lb))
        yield tm
        yield self._one(GaugeMetricFamily, "tracekit_itl_window_p99_seconds",
                        "p99 of the sliding window of recent gaps, seconds.",
                        s.itl_window_p99_ms / 1e3)  # fmt: skip

    def _ttft_families(self, s: LiveTotals) -> Iterator[Any]:
        """The TTFTs: histogram, sliding median and p99, time by cause."""
        yield self._hist(
            "tracekit_ttft_seconds",
            "Time to first token (first emission - arrival) per request, seconds.",
            self.ttft_buckets_s, s.ttft_hist, s.ttft_sum_s,
        )  # fmt: skip
        yield self._one(GaugeMetricFamily, "tracekit_ttft_window_p50_seconds",
                        "Median TTFT over the sliding window of recent requests, seconds.",
                        s.ttft_window_p50_ms / 1e3)  # fmt: skip
        yield self._one(GaugeMetricFamily, "tracekit_ttft_window_p99_seconds",
                        "p99 TTFT over the sliding window of recent requests, seconds.",
                        s.ttft_window_p99_ms / 1e3)  # fmt: skip
        if s.ttft_cause_ms:
            tt = self._fam(
                CounterMetricFamily,
                "tracekit_ttft_cause_seconds",
                "TTFT time by cause, seconds (decode: others' decoding, graph included).",
                ("cause",),
            )
            dec = 0.0
            for lb, ms in sorted(s.ttft_cause_ms.items()):
                if lb in TTFT_DECODE_PARTS:
                    dec += ms
                else:
                    self._add(tt, (lb,), ms / 1e3, created=s.created_s.get(lb))
            self._add(tt, ("decode",), dec / 1e3, created=s.created_s.get("decode"))
            yield tt

    def _worker_families(self, s: LiveTotals, w: WorkerStats, v: WallView) -> Iterator[Any]:
        """What live mode itself did: late rows, truncations, errors, spans, its CPU time,
        backlog, how far it has settled, and whether the run is final."""
        for name, value, doc in (
            ("tracekit_live_late_rows", s.late_rows,
             "Rows that arrived after the gaps they overlap were exported (raise hold_s)."),
            ("tracekit_live_truncated_gaps", s.truncated_gaps,
             "Gaps settled after rows they needed were dropped (a request quiet > max_retain_s)."),
            ("tracekit_live_truncated_ttfts", s.truncated_ttfts,
             "TTFTs counted without their causes (a wait longer than max_retain_s)."),
            ("tracekit_live_errors", w.errors, "Settlements that failed (logged once)."),
            ("tracekit_live_spans", w.spans, "OpenTelemetry spans sent for gaps above the SLO."),
            ("tracekit_live_cpu_seconds", w.cpu_s,
             "CPU time the live worker thread spent partitioning and exporting."),
        ):  # fmt: skip
            yield self._one(CounterMetricFamily, name, doc, value)
        yield self._one(GaugeMetricFamily, "tracekit_live_backlog_batches",
                        "Flushed batches not yet settled.", w.backlog_batches)  # fmt: skip
        yield self._one(
            GaugeMetricFamily,
            "tracekit_live_settled_to_timestamp_seconds",
            "Unix time up to which every gap is settled (the engine clock mapped onto the "
            "wall clock at each flush).",
            v.settled_to_unix_s,
        )
        yield self._one(
            GaugeMetricFamily,
            "tracekit_live_final",
            "1 once the run has closed: every gap settled, graph/forward on the whole run's fit.",
            1.0 if s.final else 0.0,
        )


class ClientTtftCollector(_Families):
    """An API server's ``tracekit_ttft_client_seconds`` (`tracekit.live.client_ttft`), with
    its constant labels, at 0 from the first scrape; ``tracekit_live_final`` 1 once its
    recorder stopped."""

    def __init__(self, read: ClientReader, *, const_labels: Mapping[str, str],
                 buckets_s: tuple[float, ...]) -> None:  # fmt: skip
        self.read = read
        self.set_const_labels(const_labels)
        self.buckets_s = buckets_s

    def collect(self) -> Iterator[Any]:
        counts, sum_s, final = self.read()
        yield self._hist(
            "tracekit_ttft_client_seconds",
            "Time to first token at the client boundary per streamed request: its arrival at "
            "this API server (the HTTP request's first byte) to its first chunk's write, "
            "seconds.",
            self.buckets_s, counts, sum_s,
        )  # fmt: skip
        yield self._one(GaugeMetricFamily, "tracekit_live_final",
                        "1 once this API server's recorder has stopped (every TTFT counted).",
                        1.0 if final else 0.0)  # fmt: skip
