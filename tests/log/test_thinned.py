"""What a slice keeps of the emissions before its own gaps (`tracekit.log.slices.Thinned`,
docs/reports.md, "Reading a long run in slices"): per part each request's first and last
before them, every emission of a request evicted or readmitted in the parts so far, and
every emission from them on; the parts whole where a cut emission may follow a victim's
first eviction row (rows written out of order)."""

from __future__ import annotations

import numpy as np

from tracekit.log.flush import EVICT, READMIT
from tracekit.log.slices import Thinned


def _part(emissions: list[tuple[int, int]], events: list[tuple[int, int, int]] = ()) -> dict:
    """A parsed part's tables: emissions (request, tick), events (request, kind, tick)."""
    em = np.array([(r, t, 0, 1, -1) for r, t in emissions], dtype=np.int64).reshape(-1, 5)
    ev = np.array([(r, k, t, 0) for r, k, t in events], dtype=np.int64).reshape(-1, 4)
    return {"tables": {"emissions": em, "events": ev}}


def _kept(part: dict) -> list[tuple[int, int]]:
    em = part["tables"]["emissions"]
    return [(int(r), int(t)) for r, t in em[:, :2]]


def _secs(ticks: np.ndarray) -> np.ndarray:
    return ticks.astype(np.float64)


def test_each_request_keeps_its_first_and_last_before_the_cut_and_victims_keep_all():
    thin = Thinned(10.0, _secs)
    # request 0 emits four times before 10 s, 1 twice, 2 three times (evicted later)
    thin.add(_part([(0, 1), (1, 2), (0, 2), (2, 1), (0, 3), (2, 2), (0, 4), (2, 3), (1, 5)]))
    # request 2 evicted at 6 s and readmitted at 7 s; request 0 emits at 6, 7, 8 and 11 s
    thin.add(_part([(0, 6), (2, 8), (0, 7), (2, 9), (0, 8), (0, 11)],
                   [(2, EVICT, 6), (2, READMIT, 7)]))  # fmt: skip
    parts = thin.kept()
    assert parts is not None
    # part 1: request 0's first (1 s) and last (4 s), both of 1's, 2's first and last:
    # its eviction comes in a later part, after every emission cut here
    assert _kept(parts[0]) == [(0, 1), (1, 2), (2, 1), (0, 4), (2, 3), (1, 5)]
    # part 2: the victim's every emission; request 0's first and last before 10 s (7 s
    # cut) and its emission at 11 s, after the cut
    assert _kept(parts[1]) == [(0, 6), (2, 8), (2, 9), (0, 8), (0, 11)]


def test_a_victim_whose_eviction_row_precedes_a_cut_emission_leaves_the_parts_whole():
    thin = Thinned(10.0, _secs)
    thin.add(_part([(2, 1), (2, 2), (2, 3)]))  # 2 s cut: after the eviction at 1.5 s
    thin.add(_part([(2, 4)], [(2, EVICT, 1), (2, READMIT, 1)]))
    assert thin.kept() is None


def test_nothing_is_cut_from_the_run_s_start_or_after_the_cut():
    for before in (-np.inf, 0.5):
        thin = Thinned(before, _secs)
        part = _part([(0, 1), (0, 2), (0, 3)])
        thin.add(part)
        assert thin.kept() == [part]
