"""The what-if's replayed timelines `R(x)` of a long run, built part by part in time order,
in memory bounded by a slice, not by the run (docs/whatif.md, "Second order";
docs/reports.md, "Reading a long run in slices").

`tracekit.analysis.whatif.replay_removed` takes every window of the run at once: the
run's bounds (every window's ends), per elementary interval the windows over it (counts,
and the sum of their removable fractions), its rate, and `R` at each bound as a running
sum from the run's start. Here the same arithmetic runs over the parts in order, a stretch
at a time, and carries across each stretch's edge what the next one needs: the last bound,
`R` there, each cover's running sum there, and the windows still open (their end is still
to come). Every bound's cover changes add up the same windows in the same order (the
segments in the log's order, then the GC pauses), and every running sum continues from
its carried value, so `R` at each bound is the whole run's, bit for bit.

A stretch ends where the parts read so far are complete: a part's rows are complete up to
its flush, or up to the start of a window still open then (`open_tick`), so no later part
holds a window that starts before. A later part that does (a log that breaks this) raises
`LateWindow`, and the caller computes `R` from the whole run's log instead.

`replay_cuts` gives each slice's `R` cut to its span, as `stream_whatif.cut_replay` cuts
the whole run's: memory, the stretches back to the earliest instant a slice still to come
asks for (its span starts at its earliest emission or its first tokens' arrival), so a
slice reaching back far (a long eviction, a long queue) keeps that much, as the slice's
own read does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from tracekit.analysis.stream import STEP_TABLES
from tracekit.analysis.whatif import cover_deltas, cover_rates, windows_of
from tracekit.log.rawlog import Evictions, RawLog
from tracekit.log.slices import SlicedRun

__all__ = ["LateWindow", "ReplayCarry", "advance", "replay_cuts"]

Replay = tuple[np.ndarray, np.ndarray]  # (bounds_s, R_s): `whatif.replayed`
#: what a stretch's windows are computed from: steps (their excess, their start) and
#: prefill chunks (the readmission share), besides the windows
_TABLES = STEP_TABLES | {"prefill_chunks"}
_INT_COVERS = ("n_gc", "n0_dev", "n1_dev", "nf_dev", "n0_host", "n1_host", "nf_host")


class LateWindow(Exception):
    """A part holds a window that starts before the stretch already replayed."""


@dataclass
class ReplayCarry:
    """What one removal's replay carries across a stretch's edge: the last bound replayed
    (None: none yet), `R` there and each cover's running sum there (`cover_deltas`)."""

    is_gc_removed: bool
    last_s: float | None = None
    cum_s: float = 0.0
    cover: dict[str, np.ndarray] = field(default_factory=lambda: {
        k: np.zeros(1, np.int64 if k in _INT_COVERS else np.float64)
        for k in (*_INT_COVERS, "sf_dev", "sf_host")})  # fmt: skip


def advance(
    carry: ReplayCarry, s: np.ndarray, e: np.ndarray, f: np.ndarray, k: np.ndarray,
    until_s: float,
) -> Replay:  # fmt: skip
    """The bounds after `carry.last_s` and before `until_s`, and `R` at each, of the
    windows `(s, e, f, k)` (`Windows`' columns, ``e > s``, in the whole run's order): every
    window with an end in that stretch, and those open across it; moves `carry` on."""
    lo = -np.inf if carry.last_s is None else carry.last_s
    ends = np.concatenate([s, e])
    bounds = np.unique(ends[(ends > lo) & (ends < until_s)])
    if not len(bounds):
        return bounds, np.zeros(0)
    on_a, on_b = (s > lo) & (s < until_s), (e > lo) & (e < until_s)
    top = len(bounds) - 1
    a = np.minimum(np.searchsorted(bounds, s), top)
    b = np.minimum(np.searchsorted(bounds, e), top)
    d = cover_deltas(a, on_a, b, on_b, f, k, len(bounds))
    # each cover after each bound: the running sum continued from the carried one
    after = {key: np.cumsum(np.concatenate([carry.cover[key], v]))[1:] for key, v in d.items()}
    if carry.last_s is None:  # the run's first bound: R is 0 there, no interval before it
        over = {key: v[:-1] for key, v in after.items()}
        width = np.diff(bounds)
        cum = np.concatenate([[0.0], np.cumsum(cover_rates(over, carry.is_gc_removed) * width)])
    else:  # the intervals from the carried bound on, the first one's cover the carried one
        over = {key: np.concatenate([carry.cover[key], v[:-1]]) for key, v in after.items()}
        width = np.diff(np.concatenate([[carry.last_s], bounds]))
        rate = cover_rates(over, carry.is_gc_removed)
        cum = np.cumsum(np.concatenate([[carry.cum_s], rate * width]))[1:]
    carry.last_s, carry.cum_s = float(bounds[-1]), float(cum[-1])
    carry.cover = {key: v[-1:] for key, v in after.items()}
    return bounds, cum


@dataclass
class _Open:
    """The windows read and not yet ended before the stretch replayed: segments, then GC
    pauses (the whole run's order), with each removal's fraction."""

    seg: list[np.ndarray]  # start, end, kind, then one fraction column per removal
    gc: list[np.ndarray]

    def add(self, seg: list[np.ndarray], gc: list[np.ndarray]) -> None:
        self.seg = [np.concatenate([x, y]) for x, y in zip(self.seg, seg, strict=True)]
        self.gc = [np.concatenate([x, y]) for x, y in zip(self.gc, gc, strict=True)]

    def columns(self) -> list[np.ndarray]:
        return [np.concatenate([x, y]) for x, y in zip(self.seg, self.gc, strict=True)]

    def drop_ended(self, before_s: float) -> None:
        """Forget the windows whose end is replayed (before `before_s`)."""
        for which in (self.seg, self.gc):
            keep = which[1] >= before_s
            which[:] = [x[keep] for x in which]


def _stretch_log(
    run: SlicedRun, a: int, b: int, evictions: Evictions
) -> tuple[RawLog, tuple[int, int], tuple[int, int]]:
    """Parts ``[a, b)`` with one part either side (a step's rows may be flushed a part from
    its windows'), the run's evictions of the requests they name (a prefill's readmission
    share looks back to each request's first eviction), and where parts ``[a, b)``'s
    segments and GC pauses lie in it (first row, number of rows). The log holds only the
    requests the parts name (`SlicedRun.local_log_from`): numbered as the run, it held
    every request named so far (a day's ~3 M, a stretch of a few parts at a time)."""
    c, d = max(a - 1, 0), min(b + 1, len(run.parts))
    parts = []
    for i in range(c, d):
        p = run.read(i)
        parts.append({**p, "tables": {k: v for k, v in p["tables"].items() if k in _TABLES}})
    local = run.local_log_from(c, d, parts, cut_to=_TABLES)
    numbers = local.numbers
    at = np.searchsorted(numbers, evictions.request)
    named = at < len(numbers)
    named[named] = numbers[at[named]] == evictions.request[named]
    log = replace(local.log, evictions=replace(evictions.take(named), request=at[named]))

    def rows(key: str) -> tuple[int, int]:
        n = [len(p["tables"].get(key, ())) for p in parts]
        return sum(n[: a - c]), sum(n[a - c : b - c])

    return log, rows("segments"), rows("gc_pauses")


def _until_s(run: SlicedRun, b: int) -> float:
    """Where the parts before `b` are complete: the last one's flush, or the start of a
    window still open then (inf: the run's end)."""
    if b >= len(run.parts):
        return np.inf
    p = run.read(b - 1)
    tick = p["flush_tick"] if p.get("open_tick") is None else min(p["flush_tick"], p["open_tick"])
    return float(run.secs(np.array(tick)))


def replay_stretches(
    run: SlicedRun,
    stretches: Sequence[tuple[int, int]],
    excess: np.ndarray,
    evictions: Evictions,
    label_sets: Sequence[tuple[str, ...]],
) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
    """Per stretch of parts ``[a, b)`` (consecutive, from the first part to the last): the
    bounds it completes and `R` at each, per removal (its ITL labels, `label_sets`), as
    `whatif.replayed` gives them on the whole run (without the OS: `with_os_removed`).
    `excess`: the whole run's per-step eager excess fraction (the ITL graph baseline's)."""
    carries = [ReplayCarry("gc" in labels) for labels in label_sets]
    n_cols = 3 + len(label_sets)
    opened = _Open([np.zeros(0)] * n_cols, [np.zeros(0)] * n_cols)
    step0 = run.parts[0].first_step
    done_s = -np.inf
    for a, b in stretches:
        log, (s0, ns), (g0, ng) = _stretch_log(run, a, b, evictions)
        first = run.parts[max(a - 1, 0)].first_step - step0
        ex = excess[first : first + len(log.steps)]
        ws = [windows_of(log, ex, labels) for labels in label_sets]
        w = ws[0]
        n_seg = len(log.segments)
        seg = np.arange(s0, s0 + ns)
        gc = np.arange(n_seg + g0, n_seg + g0 + ng)
        new = []
        for rows in (seg, gc):
            ok = rows[w.end_s[rows] > w.start_s[rows]]
            new.append([w.start_s[ok], w.end_s[ok], w.kind[ok].astype(np.float64),
                        *(x.frac[ok] for x in ws)])  # fmt: skip
            if len(ok) and float(w.start_s[ok].min()) < done_s:
                raise LateWindow(f"part {a}..{b}: a window starts before {done_s} s")
        opened.add(*new)
        until = _until_s(run, b)
        cols = opened.columns()
        s, e, k = cols[0], cols[1], cols[2].astype(np.int64)
        bounds = np.zeros(0)
        cums = []
        for carry, f in zip(carries, cols[3:], strict=True):
            bounds, cum = advance(carry, s, e, f, k, until)
            cums.append(cum)
        opened.drop_ended(until)
        done_s = until
        yield bounds, cums


def replay_cuts(
    spans: Sequence[tuple[float, float]],
    replays: Iterator[tuple[np.ndarray, list[np.ndarray]]],
    n_removals: int,
) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
    """Per slice span ``(lo_s, hi_s)`` (in order, each ending no earlier than the one
    before), the `n_removals` replays of `replays` (`replay_stretches`) cut to it as
    `stream_whatif.cut_replay` cuts the whole run's: from the bound at or before `lo_s` to
    the one at or after `hi_s`. A run with no window: ``([0], [0])``, as `replay_removed`."""
    buf: list[tuple[np.ndarray, list[np.ndarray]]] = []
    j, ended, seen = 0, False, 0
    it = iter(replays)
    while j < len(spans):
        lo, hi = spans[j]
        ready = ended or (bool(buf) and len(buf[-1][0]) and float(buf[-1][0][-1]) >= hi)
        if not ready:
            try:
                piece = next(it)
            except StopIteration:
                ended = True
                continue
            if len(piece[0]):
                buf.append(piece)
                seen += len(piece[0])
            continue
        if not seen:  # no window in the run
            yield np.zeros(1), [np.zeros(1) for _ in range(n_removals)]
            j += 1
            continue
        bounds = np.concatenate([x for x, _ in buf])
        cums = [np.concatenate(c) for c in zip(*(y for _, y in buf), strict=True)]
        n = len(bounds)
        k0 = min(max(int(np.searchsorted(bounds, lo, "right")) - 1, 0), n - 1)
        k1 = max(min(int(np.searchsorted(bounds, hi, "left")) + 1, n), k0 + 1)
        yield bounds[k0:k1].copy(), [c[k0:k1].copy() for c in cums]
        j += 1
        need = min((s_lo for s_lo, _ in spans[j:]), default=np.inf)
        while len(buf) > 1 and float(buf[1][0][0]) <= need:  # the bound at or before it
            buf.pop(0)
