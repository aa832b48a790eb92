"""Who evicted whom: every eviction joined with its recorded cause, every window's
`preempt` part named by the evictions it comes from, and every window's share of others'
re-prefill named by the victim's eviction (docs/partition.md, "Who evicted whom").

A window (a gap, or a TTFT window from the engine core's add to the first token) has in
its `preempt` part its request's own evicted time (rule 1), its own re-prefill after a
recompute eviction (`tracekit.attribution.reprefill`), and the live time of the other
segments the cause map sends to `preempt` (a KV ``swap``). This module splits that part,
exactly, into pieces, each naming one eviction (the victim, when it was evicted, the step
that decided it, the reason and the evictors of its `preemptions` row):

1. **evicted**: the window's own evicted time goes to the eviction whose window holds it
   (where two evictions of one request overlap, the earlier owns the overlap);
2. **recompute**: its own re-prefill, over its own evictions re-prefilling in the
   segments' steps, by the re-prefill split's shares;
3. **the rest** (segment time): split over the other preempt-mapped segments inside the
   window's live time in proportion to their overlap with it, and each segment's share
   over the evictions that did work in its step: the victims *re-prefilling* there
   (readmitted after a recompute eviction by the step's end, not emitting again before its
   start): by their prefill chunk's tokens in the step, or equally where none of them has
   a chunk row there; else the victims *evicted or readmitted* in the step (equally); a
   segment with neither is one piece with no eviction (``victim`` None).

Others' re-prefill in a window's prefill part is named the same way (`name_reprefill`):
one piece per victim re-prefilling in the segments it overlaps, by the split's shares.

Evictions are rare, so this is plain loops over the few windows and segments they touch:
it is its own reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.attribution.itl import Partition
from tracekit.attribution.reprefill import (
    merged_intervals,
    reprefills,
    victims_next_emission,
    window_pieces,
)
from tracekit.attribution.ttft import TtftPartition, pre_engine_windows, wait_windows
from tracekit.labels import segment_cause
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
        t_next_s=victims_next_emission(log),  # as a cut log's meta states it, if it does
        **cols,
    )


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


@dataclass(frozen=True)
class NamedWindows:
    """Windows whose `preempt` part and re-prefill time are to be named (gaps, or TTFT
    windows from the engine core's add to the first token): per window its request,
    [t0, t1], `preempt` ms, its own re-prefill ms (inside `preempt`) and others' re-prefill
    ms (inside its others' prefill), and `cuts`: per window, the times taken out of its live
    time besides its own evicted time (a TTFT window's held time)."""

    request: np.ndarray
    t0_s: np.ndarray
    t1_s: np.ndarray
    preempt_ms: np.ndarray
    own_ms: np.ndarray
    other_ms: np.ndarray
    cuts: dict[int, list[tuple[float, float]]]

    @classmethod
    def of_gaps(cls, part: Partition) -> NamedWindows:
        pre = part.column("preempt") if "preempt" in part.labels else np.zeros(len(part))
        return cls(part.request, part.t0_s, part.t1_s, pre, part.reprefill_own_ms,
                   part.reprefill_other_ms, {})  # fmt: skip


def ttft_named_windows(log: RawLog, tp: TtftPartition) -> NamedWindows:
    """The TTFT windows of `tp` to name: from the engine core's add to the first token (the
    rules from 1 on, docs/ttft.md), their held windows (wait windows in the queued phase)
    cut from their live time."""
    _, e = pre_engine_windows(log, tp.request, tp.arrival_s, tp.first_token_s)
    row_of = {r: i for i, r in enumerate(tp.request.tolist())}
    q_req, q0, q1, _ = wait_windows(log)
    cuts: dict[int, list[tuple[float, float]]] = {}
    for r, a, b in zip(q_req.tolist(), q0.tolist(), q1.tolist(), strict=True):
        i = row_of.get(r)
        if i is None or not np.isfinite(tp.admit_s[i]):
            continue
        x0, x1 = max(a, float(e[i])), min(b, float(tp.admit_s[i]))
        if x1 > x0:
            cuts.setdefault(i, []).append((x0, x1))
    pre = tp.column("preempt") if "preempt" in tp.labels else np.zeros(len(tp))
    return NamedWindows(tp.request, e, tp.first_token_s, pre, tp.reprefill_own_ms,
                        tp.reprefill_other_ms, cuts)  # fmt: skip


class _Namer:
    """What naming needs of one run: its evictions with their causes, the work in each step,
    its re-prefill segments and its other preempt-mapped segments (a KV `swap`)."""

    def __init__(self, log: RawLog) -> None:
        self.log = log
        self.c = eviction_causes(log)
        self.work = _StepWork(log, self.c)
        self.rp = reprefills(log)
        seg = log.segments
        mapped = np.array(
            [segment_cause(x, log.cause_map) == "preempt" for x in log.labels] + [False]
        )
        s_idx = np.flatnonzero(mapped[seg.label]) if len(seg) else np.zeros(0, dtype=np.int64)
        self.segs = (seg.t_start_s[s_idx], seg.t_end_s[s_idx], seg.step[s_idx])

    def evicted(self, w: NamedWindows, g: int) -> tuple[list[tuple[int, float]], list]:
        """(own eviction pieces, every cut of the window's live time)."""
        t0, t1 = float(w.t0_s[g]), float(w.t1_s[g])
        own = _evicted_pieces(self.c, int(w.request[g]), t0, t1)
        cuts = list(w.cuts.get(g, []))
        for i, _ in own:  # live time only: each own eviction window out
            end = self.c.t_readmit_s[i]
            cuts.append(
                (max(float(self.c.t_evict_s[i]), t0), t1 if np.isnan(end) else min(float(end), t1))
            )
        return own, cuts

    def reprefill(self, w: NamedWindows, g: int, cuts: list, own: bool, ms: float) -> list[dict]:
        """The window's own (or others') re-prefill `ms` as pieces by eviction."""
        pieces = window_pieces(self.rp, int(w.request[g]), float(w.t0_s[g]), float(w.t1_s[g]), cuts)
        mine = [(row, x) for row, x, is_own in pieces if is_own == own]
        total = sum(x for _, x in mine)
        if total <= 0:
            return [_describe(self.log, self.c, None, "recompute", ms)]
        return [_describe(self.log, self.c, row, "recompute", ms * x / total) for row, x in mine]


def name_preempt(log: RawLog, w: NamedWindows, rows: Any = None) -> dict[int, list[dict]]:
    """For each window (`rows`: those to explain, default every one) whose `preempt` part
    is positive, its pieces (docs/partition.md, "Who evicted whom"), summing to the part.
    Positive: above `PIECE_TOL_MS` (a part that float rounding left at +-1e-17 ms is none:
    its sign would depend on the order the partition added in)."""
    sel = np.flatnonzero(w.preempt_ms > PIECE_TOL_MS)
    if rows is not None:
        sel = np.intersect1d(sel, np.asarray(rows, dtype=np.int64))
    if not len(sel):
        return {}
    nm = _Namer(log)
    out: dict[int, list[dict]] = {}
    for g in sel.tolist():
        own, cuts = nm.evicted(w, g)
        pieces = [_describe(log, nm.c, i, "evicted", ms) for i, ms in own]
        own_rc = float(w.own_ms[g])
        if own_rc > PIECE_TOL_MS:
            pieces += nm.reprefill(w, g, cuts, True, own_rc)
        rest = float(w.preempt_ms[g]) - sum(ms for _, ms in own) - own_rc
        if rest > PIECE_TOL_MS:
            gap = (float(w.t0_s[g]), float(w.t1_s[g]))
            pieces += _segment_pieces(log, nm.c, nm.work, nm.segs, cuts, gap, rest)
        out[g] = pieces
    return out


def name_reprefill(log: RawLog, w: NamedWindows, rows: Any = None) -> dict[int, list[dict]]:
    """For each window (`rows`: those to explain) with others' re-prefill time in its
    others' prefill, its pieces: each names the victim whose re-prefill it sat through (its
    eviction's time, step, reason and evictors; None where no victim re-prefilled there);
    they sum to that time."""
    sel = np.flatnonzero(w.other_ms > PIECE_TOL_MS)
    if rows is not None:
        sel = np.intersect1d(sel, np.asarray(rows, dtype=np.int64))
    if not len(sel):
        return {}
    nm = _Namer(log)
    return {g: nm.reprefill(w, g, nm.evicted(w, g)[1], False, float(w.other_ms[g]))
            for g in sel.tolist()}  # fmt: skip


def preempt_causes(log: RawLog, part: Partition, rows: Any = None) -> dict[int, list[dict]]:
    """For each gap row (`rows`: those to explain, default every one) whose `preempt` part
    is positive, its pieces (docs/partition.md, "Who evicted whom"): dicts with ``kind``
    (``evicted``, ``recompute`` for its own re-prefill, or ``swap``/``preempt`` for other
    preempt segments by the eviction's mode), ``ms`` (the pieces sum to the gap's `preempt`
    part), ``victim``, ``evicted_at_s``, ``step`` (the step that decided it), ``reason``
    and ``evictors`` (request ids)."""
    if not len(part):
        return {}
    return name_preempt(log, NamedWindows.of_gaps(part), rows)


def recompute_causes(log: RawLog, part: Partition, rows: Any = None) -> dict[int, list[dict]]:
    """For each gap row (`rows`) whose `prefill` part holds others' re-prefill, its pieces
    (kind ``recompute``), each naming the victim's eviction; they sum to that share
    (`Partition.reprefill_other_ms`)."""
    if not len(part):
        return {}
    return name_reprefill(log, NamedWindows.of_gaps(part), rows)


def _segment_pieces(
    log: RawLog,
    c: EvictionCauses,
    work: _StepWork,
    segs: tuple[np.ndarray, np.ndarray, np.ndarray],
    cuts: list[tuple[float, float]],
    gap: tuple[float, float],
    rest_ms: float,
) -> list[dict]:
    """Rule 2: `rest_ms` over the preempt-mapped segments (re-prefills aside) in the
    window's live time (`cuts` taken out)."""
    s0, s1, s_step = segs
    t0, t1 = gap
    ov = np.clip(np.minimum(s1, t1) - np.maximum(s0, t0), 0.0, None)
    for e0, e1 in merged_intervals(cuts):
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
