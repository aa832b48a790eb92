"""What live mode measured: plain result objects the settler (`tracekit.live.settler`)
returns and the exporters (`tracekit.live.prometheus`, `tracekit.live.otel`) read.

Nothing here knows how a value is exported; nothing in the exporters partitions a gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SlowGap:
    """One settled gap at or above the SLO: what its span says.

    t0_s/t1_s: the gap's opening and closing emissions, engine-clock seconds since the
    run's ``t0_tick``. steps: the run's step indices overlapping ``[t0_s, t1_s]`` (at most
    `MAX_SPAN_STEPS`: the first and last halves); num_steps: how many overlap in all.
    parts_ms: the gap's partition (graph/forward with the fit so far, see the settler).
    """

    request_index: int
    request_id: str
    gap_ms: float
    t0_s: float
    t1_s: float
    step0: int
    step1: int
    steps: list[int]
    num_steps: int
    primary_cause: str
    parts_ms: dict[str, float]
    graph_fit_steps: int


@dataclass(slots=True)
class Settlement:
    """What one settlement (one flushed batch, or the close) added."""

    num_gaps: int = 0
    slow_gaps: list[SlowGap] = field(default_factory=list)
    is_final: bool = False
    errors: list[Exception] = field(default_factory=list)  # what failed but did not stop it


@dataclass(slots=True)
class LiveTotals:
    """Every total settled so far, consistent with each other (what a scrape shows).

    hist: the report's gap bins ``[lo, hi)`` (`tracekit.analysis.figures.HIST_EDGES_MS`).
    gap_le: per bucket of the settler's ``gap_buckets_s`` (then +Inf), the gaps above the
    bucket before it and <= its bound (not cumulated); ttft_hist: the same for TTFTs.
    cause_ms: gap time by label, graph/forward under the fit so far (exact once final);
    decode_ms: graph + forward (fit-free). tail_*: the gaps at or above the sliding p99.
    settled_to_s: engine-clock seconds up to which every gap is settled (NaN: none yet).
    evictions_by_reason: evictions received, by their cause's reason (``unknown``: no cause
    told); recomputed_tokens: the computed tokens recompute evictions threw away, as told
    (counted as their rows arrive, not as gaps settle).
    """

    gaps: int = 0
    gap_sum_s: float = 0.0
    hist: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    gap_le: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cause_ms: dict[str, float] = field(default_factory=dict)
    decode_ms: float = 0.0
    tail_count: dict[str, int] = field(default_factory=dict)
    tail_ms: dict[str, float] = field(default_factory=dict)
    itl_window_p99_ms: float = math.nan
    ttft_n: int = 0
    ttft_sum_s: float = 0.0
    ttft_hist: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    ttft_window_p50_ms: float = math.nan
    ttft_window_p99_ms: float = math.nan
    ttft_cause_ms: dict[str, float] = field(default_factory=dict)
    late_rows: int = 0
    truncated_gaps: int = 0
    truncated_ttfts: int = 0
    fit_steps: int = 0
    settled_to_s: float = math.nan
    final: bool = False
    #: per cause label: when its series began, wall-clock seconds since the epoch (the
    #: sink's start for the standard labels, the flush that first named it for the others)
    created_s: dict[str, float] = field(default_factory=dict)
    evictions_by_reason: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0

    def copy(self) -> LiveTotals:
        return LiveTotals(
            gaps=self.gaps,
            gap_sum_s=self.gap_sum_s,
            hist=self.hist.copy(),
            gap_le=self.gap_le.copy(),
            cause_ms=dict(self.cause_ms),
            decode_ms=self.decode_ms,
            tail_count=dict(self.tail_count),
            tail_ms=dict(self.tail_ms),
            itl_window_p99_ms=self.itl_window_p99_ms,
            ttft_n=self.ttft_n,
            ttft_sum_s=self.ttft_sum_s,
            ttft_hist=self.ttft_hist.copy(),
            ttft_window_p50_ms=self.ttft_window_p50_ms,
            ttft_window_p99_ms=self.ttft_window_p99_ms,
            ttft_cause_ms=dict(self.ttft_cause_ms),
            late_rows=self.late_rows,
            truncated_gaps=self.truncated_gaps,
            truncated_ttfts=self.truncated_ttfts,
            fit_steps=self.fit_steps,
            settled_to_s=self.settled_to_s,
            final=self.final,
            created_s=dict(self.created_s),
            evictions_by_reason=dict(self.evictions_by_reason),
            recomputed_tokens=self.recomputed_tokens,
        )


@dataclass(slots=True)
class WorkerStats:
    """How the live worker itself is doing (not a measurement of the engine)."""

    errors: int = 0
    spans: int = 0
    backlog_batches: int = 0
    cpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class GapExemplar:
    """A slow gap's span, standing for the histogram bucket its gap falls in."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    gap_s: float
    unix_s: float  # when the gap closed, Unix seconds


@dataclass(slots=True)
class WallView:
    """The engine clock on the wall clock, and what the exporters show with it."""

    settled_to_unix_s: float = float("nan")  # every gap closing by then is settled
    exemplars: dict[int, GapExemplar] = field(default_factory=dict)  # by gap bucket
