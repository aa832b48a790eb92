"""Live mode: the per-cause metrics and spans a sink exports while the engine serves."""

from tracekit.live.metrics import LiveMetrics, attach

__all__ = ["LiveMetrics", "attach"]
