"""The re-prefill split with plain loops, for the reference partitions
(`tracekit.attribution.reference`): straight from the written rule (docs/partition.md,
"The re-prefill in the partition"), sharing nothing with `tracekit.attribution.reprefill`
but the log.

A window's re-prefill time (what the partition's rules left the `recompute` segments in
it) is split over those segments by their overlap with the window's live time, and each
segment's share over the victims re-prefilling in its step; the share of the window's own
request is `preempt`, the rest others' prefill.
"""

from __future__ import annotations

import math

from tracekit.labels import RECOMPUTE_CLASS, segment_cause
from tracekit.log.rawlog import MODE_RECOMPUTE, RawLog


class ReprefillReference:
    """One run's re-prefill segments and evictions as plain lists."""

    def __init__(self, log: RawLog) -> None:
        sg, ev, em, st = log.segments, log.evictions, log.emissions, log.steps
        self.segs = [
            (float(sg.t_start_s[i]), float(sg.t_end_s[i]), int(sg.step[i]))
            for i in range(len(sg))
            if segment_cause(log.labels[int(sg.label[i])], log.cause_map) == RECOMPUTE_CLASS
        ]
        self.steps = list(zip(st.t_start_s.tolist(), st.t_end_s.tolist(), strict=True))
        self.emissions = list(zip(em.request.tolist(), em.t_s.tolist(), strict=True))
        self.evictions = list(
            zip(ev.request.tolist(), ev.t_readmit_s.tolist(), ev.mode.tolist(), strict=True)
        )
        pf = log.prefill_chunks
        self.chunks = list(zip(pf.step.tolist(), pf.request.tolist(), pf.num_tokens.tolist(),
                               strict=True))  # fmt: skip

    def victims(self, step: int) -> list[tuple[int, float]]:
        """(request, weight) of each eviction re-prefilling in `step` (one entry per
        eviction): recompute mode, readmitted by the step's end, no emission of its request
        after the readmission and before the step's start; by prefill tokens, else equally."""
        if not 0 <= step < len(self.steps):
            return []
        a, b = self.steps[step]
        found = []
        for r, back, mode in self.evictions:
            if mode != MODE_RECOMPUTE or math.isnan(back) or back > b:
                continue
            if any(q == r and back < t < a for q, t in self.emissions):
                continue  # it emitted again before the step began
            tokens = sum(k for s, q, k in self.chunks if s == step and q == r)
            found.append((r, float(tokens)))
        if any(w > 0 for _, w in found):
            found = [(r, w) for r, w in found if w > 0]
        else:
            found = [(r, 1.0) for r, _ in found]
        total = sum(w for _, w in found)
        return [(r, w / total) for r, w in found]

    def own_share(self, request: int, t0: float, t1: float, cuts: list[tuple[float, float]]):
        """The share of the window [t0, t1]'s re-prefill time that is `request`'s own; `cuts`:
        the times taken out of its live time (its evicted and held windows)."""
        own = total = 0.0
        for a, b, step in self.segs:
            # the segment's live overlap, point by point between every boundary
            points = sorted({a, b, t0, t1} | {p for c in cuts for p in c})
            ov = 0.0
            for x, y in zip(points[:-1], points[1:], strict=True):
                inside = a <= x and y <= b and t0 <= x and y <= t1
                if inside and not any(c0 <= x and y <= c1 for c0, c1 in cuts):
                    ov += y - x
            if ov <= 0:
                continue
            total += ov
            own += ov * sum(w for r, w in self.victims(step) if r == request)
        return own / total if total > 0 else 0.0
