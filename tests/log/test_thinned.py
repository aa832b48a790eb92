"""What a slice keeps of the emissions before its own gaps (`tracekit.log.thinned`,
docs/reports.md, "Reading a long run in slices"): per part each request's first and last
before them, every emission of a request evicted or readmitted in that part, and every
emission from them on; the parts whole where an event of a request lies within the span
of its cut emissions in another part (rows written out of order)."""

from __future__ import annotations

import numpy as np

from tracekit.log.flush import EVICT, READMIT
from tracekit.log.thinned import Thinned, forget_before


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


def _thinned(before: float, parts: list[dict], keys=None) -> list[dict] | None:
    thin = Thinned(before, _secs)
    for k, part in enumerate(parts):
        thin.add(None if keys is None else keys[k], lambda part=part: part)
    return thin.kept()


def test_each_request_keeps_its_first_and_last_before_the_cut_and_victims_keep_all():
    parts = _thinned(20.0, [
        # request 0 emits four times, 1 twice, 2 three times (evicted in the next part)
        _part([(0, 1), (1, 2), (0, 2), (2, 1), (0, 3), (2, 2), (0, 4), (2, 3), (1, 5)]),
        # 2 evicted at 6 s and readmitted at 7 s: it emits at 8, 9 and 10 s ...
        _part([(0, 6), (2, 8), (0, 7), (2, 9), (0, 8), (2, 10), (0, 21)],
              [(2, EVICT, 6), (2, READMIT, 7)]),
        # ... and emits three times here, its first after its readmission kept
        _part([(2, 12), (2, 13), (2, 14)]),
    ])  # fmt: skip
    assert parts is not None
    # part 1: request 0's first (1 s) and last (4 s), both of 1's, 2's first and last:
    # its eviction comes in a later part, after every emission cut here
    assert _kept(parts[0]) == [(0, 1), (1, 2), (2, 1), (0, 4), (2, 3), (1, 5)]
    # part 2: every emission of the request evicted in it; request 0's first and last
    # before 20 s (7 s cut) and its emission at 21 s, after the cut
    assert _kept(parts[1]) == [(0, 6), (2, 8), (2, 9), (0, 8), (2, 10), (0, 21)]
    # part 3: the victim's first and last (its first after its readmission: 12 s)
    assert _kept(parts[2]) == [(2, 12), (2, 14)]


def test_an_event_within_a_cut_request_s_span_in_another_part_leaves_the_parts_whole():
    # 2 s cut from request 2's rows in part 1; its eviction row (1.5 s) came in part 2
    assert _thinned(10.0, [_part([(2, 1), (2, 2), (2, 3)]),
                           _part([(2, 4)], [(2, EVICT, 1), (2, READMIT, 1)])]) is None  # fmt: skip
    # an event outside the span (after its last row there): cut as the rule says
    parts = _thinned(10.0, [_part([(2, 1), (2, 2), (2, 3)]), _part([(2, 4)], [(2, EVICT, 3)])])
    assert parts is not None and _kept(parts[0]) == [(2, 1), (2, 3)]


def test_nothing_is_cut_from_the_run_s_start_or_after_the_cut():
    for before in (-np.inf, 0.5):
        part = _part([(0, 1), (0, 2), (0, 3)])
        assert _thinned(before, [part]) == [part]


def test_a_part_cut_whole_is_kept_for_later_slices_only():
    """A part whose every emission is before a slice's own is cut the same for any slice
    after it: read once. A slice whose own gaps start within it reads it again."""
    reads = []
    part = _part([(0, 1), (0, 2), (0, 3)])

    def read() -> dict:
        reads.append(1)
        return part

    key = ("a part", 1, 2, 3, None)
    for before, n_reads in ((10.0, 1), (12.0, 1), (2.5, 2), (3.5, 2)):
        thin = Thinned(before, _secs)
        thin.add(key, read)
        kept = thin.kept()
        assert kept is not None and len(reads) == n_reads
        want = [(0, 1), (0, 3)] if before > 3 else [(0, 1), (0, 2), (0, 3)]
        assert _kept(kept[0]) == want


def test_a_slice_read_from_a_part_lets_go_of_the_cuts_of_the_parts_before_it():
    """Slices read a run forward: the cuts of parts numbered before a slice's first part
    are let go (read again, were a slice to need them); its folder's only."""
    reads: list[str] = []

    def reader(name: str):
        def read() -> dict:
            reads.append(name)
            return _part([(0, 1), (0, 2), (0, 3)])

        return read

    paths = ["/run/a.parts/part-000001.tkp", "/run/a.parts/part-1000000.tkp",
             "/run/b.parts/part-000001.tkp"]  # fmt: skip
    for p in paths:  # each cut and kept
        Thinned(10.0, _secs).add((p, 0, 0, 0, None), reader(p))
    forget_before("/run/a.parts/part-000002.tkp")
    for p in paths:
        Thinned(10.0, _secs).add((p, 0, 0, 0, None), reader(p))
    # the first part of run a read again; the millionth (numbered after) and run b's kept
    assert reads == [*paths, paths[0]]
