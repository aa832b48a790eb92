"""The OpenTelemetry exporter of live mode: one span per slow gap
(`tracekit.live.stats.SlowGap`), on the wall clock, in the request's own trace when the
engine propagated one (a W3C ``traceparent``), else in one trace per request. Needs
``opentelemetry-api`` (the `live` extra; ``opentelemetry-exporter-otlp-proto-http`` for
`otlp_provider`)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from tracekit.live.stats import SlowGap
from tracekit.live.traceparent import MAX_PARENTS, parse_traceparent


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


def otlp_provider(endpoint: str, resource: dict[str, str] | None = None) -> Any:
    """A tracer provider that sends spans to an OTLP/HTTP collector at `endpoint` (for
    example ``http://127.0.0.1:4318/v1/traces``), batched off the caller's thread."""
    # optional dependency: the SDK only where a provider is made here (the API, imported at
    # the top, sends through whatever provider the application set)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    try:  # the OTLP exporter: the `live` extra installs it, a bare SDK may lack it
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise ImportError(
            f"OTLP export needs opentelemetry-exporter-otlp-proto-http ({e.name} is "
            "missing): pip install 'tracekit[live]'"
        ) from None
    provider = TracerProvider(resource=Resource.create(resource or {}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class GapSpanExporter:
    """Sends one span per slow gap through `tracer_provider` (default: the global one).

    Every gap span of one request is in one trace. Where the engine propagated the
    request's trace context (`set_parent`, e.g. vLLM's ``traceparent`` header), each gap
    span is a child of that context's span, in its trace. Otherwise its trace id is
    derived from `run_key` and the request id (so a request's gaps group together in a
    trace view), and its parent is that trace's root id (a span this exporter never sends:
    the request's own span, where an engine exports one with the same ids)."""

    def __init__(self, tracer_provider: Any = None, *, run_key: str = "") -> None:
        provider = tracer_provider or trace.get_tracer_provider()
        self._tracer = provider.get_tracer("tracekit.live")
        self.run_key = run_key
        # request id -> its propagated parent (trace id, span id, flags); written by the
        # engine's thread, read by the exporting one (under the lock)
        self._parents: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._parents_lock = threading.Lock()

    def set_parent(self, request_id: str, traceparent: str) -> None:
        """Make the gap spans of `request_id` children of `traceparent` (W3C trace context
        header); ValueError if the header is malformed (nothing is kept then)."""
        ids = parse_traceparent(traceparent)
        with self._parents_lock:
            self._parents[str(request_id)] = ids
            self._parents.move_to_end(str(request_id))
            while len(self._parents) > MAX_PARENTS:
                self._parents.popitem(last=False)

    def request_context(self, request_id: str) -> Any:
        with self._parents_lock:
            parent = self._parents.get(request_id)
        if parent is not None:
            trace_id, span_id, flags = parent
            ctx = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
            return trace.set_span_in_context(NonRecordingSpan(ctx))
        h = hashlib.blake2b(f"{self.run_key}\0{request_id}".encode(errors="backslashreplace"))
        d = h.digest()
        trace_id = int.from_bytes(d[:16], "big") or 1
        span_id = int.from_bytes(d[16:24], "big") or 1
        ctx = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(1))
        return trace.set_span_in_context(NonRecordingSpan(ctx))

    def export(
        self, gaps: list[SlowGap], to_unix_s: Callable[[np.ndarray], np.ndarray]
    ) -> list[tuple[str, str]]:
        """Spans for `gaps`; `to_unix_s` maps engine-clock seconds to Unix seconds.
        Returns each sent span's (trace id, span id) in hex (a span whose propagated
        parent is not sampled is not sent, under the SDK's default parent-based sampler)."""
        A = SpanAttributes
        out: list[tuple[str, str]] = []
        if not gaps:
            return out
        t = to_unix_s(np.array([x for g in gaps for x in (g.t0_s, g.t1_s)]))
        for i, g in enumerate(gaps):
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
            start_ns = int(t[2 * i] * 1e9)
            span = self._tracer.start_span(
                SPAN_NAME,
                context=self.request_context(g.request_id),
                start_time=start_ns,
                attributes=attrs,
            )
            span.end(end_time=max(start_ns, int(t[2 * i + 1] * 1e9)))
            sc = span.get_span_context()
            if sc.trace_flags.sampled:  # a parent not sampled keeps its children unsent
                out.append((f"{sc.trace_id:032x}", f"{sc.span_id:016x}"))
        return out
