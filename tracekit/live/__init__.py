"""Live mode: every gap partitioned while the engine serves, as Prometheus metrics and
OpenTelemetry spans (the `live` extra: prometheus-client, opentelemetry-sdk).

    from tracekit.live import LiveMetrics, attach
    live = LiveMetrics(port=9400, slo_ms=200)      # metrics on :9400/metrics
    rec = tracekit.Recorder("raw/run.npz")
    attach(rec, live)                              # open at start, every flush, close at stop

The package follows what is measured apart from how it is exported:
`tracekit.live.settler` ingests the flushed batches and settles gaps and TTFTs (which gaps
are settled when, and how graph/forward settle, are written there);
`tracekit.live.stats` holds what it measured; `tracekit.live.prometheus` and
`tracekit.live.otel` export it. `LiveMetrics` (`tracekit.live.metrics`) is the recorder
sink that ties them: ``write`` only queues a batch; one background thread settles and
exports, so the engine never waits on it, nor on a scraper (the HTTP server has threads of
its own).

**What agrees with the offline analysis of the same run's raw log.** With no late rows
and no truncated gaps (both exported), after `close`: ``tracekit_gaps_total`` is the
log's gap count, ``tracekit_gap_seconds`` has the report's histogram counts, and
``tracekit_gap_cause_seconds_total{cause}`` is the sum of that label over all gaps, to
float rounding (graph/forward: see the settler).
"""

from __future__ import annotations

from typing import Any

# re-exported: every name `from tracekit.live import ...` has given (the sink, its clocks
# and logger, the settler's buckets and TTFT partitioner, what it measured)
from tracekit.live.metrics import LiveMetrics as LiveMetrics
from tracekit.live.metrics import log as log
from tracekit.live.settler import GAP_BUCKETS_S as GAP_BUCKETS_S
from tracekit.live.settler import TTFT_BUCKETS_S as TTFT_BUCKETS_S
from tracekit.live.settler import Settler as Settler
from tracekit.live.settler import TtftPartitioner as TtftPartitioner
from tracekit.live.settler import ttft_by_cause as ttft_by_cause
from tracekit.live.stats import GapExemplar as GapExemplar
from tracekit.live.stats import LiveTotals as LiveTotals
from tracekit.live.stats import WallView as WallView
from tracekit.live.stats import WorkerStats as WorkerStats
from tracekit.live.traceparent import parse_traceparent as parse_traceparent
from tracekit.log.clocks import WALL_CLOCKS as WALL_CLOCKS


def attach(recorder: Any, sink: Any) -> Any:
    """Feed `sink` from a `tracekit.Recorder` (before its start): opened at the recorder's
    start, every flushed batch written off the engine thread, closed at its stop; a sink
    that raises is logged once and detached, the recording goes on. The same as
    ``Recorder(..., sinks=[sink])``. Returns `sink`."""
    recorder.add_sink(sink)
    return sink


__all__ = ["LiveMetrics", "attach", "GAP_BUCKETS_S", "TTFT_BUCKETS_S"]
