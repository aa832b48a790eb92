"""Whose re-prefill: the recompute tax charged where it delays someone (docs/partition.md,
"Who evicted whom", "The re-prefill in the partition").

A `recompute` segment (the segment label the cause map sends to `preempt`: the re-prefill
of what a recompute eviction threw away) owns its time on the timeline as one class,
`tracekit.labels.RECOMPUTE_CLASS`. Whose debt that time is depends on the window it lies
in, so each partition splits a window's share of it (what the precedence, GC, device and
OS rules left that class there) in two:

- the part that is **its own request's re-prefill** is `preempt` (its debt);
- the rest is **others' prefill**: `prefill` in a gap, `prefill_other` in a TTFT window
  (`prefill` where the request has no admission row).

The split (`split_windows`): each re-prefill segment's overlap with the window's live time
(the window less the cuts: its request's evicted windows, and in a TTFT window its held
ones) weighs its share; within a segment, its step's *re-prefilling victims* share it
(`Reprefills.victims`): the evictions in recompute mode readmitted by the step's end whose
victim has not emitted again before the step's start, by their `prefill_chunks` tokens in
the step, or equally where none has a chunk row there. A window's own share is that of the
evictions of its request. A segment with no such victim (no eviction table, an eviction of
unknown mode, a segment outside a step) is nobody's own: others' prefill, named by no
eviction. A window with re-prefill time but no overlap left to weigh it is the same.

Evictions are rare, so this is loops over the few windows and segments they touch; the
slow reference (`tracekit.attribution.reference`) implements the same rule on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tracekit.labels import RECOMPUTE_CLASS, segment_cause
from tracekit.log.rawlog import MODE_RECOMPUTE, RawLog

#: A log cut from a longer run (a live settler's window) states in its meta, under this key,
#: each eviction's first emission of its victim after its readmission (seconds; None: none
#: yet), which its own emissions may not hold.
NEXT_EMISSION_META = "eviction_next_emission_s"


def next_emission(log: RawLog, request: np.ndarray, after_s: np.ndarray) -> np.ndarray:
    """Each request's first emission strictly after `after_s` (NaN: none, or NaN given)."""
    em = log.emissions
    out = np.full(len(request), np.nan)
    asked = np.flatnonzero(~np.isnan(after_s))
    if not len(em.request) or not len(asked):
        return out
    q_req, q_t = request[asked], after_s[asked]
    mine = np.flatnonzero(np.isin(em.request, q_req, kind="table"))  # the asked requests'
    r, t = em.request[mine], em.t_s[mine]
    # by request, then time: recorders append in time order, so one stable sort of the
    # request column (a radix sort where the indices fit 16 bits)
    if np.all(t[1:] >= t[:-1]):
        small = len(r) and 0 <= r.min() and r.max() < 65536
        o = np.argsort(r.astype(np.uint16) if small else r, kind="stable")
    else:
        o = np.lexsort((t, r))
    r, t = r[o], t[o]
    # each question's answer: the first time after it among its request's (a bisection of
    # all questions at once within each one's run of rows)
    lo = np.searchsorted(r, q_req, side="left")
    end = hi = np.searchsorted(r, q_req, side="right")
    while (active := lo < hi).any():
        mid = (lo + hi) // 2
        right = active & (t[np.minimum(mid, len(t) - 1)] <= q_t)
        lo = np.where(right, mid + 1, lo)
        hi = np.where(active & ~right, mid, hi)
    found = lo < end
    out[asked[found]] = t[lo[found]]
    return out


def victims_next_emission(log: RawLog) -> np.ndarray:
    """Each eviction's victim's first emission after its readmission (NaN: none): as the
    log's meta states it (`NEXT_EMISSION_META`), else from its emissions."""
    ev = log.evictions
    stated = log.meta.get(NEXT_EMISSION_META) if isinstance(log.meta, dict) else None
    if isinstance(stated, list) and len(stated) == len(ev):
        return np.array([np.nan if x is None else float(x) for x in stated], dtype=np.float64)
    return next_emission(log, ev.request, ev.t_readmit_s)


def stating_next_emissions(log: RawLog) -> RawLog:
    """`log` with its victims' next emissions stated in its meta (`NEXT_EMISSION_META`),
    for a caller about to drop emissions from it (a slice of a long run keeps only those
    its own gaps need): whose re-prefill a step is then stays what the whole log says."""
    nxt = victims_next_emission(log).tolist()
    meta = {**log.meta, NEXT_EMISSION_META: [None if x != x else x for x in nxt]}
    return replace(log, meta=meta)


def step_chunks(log: RawLog) -> dict[tuple[int, int], int]:
    """Prefill tokens per (step, request), from `prefill_chunks`."""
    out: dict[tuple[int, int], int] = {}
    pf = log.prefill_chunks
    for s, q, k in zip(pf.step.tolist(), pf.request.tolist(), pf.num_tokens.tolist(),
                       strict=True):  # fmt: skip
        out[(s, q)] = out.get((s, q), 0) + k
    return out


def reprefilling(
    log: RawLog, step: int, t_next_s: np.ndarray, chunks: dict[tuple[int, int], int]
) -> list[tuple[int, float]]:
    """(eviction row, weight) of the victims re-prefilling in `step` (weights sum to 1;
    empty: none): recompute mode, readmitted by the step's end, not emitting again before
    its start; by their prefill tokens in the step, or equally where none has a chunk."""
    if not 0 <= step < len(log.steps):
        return []
    ev = log.evictions
    a, b = float(log.steps.t_start_s[step]), float(log.steps.t_end_s[step])
    back = ev.t_readmit_s <= b  # NaN compares False: never readmitted
    next_ok = np.where(np.isnan(t_next_s), np.inf, t_next_s) >= a
    re = np.flatnonzero((ev.mode == MODE_RECOMPUTE) & back & next_ok).tolist()
    w = [(i, float(chunks.get((step, int(ev.request[i])), 0))) for i in re]
    w = [(i, x) for i, x in w if x > 0] or [(i, 1.0) for i in re]
    total = sum(x for _, x in w)
    return [(i, x / total) for i, x in w]


@dataclass(frozen=True)
class Reprefills:
    """A run's re-prefill segments (host and device windows), sorted by start, with the
    victims re-prefilling in each one's step (`reprefilling`); `ev_request`: each eviction
    row's request."""

    t0_s: np.ndarray
    t1_s: np.ndarray
    victims: tuple[tuple[tuple[int, float], ...], ...]
    ev_request: np.ndarray
    end_max_s: np.ndarray  # running max of t1_s: segments before the first above t ended by t

    def __len__(self) -> int:
        return len(self.t0_s)


def reprefills(log: RawLog) -> Reprefills:
    """The re-prefill segments of `log` and their victims."""
    sg = log.segments
    is_rc = np.array(
        [segment_cause(lb, log.cause_map) == RECOMPUTE_CLASS for lb in log.labels] + [False]
    )
    idx = np.flatnonzero(is_rc[sg.label]) if len(sg) else np.zeros(0, dtype=np.int64)
    idx = idx[np.argsort(sg.t_start_s[idx], kind="stable")]
    ev = log.evictions
    t_next = victims_next_emission(log) if len(idx) else np.zeros(0)
    chunks = step_chunks(log) if len(idx) else {}
    by_step: dict[int, tuple[tuple[int, float], ...]] = {}
    victims = []
    for s in sg.step[idx].tolist():
        if s not in by_step:
            by_step[s] = tuple(reprefilling(log, s, t_next, chunks))
        victims.append(by_step[s])
    t1 = sg.t_end_s[idx]
    return Reprefills(
        t0_s=sg.t_start_s[idx],
        t1_s=t1,
        victims=tuple(victims),
        ev_request=ev.request,
        end_max_s=np.maximum.accumulate(t1) if len(t1) else t1,
    )


def merged_intervals(cuts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals merged where they overlap (sorted, disjoint)."""
    out: list[list[float]] = []
    for a, b in sorted(cuts):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def window_pieces(
    rp: Reprefills, request: int, t0: float, t1: float, cuts: list[tuple[float, float]]
) -> list[tuple[int | None, float, bool]]:
    """The window's re-prefill time as shares: (eviction row or None for no victim, share,
    whether it is the window's own request's); the shares sum to 1 (one share of None
    where no segment overlaps the window's live time)."""
    lo = int(np.searchsorted(rp.end_max_s, t0, side="right"))
    hi = int(np.searchsorted(rp.t0_s, t1, side="left"))
    if hi <= lo:
        return [(None, 1.0, False)]
    s0, s1 = rp.t0_s[lo:hi], rp.t1_s[lo:hi]
    ov = np.clip(np.minimum(s1, t1) - np.maximum(s0, t0), 0.0, None)
    for a, b in merged_intervals(cuts):  # live time only: each cut (disjoint once merged) taken out
        ov -= np.clip(np.minimum(s1, min(b, t1)) - np.maximum(s0, max(a, t0)), 0.0, None)
    ov = np.clip(ov, 0.0, None)
    total = float(ov.sum())
    if total <= 0:
        return [(None, 1.0, False)]
    share: dict[int | None, float] = {}
    for k in np.flatnonzero(ov > 0).tolist():
        x = float(ov[k]) / total
        for row, w in rp.victims[lo + k] or ((None, 1.0),):
            share[row] = share.get(row, 0.0) + x * w
    return [
        (row, x, row is not None and int(rp.ev_request[row]) == request) for row, x in share.items()
    ]


def own_shares(
    rp: Reprefills,
    request: np.ndarray,
    t0: np.ndarray,
    t1: np.ndarray,
    rows: np.ndarray,
    cuts: dict[int, list[tuple[float, float]]],
) -> np.ndarray:
    """For each window in `rows`, the share of its re-prefill time that is its own
    request's (`window_pieces`; `cuts`: per window row, the times taken out of its live
    time)."""
    out = np.zeros(len(rows))
    for j, g in enumerate(rows.tolist()):
        pieces = window_pieces(rp, int(request[g]), float(t0[g]), float(t1[g]), cuts.get(g, []))
        out[j] = sum(x for _, x, own in pieces if own)
    return out


def cuts_of(
    row: np.ndarray, x0: np.ndarray, x1: np.ndarray
) -> dict[int, list[tuple[float, float]]]:
    """Cut windows grouped by the window row they belong to."""
    out: dict[int, list[tuple[float, float]]] = {}
    for g, a, b in zip(row.tolist(), x0.tolist(), x1.tolist(), strict=True):
        out.setdefault(g, []).append((a, b))
    return out
