"""The OpenTelemetry exporter of live mode: one span per slow gap
(`tracekit.live.stats.SlowGap`). Needs ``opentelemetry-api`` (the `live` extra)."""

from __future__ import annotations

from typing import Any

from tracekit.live.stats import SlowGap


class SpanAttributes:
    """The attribute names of a slow gap's span."""

    REQUEST_ID = "tracekit.request_id"
    GAP_MS = "tracekit.gap_ms"
    T0_S = "tracekit.t0_s"
    T1_S = "tracekit.t1_s"
    STEP0 = "tracekit.step0"
    STEP1 = "tracekit.step1"
    STEPS = "tracekit.steps"
    NUM_STEPS = "tracekit.num_steps"
    PRIMARY_CAUSE = "tracekit.primary_cause"
    GRAPH_FIT_STEPS = "tracekit.graph_fit_steps"
    PART_PREFIX = "tracekit.part."  # then the label and "_ms"


SPAN_NAME = "tracekit.gap"


class GapSpanExporter:
    """Sends one span per slow gap through `tracer_provider` (default: the global one)."""

    def __init__(self, tracer_provider: Any = None) -> None:
        from opentelemetry import trace

        provider = tracer_provider or trace.get_tracer_provider()
        self._tracer = provider.get_tracer("tracekit.live")

    def export(self, gaps: list[SlowGap], unix0_s: float) -> int:
        """Spans for `gaps` (engine-clock seconds + `unix0_s` = Unix time); returns how many."""
        A = SpanAttributes
        for g in gaps:
            attrs: dict[str, Any] = {
                A.REQUEST_ID: g.request_id,
                A.GAP_MS: g.gap_ms,
                A.T0_S: g.t0_s,
                A.T1_S: g.t1_s,
                A.STEP0: g.step0,
                A.STEP1: g.step1,
                A.STEPS: g.steps,
                A.NUM_STEPS: g.num_steps,
                A.PRIMARY_CAUSE: g.primary_cause,
                A.GRAPH_FIT_STEPS: g.graph_fit_steps,
            }
            for lb, v in g.parts_ms.items():
                attrs[f"{A.PART_PREFIX}{lb}_ms"] = v
            start_ns = int((unix0_s + g.t0_s) * 1e9)
            span = self._tracer.start_span(SPAN_NAME, start_time=start_ns, attributes=attrs)
            span.end(end_time=max(start_ns, int((unix0_s + g.t1_s) * 1e9)))
        return len(gaps)
