"""Small hand-built raw logs for tests, in milliseconds for readability."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracekit.rawlog import (
    Counters,
    Emissions,
    Evictions,
    GcPauses,
    RawLog,
    Requests,
    Segments,
    Steps,
)

LABELS = ("tok", "swap", "prefill", "decode")


@dataclass
class LogBuilder:
    """Add steps, segments, pauses, emissions and evictions with times in ms."""

    labels: list[str] = field(default_factory=lambda: list(LABELS))
    steps: list[tuple] = field(default_factory=list)
    segs: list[tuple] = field(default_factory=list)
    gcs: list[tuple] = field(default_factory=list)
    ems: list[tuple] = field(default_factory=list)
    evs: list[tuple] = field(default_factory=list)
    num_requests: int = 1

    def step(self, t0, t1, *, n_decode=1, n_prefill=0, graph=1, preempted=0, swapped=0) -> int:
        self.steps.append((t0, t1, n_decode, n_prefill, graph, preempted, swapped))
        return len(self.steps) - 1

    def seg(self, step, label, t0, t1, thread=0, device=False):
        if label not in self.labels:
            self.labels.append(label)
        self.segs.append((step, self.labels.index(label), t0, t1, thread, int(device)))

    def gc(self, t0, t1, gen=0):
        self.gcs.append((t0, t1, gen))

    def emit(self, req, t, step, n=1, reads=None):
        """`reads`: the step whose device work this emission reads (default: `step`)."""
        self.num_requests = max(self.num_requests, req + 1)
        self.ems.append((req, t, step, n, step if reads is None else reads))

    def evict(self, req, t_evict, t_readmit=float("nan"), mode=0):
        self.num_requests = max(self.num_requests, req + 1)
        self.evs.append((req, t_evict, t_readmit, mode))

    def build(self, *, wall_ms=None, config=None, arrivals_ms=None) -> RawLog:
        s = 1e-3

        def arr(rows, width):
            return np.array(rows, dtype=np.float64).reshape(-1, width)

        st, sg, gc_, em, ev = (
            arr(self.steps, 7),
            arr(self.segs, 6),
            arr(self.gcs, 3),
            arr(self.ems, 5),
            arr(self.evs, 4),
        )
        n = self.num_requests

        def ms(t: np.ndarray) -> np.ndarray:
            return t * s

        arrival = np.zeros(n) if arrivals_ms is None else np.asarray(arrivals_ms) * s
        first = np.full(n, np.nan)
        for r, t, *_ in sorted(self.ems, key=lambda e: e[1], reverse=True):
            first[r] = t * s
        times = [x for row in st for x in row[:2]] + list(em[:, 1]) + [0.0]
        return RawLog(
            steps=Steps.from_rows(st, time=ms),
            segments=Segments.from_rows(sg, time=ms),
            gc_pauses=GcPauses.from_rows(gc_, time=ms),
            emissions=Emissions.from_rows(em, time=ms),
            evictions=Evictions.from_rows(ev, time=ms),
            requests=Requests(
                arrival_s=arrival,
                prompt_tokens=np.full(n, 10),
                max_new_tokens=np.full(n, 100),
                first_token_s=first,
            ),
            counters=Counters.empty(),
            labels=tuple(self.labels),
            request_ids=tuple(f"r{i}" for i in range(n)),
            config=config or {},
            wall_s=(wall_ms if wall_ms is not None else max(times)) * s,
        )
