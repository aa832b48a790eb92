"""Per-run figures counted over intervals, not gaps: the ITL percentiles, the histogram by
primary cause and the median forward share of clean gaps, each equal bit for bit to numpy's
over every gap (`tracekit.analysis.figures`).

In a batched engine most gaps span exactly one interval between consecutive distinct
emission times, and all the gaps of one interval have its length (as `gap_ms`) and, unless
a rule changed their parts, its primary cause and `forward` part
(`tracekit.attribution.itl.IntervalView`): ~112 k gaps of the published log are ~3.6 k
intervals. Each figure counts the gaps of each interval, adds the other gaps one by one,
and takes numpy's order statistics and arithmetic from the counts (`analysis.quantiles`).
A partition without the view (a selection of gaps, the reference partitioner's) takes
numpy's functions on every gap: the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tracekit.analysis.quantiles import lerp, virtual_ranks
from tracekit.attribution.itl import CLEAN, Partition


def _at_ranks(values: np.ndarray, counts: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The values at `ranks` (0-based) of the multiset holding each value `counts` times."""
    o = np.argsort(values, kind="stable")
    return values[o][np.searchsorted(np.cumsum(counts[o]), ranks, side="right")]


def gap_percentiles(p: Partition, qs: Sequence[float]) -> list[float]:
    """`np.percentile(p.gap_ms, qs)` (NaN each without gaps)."""
    gap, v = p.gap_ms, p.intervals
    if not len(gap):
        return [math.nan] * len(qs)
    if v is None:
        return [float(x) for x in np.percentile(gap, list(qs))]
    other = gap[v.others]
    values = np.concatenate([v.width_ms, other])
    counts = np.concatenate([v.keep_counts, np.ones(len(other), dtype=np.int64)])
    lo, hi, gamma = virtual_ranks(len(gap), qs)
    at = _at_ranks(values, counts, np.concatenate([lo, hi]))
    return [float(x) for x in lerp(at[: len(lo)], at[len(lo) :], gamma)]


def _bins(edges: np.ndarray, gap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    which = np.searchsorted(edges, gap, side="right") - 1
    return which, (which >= 0) & (which < len(edges) - 1)


def clean_last(primary: np.ndarray, n_causes: int) -> np.ndarray:
    """Primary causes as indices with clean last (``n_causes``): what the counts index."""
    return np.where(primary == CLEAN, n_causes, primary)


def primary_counts(p: Partition) -> np.ndarray:
    """Gaps by primary cause, clean last (`clean_last`)."""
    n_prim = len(p.causes) + 1
    v = p.intervals
    if v is None:
        return np.bincount(clean_last(p.primary, len(p.causes)), minlength=n_prim)
    per = v.keep_counts
    kept = per > 0
    prim_u = clean_last(v.primary[kept], len(p.causes))
    out = np.bincount(prim_u, weights=per[kept], minlength=n_prim).astype(np.int64)
    return out + np.bincount(clean_last(p.primary[v.others], len(p.causes)), minlength=n_prim)


def hist_grid(p: Partition, edges: np.ndarray) -> np.ndarray:
    """Gaps by histogram bin (``[edges[b], edges[b + 1])``) and primary cause: a
    (bins, causes + clean) count table, clean last (`clean_last`)."""
    gap, v = p.gap_ms, p.intervals
    n_prim = len(p.causes) + 1
    n_cells = (len(edges) - 1) * n_prim
    if v is None:
        which, ok = _bins(edges, gap)
        cell = which * n_prim + clean_last(p.primary, n_prim - 1)
        return np.bincount(cell[ok], minlength=n_cells).reshape(-1, n_prim)
    per = v.keep_counts
    which, ok = _bins(edges, v.width_ms)
    ok &= per > 0
    cell = (which * n_prim + clean_last(v.primary, n_prim - 1))[ok]
    grid = np.bincount(cell, weights=per[ok], minlength=n_cells).astype(np.int64)
    rest = v.others
    which, ok = _bins(edges, gap[rest])
    cell = which * n_prim + clean_last(p.primary[rest], n_prim - 1)
    grid += np.bincount(cell[ok], minlength=n_cells)
    return grid.reshape(-1, n_prim)


def clean_forward_median(p: Partition) -> float:
    """`np.median` of forward / gap over the clean gaps longer than 0 (NaN: none)."""
    gap, v = p.gap_ms, p.intervals
    fwd = p.column("forward")
    if v is None:
        on = np.flatnonzero((p.primary == CLEAN) & (gap > 0))
        return float(np.median(fwd[on] / gap[on])) if len(on) else math.nan
    per = v.keep_counts
    use = (v.primary == CLEAN) & (v.width_ms > 0) & (per > 0)
    rest = v.others
    rest = rest[(p.primary[rest] == CLEAN) & (gap[rest] > 0)]
    fwd_u = v.parts_ms[:, p.labels.index("forward")]
    values = np.concatenate([fwd_u[use] / v.width_ms[use], fwd[rest] / gap[rest]])
    counts = np.concatenate([per[use], np.ones(len(rest), dtype=np.int64)])
    n = int(counts.sum())
    if not n:
        return math.nan
    a, b = _at_ranks(values, counts, np.array([(n - 1) // 2, n // 2]))
    return float(np.mean(np.array([a, b]))) if n % 2 == 0 else float(a)


def forward_median(p: Partition, rows: np.ndarray) -> float:
    """`np.median` of forward / gap over the gaps `rows` (a mask) longer than 0 (NaN: none)."""
    on = np.flatnonzero(rows & (p.gap_ms > 0))
    return float(np.median(p.column("forward")[on] / p.gap_ms[on])) if len(on) else math.nan
