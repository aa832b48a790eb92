"""Checks a loaded raw log: reject what cannot be analysed, warn about what is odd but usable.

Rejected (a `LogError` naming file, field and problem; the CLI exits 2):
  non-finite times where a time is required, reversed intervals (end before start),
  indices that point outside their table (labels, requests, steps, counters), negative
  counts, a token count below 1, a readmission before its eviction, times beyond
  `MAX_ABS_TIME_S` from engine start, a negative or non-finite wall time.

Accepted with a warning (kept on `RawLog.warnings`, printed by the CLI on stderr):
  emissions out of time order (they are sorted per request), overlapping GC pauses (the
  partition uses their union), overlapping evictions of one request (their union), a run
  with no emissions or no gaps, emissions before their request's arrival, an eviction with
  no readmission (it runs to the end of the gap it lies in, as design.md says).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .errors import LogError
from .rawlog import RawLog

#: Times further than this from engine start (about 115 days) are rejected as absurd.
MAX_ABS_TIME_S = 1.0e7


def _finite_times(log: RawLog, table: str, col: str, *, allow_nan: bool = False) -> None:
    a = getattr(getattr(log, table), col)
    bad = ~np.isfinite(a)
    if allow_nan:
        bad &= ~np.isnan(a)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LogError(log.path, f"{table}.{col}", f"row {i}: non-finite time {a[i]!r}")
    fin = a[np.isfinite(a)]
    if fin.size and np.abs(fin).max() > MAX_ABS_TIME_S:
        i = int(np.flatnonzero(np.abs(np.nan_to_num(a)) > MAX_ABS_TIME_S)[0])
        raise LogError(
            log.path,
            f"{table}.{col}",
            f"row {i}: absurd time {a[i]!r} s (times are seconds from engine start)",
        )


def _ordered(log: RawLog, table: str, start: str, end: str) -> None:
    t = getattr(log, table)
    a, b = getattr(t, start), getattr(t, end)
    bad = b < a
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LogError(
            log.path, f"{table}.{end}", f"row {i}: ends ({b[i]!r}) before it starts ({a[i]!r})"
        )


def _index(log: RawLog, table: str, col: str, n: int, *, allow_minus_one: bool = False) -> None:
    a = getattr(getattr(log, table), col)
    lo = -1 if allow_minus_one else 0
    bad = (a < lo) | (a >= n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LogError(
            log.path, f"{table}.{col}", f"row {i}: index {int(a[i])} outside [{lo}, {n - 1}]"
        )


def _non_negative(log: RawLog, table: str, col: str, lo: int = 0) -> None:
    a = getattr(getattr(log, table), col)
    bad = a < lo
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LogError(log.path, f"{table}.{col}", f"row {i}: {int(a[i])} is below {lo}")


def validate_log(log: RawLog) -> RawLog:
    """Raise `LogError` for what cannot be analysed; return the log with warnings attached."""
    warnings: list[str] = list(log.warnings)
    for table, cols in (
        ("steps", ("t_start_s", "t_end_s")),
        ("segments", ("t_start_s", "t_end_s")),
        ("gc_pauses", ("t_start_s", "t_end_s")),
        ("emissions", ("t_s",)),
        ("evictions", ("t_evict_s",)),
        ("counters", ("t_s",)),
    ):
        for c in cols:
            _finite_times(log, table, c)
    _finite_times(log, "evictions", "t_readmit_s", allow_nan=True)
    _finite_times(log, "requests", "arrival_s", allow_nan=True)
    _finite_times(log, "requests", "first_token_s", allow_nan=True)
    _ordered(log, "steps", "t_start_s", "t_end_s")
    _ordered(log, "segments", "t_start_s", "t_end_s")
    _ordered(log, "gc_pauses", "t_start_s", "t_end_s")
    ev = log.evictions
    back = ev.t_readmit_s < ev.t_evict_s  # NaN compares False: never readmitted is fine
    if back.any():
        i = int(np.flatnonzero(back)[0])
        raise LogError(log.path, "evictions.t_readmit_s", f"row {i}: readmitted before evicted")

    n_steps, n_req = len(log.steps), len(log.requests)
    _index(log, "segments", "label", len(log.labels))
    _index(log, "segments", "step", n_steps, allow_minus_one=True)
    _index(log, "emissions", "request", n_req)
    _index(log, "emissions", "step", n_steps, allow_minus_one=True)
    _index(log, "evictions", "request", n_req)
    _index(log, "counters", "name", len(log.counter_names))
    if log.request_ids and len(log.request_ids) != n_req:
        raise LogError(
            log.path,
            "request_ids",
            f"{len(log.request_ids)} ids for {n_req} requests (one id per requests row)",
        )
    for col in ("num_decode", "num_prefill_tokens", "num_preempted", "num_swapped_in"):
        _non_negative(log, "steps", col)
    _non_negative(log, "steps", "graph_size", lo=-1)
    _non_negative(log, "emissions", "num_tokens", lo=1)
    _non_negative(log, "gc_pauses", "generation")
    if not np.isfinite(log.wall_s) or log.wall_s < 0:
        raise LogError(log.path, "wall_s", f"{log.wall_s!r} is not a non-negative wall time")

    # -- odd but usable ------------------------------------------------------------------
    em = log.emissions
    if len(em) == 0:
        warnings.append("no emissions: the run has no gaps to partition")
    else:
        order = np.lexsort((em.t_s, em.request))
        if not np.array_equal(order, np.arange(len(em))):
            key = np.lexsort((em.t_s,))
            if not np.array_equal(key, np.arange(len(em))):
                warnings.append("emissions are not in time order (sorted per request)")
        arr = log.requests.arrival_s[em.request]
        early = em.t_s < arr
        if early.any():
            warnings.append(f"{int(early.sum())} emission(s) before their request's arrival")
    gc_ = log.gc_pauses
    if len(gc_) > 1:
        o = np.argsort(gc_.t_start_s, kind="stable")
        ends = np.maximum.accumulate(gc_.t_end_s[o])
        if np.any(gc_.t_start_s[o][1:] < ends[:-1]):
            warnings.append("overlapping GC pauses (the partition uses their union)")
    if len(ev):
        never = np.isnan(ev.t_readmit_s)
        if never.any():
            warnings.append(
                f"{int(never.sum())} eviction(s) never readmitted (charged to the end of the gap)"
            )
        o = np.lexsort((ev.t_evict_s, ev.request))
        r, s = ev.request[o], ev.t_evict_s[o]
        e = np.where(np.isnan(ev.t_readmit_s[o]), np.inf, ev.t_readmit_s[o])
        same = r[1:] == r[:-1]
        if np.any(same & (s[1:] < e[:-1])):
            warnings.append("overlapping evictions of one request (their union is used)")
    return replace(log, warnings=tuple(dict.fromkeys(warnings)))
