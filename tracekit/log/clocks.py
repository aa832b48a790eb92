"""Clocks: which recorder clocks count wall time (`WALL_CLOCKS`), and putting a server's
processes on one clock: each process's fit against the engine core (`ClockFit`), from the
start ticks where the two read one clock, checked (or, across clocks, estimated) with
paired stamps whose order causality fixes (`tracekit.log.merge`'s module docstring says
which).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.errors import LogError
from tracekit.log.processes import ProcessLog, counter, waited_on, windows
from tracekit.log.serve_contract import ADDED, FRONT_SEP, FRONTEND, OUT, RECV, SENT, SHARED_CLOCK

#: Recorder clocks (``meta["clock"]``: the clock function's name) that count wall time:
#: the engine clock is then the wall clock offset by the start, so it maps onto Unix time
#: from the start alone (`tracekit.live`).
WALL_CLOCKS = frozenset({"perf_counter_ns", "monotonic_ns", "time_ns"})
#: Of those, the ones that never step (``time_ns`` follows the system clock's jumps): OS
#: waits lie on them, so a recorder on one takes OS evidence by default
#: (`tracekit.capture.recorder`).
STEADY_CLOCKS = WALL_CLOCKS - {"time_ns"}
#: The steady clocks themselves, for a recorder to tell its clock by identity
STEADY_CLOCK_FUNCTIONS = (time.perf_counter_ns, time.monotonic_ns)
assert {f.__name__ for f in STEADY_CLOCK_FUNCTIONS} == STEADY_CLOCKS

#: Paired-stamp bounds may miss 0 by float rounding of the tick conversions.
CAUSALITY_TOL_S = 1e-7


@dataclass(frozen=True)
class ClockFit:
    """How one process's times map onto the run's clock: ``t_run = t + offset_s +
    correction_s + drift * t`` (t: seconds from that process's recorder start)."""

    offset_s: float  # difference of recorder start ticks (exact on one clock)
    correction_s: float  # theta at the process's start: 0 on one clock
    drift: float  # d theta / dt (0 on one clock)
    uncertainty_s: float
    bound_s: tuple[float, float]  # the tightest [lo, hi] the paired stamps allow
    pairs: int
    violations: int  # pairs whose bound excludes the correction used
    method: str

    def apply(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        return t + self.offset_s + self.correction_s + self.drift * t

    def as_meta(self) -> dict[str, Any]:
        return {
            "offset_s": self.offset_s,
            "correction_s": self.correction_s,
            "drift_ppm": self.drift * 1e6,
            "uncertainty_s": self.uncertainty_s,
            "bound_s": list(self.bound_s),
            "pairs": self.pairs,
            "violations": self.violations,
            "method": self.method,
        }


def one_clock(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two processes read one clock: same host boot, perf_counter on CLOCK_MONOTONIC."""
    return bool(
        a.get("boot_id")
        and a.get("boot_id") == b.get("boot_id")
        and a.get("clock") == SHARED_CLOCK
        and b.get("clock") == SHARED_CLOCK
    )


@dataclass(frozen=True)
class CoreIndex:
    """What every other process's clock fit reads from the engine core, computed once per
    merge (so the merge is linear in the number of processes, not in processes x core rows):
    its built outputs sorted by key, its added requests by engine id, its steps' forward
    windows."""

    out_t: np.ndarray  # ``serve.out`` times, in the order of `out_v`
    out_v: np.ndarray  # ``serve.out`` keys, sorted
    added: dict[str, float]  # engine id -> ``serve.added`` time
    forward: np.ndarray  # (n, 2): per step, its forward windows' [first start, last end]

    @classmethod
    def of(cls, core: ProcessLog) -> CoreIndex:
        c_t, c_v = counter(core.log, OUT)
        o = np.argsort(c_v, kind="stable")
        a_t, a_v = counter(core.log, ADDED)
        ids = core.log.request_ids
        added = {}
        for t, v in zip(a_t.tolist(), a_v.tolist(), strict=True):
            if 0 <= v < len(ids) and v == int(v):
                added[ids[int(v)]] = t
        fwd = windows(core.log, ("prefill", "decode", "verify"), steps_only=True)
        return cls(c_t[o], c_v[o], added, fwd)


def match_sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices (into sorted `keys`, into `values`) of the values found among the keys: the
    first of equal keys, each value once (as `np.intersect1d` pairs them)."""
    if not len(keys) or not len(values):
        z = np.zeros(0, dtype=np.int64)
        return z, z
    uv, first = np.unique(values, return_index=True)
    k = np.searchsorted(keys, uv, side="left")
    ok = k < len(keys)
    ok[ok] = keys[k[ok]] == uv[ok]
    return k[ok], first[ok]


def frontend_bounds(core: ProcessLog, fe: ProcessLog, offset_s: float,
                    index: CoreIndex | None = None):  # fmt: skip
    """Paired-stamp bounds on the API server's correction, at the API server's times:
    (t_lo, lo, t_hi, hi) with ``theta >= lo`` at t_lo and ``theta <= hi`` at t_hi."""
    ix = index or CoreIndex.of(core)
    # outputs built (core) -> received (frontend), keyed by vLLM's outputs timestamp
    f_t, f_v = counter(fe.log, RECV)
    ci, fi = match_sorted(ix.out_v, f_v)
    t_lo = f_t[fi]
    lo = ix.out_t[ci] - (f_t[fi] + offset_s)
    # request sent (frontend) -> added (core), keyed by the engine id
    s_t, s_v = counter(fe.log, SENT)
    names = fe.log.request_ids
    t_hi, hi = [], []
    for t, v in zip(s_t.tolist(), s_v.tolist(), strict=True):
        if not (0 <= v < len(names) and v == int(v)):
            continue  # not a request index of this log: no pair
        engine_id = names[int(v)].split(FRONT_SEP, 1)[-1]
        ta = ix.added.get(engine_id)
        if ta is not None:
            t_hi.append(t)
            hi.append(ta - (t + offset_s))
    return t_lo, lo, np.asarray(t_hi, dtype=np.float64), np.asarray(hi, dtype=np.float64)


def worker_bounds(core: ProcessLog, wk: ProcessLog, offset_s: float,
                  index: CoreIndex | None = None):  # fmt: skip
    """Paired-stamp bounds on a worker's correction: the worker starts its n-th window
    (``execute_model``) after the engine core began its n-th forward window; it ends it
    before the engine core's wait returns if the engine core waits for its outputs
    (`waited_on`), else it entered that window's last collective before then (the rank the
    engine core waits for leaves a collective only after every rank entered it)."""
    c = (index or CoreIndex.of(core)).forward
    w_prep = windows(wk.log, ("prepare",), steps_only=False)
    w_fwd = windows(wk.log, ("forward",), steps_only=False)
    if not len(c) or not len(w_fwd):
        return (np.zeros(0),) * 4
    # a worker window is (prepare start or forward start, forward end); prepare precedes
    # its forward, so pair each forward with the last prepare that ended at its start
    starts = w_fwd[:, 0].copy()
    if len(w_prep):
        k = np.searchsorted(w_prep[:, 1], w_fwd[:, 0], side="right") - 1
        ok = (k >= 0) & (np.abs(w_prep[np.clip(k, 0, None), 1] - w_fwd[:, 0]) < 1e-9)
        starts[ok] = w_prep[k[ok], 0]
    w = np.column_stack([starts, w_fwd[:, 1]])
    # serving windows only: from the engine core's first step (startup runs come before)
    w = w[w[:, 0] + offset_s >= c[0, 0] - 1e-3]
    n = min(len(c), len(w))
    c, w = c[:n], w[:n]
    lo = c[:, 0] - (w[:, 0] + offset_s)  # the worker started after the core asked
    if waited_on(wk):
        t_end = w[:, 1]  # and ended before the core's wait for its outputs returned
    else:
        t_end = last_entry(wk, w)  # and entered its last collective before that
    has = ~np.isnan(t_end)
    hi = c[has, 1] - (t_end[has] + offset_s)
    return w[:, 0], lo, t_end[has], hi


def last_entry(wk: ProcessLog, w: np.ndarray) -> np.ndarray:
    """Per window [start, end] of `w`, the entry of the worker's last ``collective``
    entered within it (NaN where none was)."""
    col = windows(wk.log, ("collective",), steps_only=False)
    entries = np.sort(col[:, 0]) if len(col) else np.zeros(0)
    k = np.searchsorted(entries, w[:, 1], side="right") - 1
    found = k >= 0
    found[found] = entries[k[found]] >= w[found, 0]
    return np.where(found, entries[np.clip(k, 0, None)] if len(entries) else np.nan, np.nan)


def fit_clock(t_lo, lo, t_hi, hi, *, offset_s: float, shared: bool) -> ClockFit:
    """The correction for one process from its paired-stamp bounds (see the module doc)."""
    t_lo, lo, t_hi, hi = (np.asarray(x, dtype=np.float64) for x in (t_lo, lo, t_hi, hi))
    pairs = len(lo) + len(hi)
    bound = (float(lo.max()) if len(lo) else -np.inf, float(hi.min()) if len(hi) else np.inf)
    if shared:
        viol = int(np.sum(lo > CAUSALITY_TOL_S) + np.sum(hi < -CAUSALITY_TOL_S))
        return ClockFit(
            offset_s, 0.0, 0.0, 0.0, bound, pairs, viol, "one clock (same boot, CLOCK_MONOTONIC)"
        )
    if not len(lo) or not len(hi):
        raise LogError(
            "<merge>", "clock", "processes on different clocks need paired stamps both ways"
        )
    a, b, unc = estimate_offset(t_lo, lo, t_hi, hi)
    theta_lo = a + b * t_lo
    theta_hi = a + b * t_hi
    viol = int(np.sum(lo > theta_lo + unc) + np.sum(hi < theta_hi - unc))
    return ClockFit(offset_s, a, b, unc, bound, pairs, viol, "estimated from paired stamps")


def estimate_offset(t_lo, lo, t_hi, hi, *, bins: int = 8) -> tuple[float, float, float]:
    """``theta(t) = a + b t`` from bounds ``lo_i <= theta(t_lo_i)``, ``theta(t_hi_j) <= hi_j``:
    per time bin the tightest bounds, their midpoints fitted by least squares. Returns (a,
    b, uncertainty): half the widest bin's bound plus the largest fit residual."""
    t_all = np.concatenate([t_lo, t_hi])
    edges = np.unique(np.quantile(t_all, np.linspace(0, 1, bins + 1)))
    mids, ts, half = [], [], []
    for i in range(len(edges) - 1):
        last = i == len(edges) - 2
        ml = (t_lo >= edges[i]) & ((t_lo <= edges[i + 1]) if last else (t_lo < edges[i + 1]))
        mh = (t_hi >= edges[i]) & ((t_hi <= edges[i + 1]) if last else (t_hi < edges[i + 1]))
        if not ml.any() or not mh.any():
            continue
        lo_b, hi_b = lo[ml].max(), hi[mh].min()
        mids.append((lo_b + hi_b) / 2)
        half.append(abs(hi_b - lo_b) / 2)
        ts.append((edges[i] + edges[i + 1]) / 2)
    if not mids:  # bounds never share a bin: one constant from the tightest of each
        m = (lo.max() + hi.min()) / 2
        return float(m), 0.0, float(abs(hi.min() - lo.max()) / 2)
    tv, mv = np.asarray(ts), np.asarray(mids)
    if len(tv) >= 2:
        b, a = np.polyfit(tv, mv, 1)
    else:
        a, b = float(mv[0]), 0.0
    resid = float(np.max(np.abs(mv - (a + b * tv))))
    return float(a), float(b), float(max(half) + resid)


def fit_process(core: ProcessLog, p: ProcessLog, index: CoreIndex) -> ClockFit:
    """The clock fit of `p` against the engine core `core` (`index`: `CoreIndex.of(core)`)."""
    offset_s = p.t0_s - core.t0_s
    shared = one_clock(core.identity, p.identity)
    if p.role == FRONTEND:
        bounds = frontend_bounds(core, p, offset_s, index)
    else:
        bounds = worker_bounds(core, p, offset_s, index)
    if not shared and not (len(bounds[1]) and len(bounds[3])):
        # nothing to estimate from: the start ticks are all there is; say so
        return ClockFit(offset_s, 0.0, 0.0, float("inf"), (-np.inf, np.inf), 0, 0,
                        "unknown: different clocks and no paired stamps")  # fmt: skip
    return fit_clock(*bounds, offset_s=offset_s, shared=shared)
