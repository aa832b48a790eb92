"""Small hand-built raw logs for tests, in milliseconds for readability."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracekit.log.rawlog import (
    PREEMPT_REASON_CODES,
    WAIT_REASON_CODES,
    Admissions,
    Counters,
    Emissions,
    Evictions,
    Evictors,
    GcPauses,
    OsSamples,
    Preemptions,
    PrefillChunks,
    RawLog,
    Requests,
    Segments,
    Steps,
    Waits,
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
    admits: list[tuple] = field(default_factory=list)
    prefills: list[tuple] = field(default_factory=list)
    waits: list[tuple] = field(default_factory=list)
    os_rows: list[tuple] = field(default_factory=list)
    causes: list[tuple] = field(default_factory=list)
    evictor_rows: list[tuple] = field(default_factory=list)

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

    def cause(self, req, t_evict, step, reason="kv_full", by=(), lost=-1, free=-1, used=-1):
        """Why `req` was evicted at `t_evict` (ms, its `evict` row's time) in `step`: the
        reason (a PREEMPT_REASONS name), its evictors, computed tokens lost, blocks."""
        self.causes.append((step, req, t_evict, PREEMPT_REASON_CODES[reason], lost, free, used))
        self.evictor_rows += [(req, t_evict, e) for e in by]

    def admit(self, req, t):
        """The first time the scheduler took `req` (ms)."""
        self.num_requests = max(self.num_requests, req + 1)
        self.admits.append((req, t))

    def prefill(self, step, req, n):
        """Step `step` computed `n` prompt tokens of `req`."""
        self.num_requests = max(self.num_requests, req + 1)
        self.prefills.append((step, req, n))

    def wait(self, step, req, reason):
        """Step `step` left `req` waiting because of `reason` (a WAIT_REASONS name)."""
        self.num_requests = max(self.num_requests, req + 1)
        self.waits.append((step, req, WAIT_REASON_CODES[reason]))

    def os_sample(self, t, cpu_ms, runqueue_ms, *, kind=0, thread=0, switches=(0, 0), faults=0):
        """The loop thread's OS counters at `t` (ms; totals since the thread started)."""
        self.os_rows.append(
            (thread, kind, t, round(cpu_ms * 1e6), round(runqueue_ms * 1e6), *switches, faults)
        )

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
            admissions=Admissions(
                request=np.array([r for r, _ in self.admits], dtype=np.int64),
                t_s=np.array([t for _, t in self.admits], dtype=np.float64) * s,
            ),
            prefill_chunks=PrefillChunks.from_columns(
                step=[x[0] for x in self.prefills],
                request=[x[1] for x in self.prefills],
                num_tokens=[x[2] for x in self.prefills],
            ),
            waits=Waits.from_columns(
                step=[x[0] for x in self.waits],
                request=[x[1] for x in self.waits],
                reason=[x[2] for x in self.waits],
            ),
            os_samples=OsSamples.from_rows(arr(self.os_rows, 8), time=ms),
            preemptions=Preemptions.from_rows(arr(self.causes, 7), time=ms),
            evictors=Evictors.from_columns(
                request=[x[0] for x in self.evictor_rows],
                t_s=ms(np.array([x[1] for x in self.evictor_rows], dtype=np.float64)),
                evictor=[x[2] for x in self.evictor_rows],
            ),
            labels=tuple(self.labels),
            request_ids=tuple(f"r{i}" for i in range(n)),
            config=config or {},
            wall_s=(wall_ms if wall_ms is not None else max(times)) * s,
        )
