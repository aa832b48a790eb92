"""The figures counted over intervals (`tracekit.analysis.interval_figures`) equal numpy's
over every gap, bit for bit: on random layouts (evictions, device windows, OS evidence,
re-prefills, GC) and on a batched engine's log, against the same figures of the same
partition without its interval view (a selection of all its gaps), which takes numpy's
functions on every gap."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from synthlog import synthetic_log
from test_partition_properties import random_logs

from tracekit.analysis.figures import HIST_EDGES_MS, PERCENTILES, analyze
from tracekit.analysis.interval_figures import (
    clean_forward_median,
    gap_percentiles,
    hist_grid,
    primary_counts,
)
from tracekit.attribution.itl import CLEAN, partition
from tracekit.attribution.ttft import ttft_partition

QS = [0.0, *(q for _, q in PERCENTILES), 100.0]


def _bits(x) -> bytes:
    return np.asarray(x, dtype=np.float64).tobytes()


def _assert_same_figures(log) -> None:
    p = partition(log)
    whole = p.take(np.arange(len(p)))  # every gap, no interval view: numpy on every gap
    assert p.intervals is not None and whole.intervals is None
    v = p.intervals
    # what the view promises, gap by gap
    one = v.interval >= 0
    assert _bits(p.gap_ms[one]) == _bits(v.width_ms[v.interval[one]])
    kept = np.flatnonzero(v.keeps)
    assert one[kept].all()
    assert (p.primary[kept] == v.primary[v.interval[kept]]).all()
    fwd = p.labels.index("forward")
    assert _bits(p.column("forward")[kept]) == _bits(v.parts_ms[v.interval[kept], fwd])
    assert (p.parts_ms[kept] == v.parts_ms[v.interval[kept]]).all()  # in value
    # the reconcile check's figures, over intervals, against every gap's
    assert _bits(p.reconcile_bounds()) == _bits(
        (whole.reconcile_err_ms.max(initial=0.0), whole.parts_ms.min(initial=np.inf))
    )
    assert _bits(p.reconcile_max_err_ms) == _bits(whole.reconcile_max_err_ms)
    # each figure, against numpy's on every gap
    assert _bits(gap_percentiles(p, QS)) == _bits(gap_percentiles(whole, QS))
    if len(p):
        assert _bits(gap_percentiles(p, QS)) == _bits(np.percentile(p.gap_ms, QS))
    edges = np.array(HIST_EDGES_MS)
    assert (hist_grid(p, edges) == hist_grid(whole, edges)).all()
    assert (primary_counts(p) == primary_counts(whole)).all()
    prim = np.where(p.primary == CLEAN, len(p.causes), p.primary)
    assert (primary_counts(whole) == np.bincount(prim, minlength=len(p.causes) + 1)).all()
    assert _bits(clean_forward_median(p)) == _bits(clean_forward_median(whole))
    tp = ttft_partition(log)
    assert analyze(log, p, tp).to_dict() == analyze(log, whole, tp).to_dict()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_logs())
def test_figures_over_intervals_are_numpys_over_gaps_on_random_layouts(log):
    _assert_same_figures(log)


def test_figures_over_intervals_are_numpys_over_gaps_on_a_batched_engine():
    """Tens of gaps an interval, GC pauses, evictions and eager steps (seeded)."""
    for seed in (1, 2):
        _assert_same_figures(synthetic_log(seed=seed, duration_s=3.0))


def test_the_reconcile_check_over_intervals_still_names_a_gap_that_does_not_add_up():
    """A gap whose parts miss its length by 1 ms, one of the gaps counted one by one (its
    interval's parts not its own), and an interval whose parts miss its length: each is a
    `ReconcileError` (design.md, "The partition": a violation is an error)."""
    import dataclasses

    import pytest

    from tracekit.attribution.itl import check_reconciled
    from tracekit.errors import ReconcileError

    p = partition(synthetic_log(seed=1, duration_s=3.0))
    v = p.intervals
    assert v is not None and len(v.others)
    bad = p.parts_ms.copy(order="F")
    g = int(v.others[0])
    bad[g, p.labels.index("residual")] += 1.0
    with pytest.raises(ReconcileError, match=f"gap {g} "):
        check_reconciled(dataclasses.replace(p, parts_ms=bad, _cache={}))
    off = dataclasses.replace(v, parts_ms=v.parts_ms + 1.0)
    with pytest.raises(ReconcileError):
        check_reconciled(dataclasses.replace(p, intervals=off, _cache={}))
