"""Who evicted whom: every eviction joined with its recorded cause, and every gap's
`preempt` part named by the evictions it comes from (docs/partition.md, "Who evicted whom").

The partition's labels are unchanged: a gap's `preempt` part is its request's own evicted
time (rule 1) plus the live time of segments the cause map sends to `preempt` (a KV
``swap``, a ``recompute`` re-prefill). This module splits that part, exactly, into pieces,
each naming one eviction (the victim, when it was evicted, the step that decided it, the
reason and the evictors of its `preemptions` row):

1. **evicted**: the gap's own evicted time goes to the eviction whose window holds it
   (where two evictions of one request overlap, the earlier owns the overlap);
2. **the rest** (segment time): split over the preempt-mapped segments inside the gap's
   live time in proportion to their overlap with it, and each segment's share over the
   evictions that did work in its step: the victims *re-prefilling* there (readmitted
   after a recompute eviction by the step's end, not emitting again before its start): by
   their prefill chunk's tokens in the step, or equally where none of them has a chunk
   row there; else the victims *evicted or readmitted* in the step (equally); a segment
   with neither is one piece with no eviction (``victim`` None).

Evictions are rare, so this is plain loops over the few gaps and segments they touch: it
is its own reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.attribution.itl import Partition
from tracekit.log.rawlog import MODE_RECOMPUTE, MODE_SWAP, PREEMPT_REASONS, RawLog

#: A remainder below this (ms) is float rounding, not segment time.
PIECE_TOL_MS = 1e-9
#: A piece's kind: the gap's own evicted time, or segment time of an eviction by its mode.
KIND_OF_MODE = {MODE_SWAP: "swap", MODE_RECOMPUTE: "recompute"}


@dataclass(frozen=True)
class EvictionCauses:
    """One row per eviction (the log's `Evictions` order), with its cause where recorded:
    `step`, `reason` (index into PREEMPT_REASONS) and the counts are -1 and `evictors`
    empty where the engine told no cause; `t_next_s`: the victim's first emission after
    its readmission (NaN: none)."""

    request: np.ndarray
    t_evict_s: np.ndarray
    t_readmit_s: np.ndarray
    mode: np.ndarray
    step: np.ndarray
    reason: np.ndarray
    num_computed_tokens_lost: np.ndarray
    num_free_blocks: np.ndarray
    num_used_blocks: np.ndarray
    evictors: tuple[tuple[int, ...], ...]
    t_next_s: np.ndarray

    def __len__(self) -> int:
        return len(self.request)

    @property
    def has_cause(self) -> np.ndarray:
        return self.reason >= 0


def eviction_causes(log: RawLog) -> EvictionCauses:
    """Every eviction with its `preemptions` row and `evictors` rows, joined on (request,
    time) as validation guarantees they can be."""
    ev, pe, by = log.evictions, log.preemptions, log.evictors
    n = len(ev)
    row_of = {
        (r, t): i
        for i, (r, t) in enumerate(zip(ev.request.tolist(), ev.t_evict_s.tolist(), strict=True))
    }
    cols = {k: np.full(n, -1, dtype=np.int64) for k in (
        "step", "reason", "num_computed_tokens_lost", "num_free_blocks", "num_used_blocks",
    )}  # fmt: skip
    for j, key in enumerate(zip(pe.request.tolist(), pe.t_s.tolist(), strict=True)):
        i = row_of.get(key)
        if i is not None:
            for k, col in cols.items():
                col[i] = getattr(pe, k)[j]
    evictors: list[list[int]] = [[] for _ in range(n)]
    for r, t, e in zip(by.request.tolist(), by.t_s.tolist(), by.evictor.tolist(), strict=True):
        i = row_of.get((r, t))
        if i is not None:
            evictors[i].append(e)
    return EvictionCauses(
        request=ev.request,
        t_evict_s=ev.t_evict_s,
        t_readmit_s=ev.t_readmit_s,
        mode=ev.mode,
        evictors=tuple(tuple(x) for x in evictors),
        t_next_s=_next_emission(log, ev.request, ev.t_readmit_s),
        **cols,
    )


def _next_emission(log: RawLog, request: np.ndarray, after_s: np.ndarray) -> np.ndarray:
    """Each request's first emission strictly after `after_s` (NaN: none, or NaN given)."""
    em = log.emissions
    out = np.full(len(request), np.nan)
    if not len(em):
        return out
    o = np.lexsort((em.t_s, em.request))
    r, t = em.request[o], em.t_s[o]
    for i, (q, a) in enumerate(zip(request.tolist(), after_s.tolist(), strict=True)):
        if np.isnan(a):
            continue
        lo, hi = np.searchsorted(r, q, "left"), np.searchsorted(r, q, "right")
        k = lo + np.searchsorted(t[lo:hi], a, "right")
        if k < hi:
            out[i] = t[k]
    return out


def _describe(log: RawLog, c: EvictionCauses, i: int | None, kind: str, ms: float) -> dict:
    """One piece as a JSON-ready record (`i` None: time no eviction explains)."""
    if i is None:
        return {"kind": kind, "ms": ms, "victim": None, "evicted_at_s": None, "step": None,
                "reason": None, "evictors": []}  # fmt: skip
    names = log.request_names()
    reason = int(c.reason[i])
    return {
        "kind": kind,
        "ms": ms,
        "victim": names[int(c.request[i])],
        "evicted_at_s": float(c.t_evict_s[i]),
        "step": int(c.step[i]) if c.step[i] >= 0 else None,
        "reason": PREEMPT_REASONS[reason] if 0 <= reason < len(PREEMPT_REASONS) else None,
        "evictors": [names[e] for e in c.evictors[i]],
    }


def _evicted_pieces(c: EvictionCauses, r: int, t0: float, t1: float) -> list[tuple[int, float]]:
    """(eviction row, ms) of request `r`'s own evicted time inside [t0, t1]; an open
    eviction runs to t1; overlapping evictions: the earlier owns the overlap."""
    rows = np.flatnonzero(c.request == r)
    rows = rows[np.argsort(c.t_evict_s[rows], kind="stable")]
    out, covered = [], t0
    for i in rows.tolist():
        end = c.t_readmit_s[i]
        a = max(float(c.t_evict_s[i]), covered)
        b = min(t1 if np.isnan(end) else float(end), t1)
        if b > a:
            out.append((i, (b - a) * 1e3))
            covered = b
    return out


class _StepWork:
    """Per step, the evictions that did work in it (rule 2's candidates)."""

    def __init__(self, log: RawLog, c: EvictionCauses) -> None:
        st = log.steps
        self.t0, self.t1 = st.t_start_s, st.t_end_s
        self.chunks: dict[tuple[int, int], int] = {}
        pf = log.prefill_chunks
        for s, q, k in zip(pf.step.tolist(), pf.request.tolist(), pf.num_tokens.tolist(),
                           strict=True):  # fmt: skip
            self.chunks[(s, q)] = self.chunks.get((s, q), 0) + k
        self.c = c

    def candidates(self, step: int) -> list[tuple[int, float]]:
        """(eviction row, weight) for a preempt-mapped segment of `step` (weights sum to 1)."""
        if not 0 <= step < len(self.t0):
            return []
        c, a, b = self.c, float(self.t0[step]), float(self.t1[step])
        back = c.t_readmit_s <= b  # NaN compares False: never readmitted
        next_ok = np.where(np.isnan(c.t_next_s), np.inf, c.t_next_s) >= a
        re = np.flatnonzero((c.mode == MODE_RECOMPUTE) & back & next_ok)
        w = [(i, float(self.chunks.get((step, int(c.request[i])), 0))) for i in re.tolist()]
        w = [(i, x) for i, x in w if x > 0]
        if not w:  # none of them has a prefill chunk row in the step: equal shares
            w = [(i, 1.0) for i in re.tolist()]
        if not w:
            inside = ((c.t_evict_s >= a) & (c.t_evict_s <= b)) | (
                (c.t_readmit_s >= a) & (c.t_readmit_s <= b)
            )
            w = [(i, 1.0) for i in np.flatnonzero(inside).tolist()]
        total = sum(x for _, x in w)
        return [(i, x / total) for i, x in w]


def preempt_causes(log: RawLog, part: Partition, rows: Any = None) -> dict[int, list[dict]]:
    """For each gap row (`rows`: those to explain, default every one) whose `preempt` part
    is positive, its pieces (docs/partition.md, "Who evicted whom"): dicts with ``kind``
    (``evicted``, or ``recompute``/``swap``/``preempt`` by the eviction's mode), ``ms``
    (the pieces sum to the gap's `preempt` part), ``victim``, ``evicted_at_s``, ``step``
    (the step that decided it), ``reason`` and ``evictors`` (request ids)."""
    if "preempt" not in part.labels or not len(part):
        return {}
    pre = part.column("preempt")
    sel = np.flatnonzero(pre > 0)
    if rows is not None:
        sel = np.intersect1d(sel, np.asarray(rows, dtype=np.int64))
    if not len(sel):
        return {}
    c = eviction_causes(log)
    work = _StepWork(log, c)
    seg = log.segments
    mapped = np.array([log.cause_map.get(x, x) == "preempt" for x in log.labels], dtype=bool)
    on = mapped[seg.label] if len(seg) else np.zeros(0, dtype=bool)
    s_idx = np.flatnonzero(on)
    s0, s1, s_step = seg.t_start_s[s_idx], seg.t_end_s[s_idx], seg.step[s_idx]
    out: dict[int, list[dict]] = {}
    for g in sel.tolist():
        r, t0, t1 = int(part.request[g]), float(part.t0_s[g]), float(part.t1_s[g])
        own = _evicted_pieces(c, r, t0, t1)
        pieces = [_describe(log, c, i, "evicted", ms) for i, ms in own]
        rest = float(pre[g]) - sum(ms for _, ms in own)
        if rest > PIECE_TOL_MS:
            pieces += _segment_pieces(log, c, work, (s0, s1, s_step), own, (t0, t1), rest)
        out[g] = pieces
    return out


def _segment_pieces(
    log: RawLog,
    c: EvictionCauses,
    work: _StepWork,
    segs: tuple[np.ndarray, np.ndarray, np.ndarray],
    own: list[tuple[int, float]],
    gap: tuple[float, float],
    rest_ms: float,
) -> list[dict]:
    """Rule 2: `rest_ms` over the preempt-mapped segments in the gap's live time."""
    s0, s1, s_step = segs
    t0, t1 = gap
    ov = np.clip(np.minimum(s1, t1) - np.maximum(s0, t0), 0.0, None)
    for i, _ in own:  # live time only: take each own eviction window out
        e0 = max(float(c.t_evict_s[i]), t0)
        e1 = t1 if np.isnan(c.t_readmit_s[i]) else min(float(c.t_readmit_s[i]), t1)
        ov -= np.clip(np.minimum(s1, e1) - np.maximum(s0, e0), 0.0, None)
    ov = np.clip(ov, 0.0, None)
    total = float(ov.sum())
    if total <= 0:
        return [_describe(log, c, None, "preempt", rest_ms)]
    share: dict[int | None, float] = {}
    for k in np.flatnonzero(ov > 0).tolist():
        ms = rest_ms * float(ov[k]) / total
        cand: list[tuple[int | None, float]] = list(work.candidates(int(s_step[k])))
        for row, w in cand or [(None, 1.0)]:
            share[row] = share.get(row, 0.0) + ms * w
    out = []
    for row, ms in share.items():
        kind = "preempt" if row is None else KIND_OF_MODE.get(int(c.mode[row]), "preempt")
        out.append(_describe(log, c, row, kind, ms))
    return out
