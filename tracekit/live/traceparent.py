"""W3C trace context as live mode reads it: the ``traceparent`` header an engine
propagates with a request (vLLM's under ``vllm serve``), whose span a slow gap's span
becomes a child of (`tracekit.live.otel`). No OpenTelemetry import: a sink without spans
still checks what it is given."""

from __future__ import annotations

import re

#: A W3C trace context ``traceparent`` header: version 00, trace id, parent span id, flags
#: (lower-case hex; an all-zero trace or span id is invalid).
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
#: How many requests' propagated parents are kept (the oldest given is forgotten first: a
#: request whose slow gap settles after this many later requests got theirs falls back to
#: a trace of its own).
MAX_PARENTS = 65_536


def parse_traceparent(header: str) -> tuple[int, int, int]:
    """(trace id, parent span id, trace flags) of a W3C ``traceparent`` header
    (``00-<32 hex>-<16 hex>-<2 hex>``); ValueError naming what is wrong otherwise."""
    if not isinstance(header, str):
        raise ValueError(f"traceparent: expected a string, got {type(header).__name__}")
    m = _TRACEPARENT.fullmatch(header.strip())
    if m is None:
        raise ValueError(
            f"traceparent: {header[:80]!r} is not 00-<32 hex trace id>-<16 hex span id>-<2 hex "
            "flags> (W3C trace context)"
        )
    trace_id, span_id, flags = (int(g, 16) for g in m.groups())
    if trace_id == 0 or span_id == 0:
        raise ValueError(f"traceparent: {header[:80]!r} has an all-zero trace or span id")
    return trace_id, span_id, flags
